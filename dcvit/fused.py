"""DCMHA's attention core: which implementation runs it, and the custom op of its kernels.

With each Compose stage merged into per-token H×H matrices (`dcvit.matrices`), the attention
core is ``softmax(compose1(scale q k^T) + mask) -> compose2 -> @ v``. Five *cores* compute it:

* ``"reference"``: the `Compose` modules, one (B, H, T, S) tensor per term: the spec, what
  hooks see, and what TorchScript and ``torch.jit.trace`` (fvcore) record
  (`dcvit.core.DCMHACore.reference`);
* ``"export"``: `dcvit.export_core`, what ``torch.export`` (ONNX, AOTInductor) records: the
  maths in standard ops arranged for inference engines
  (`dcvit.matrices.attention_with_matrices`);
* ``"cpp"``: the C++ kernels (`dcvit.kernels.compose_cpu`, operators ``dcvit_cpu::*``), CPU:
  the whole core, products included, flash-style per batch element and block of queries;
  float32/float64 (bfloat16/float16 operands are computed in float32 and cast back);
* ``"triton"``: Triton kernels (`dcvit.kernels.triton_core`), CUDA: the whole core, forward
  and backward; the forward keeps each head's row log-sum-exp for the backward;
* ``"compile"``: plain differentiable PyTorch on the merged matrices
  (`composed_attention_compile`): inside ``torch.compile`` a form inductor fuses, in eager
  mode `dcvit.matrices.attention_with_matrices`, as the export core; the core of every
  case no kernel takes: the attention weights themselves (attention dropout in training), a mask that
  requires grad, more heads than a kernel holds, float64 on CUDA, no kernel built.

`select_impl` is the one place that picks a core: it returns the core and a short reason,
by context (tracing, export, compilation), device, dtype, heads and what the layer needs;
`attention_impl` (or a layer's ``attn_impl``) forces one, and a forced kernel that cannot
take the inputs is an error naming the reason, not a quiet switch.

The kernel cores run as one custom op, ``dcvit::composed_attention`` (`composed_attention`),
with its own backward op, ``dcvit::composed_attention_backward``: it saves q, k, v, the
matrices and whatever statistics the core keeps, recomputes the (B, H, T, S) maps in
backward, and ``torch.compile`` keeps it as one node. Its autograd and fake-tensor rules are
written once; a device's kernels for one core are plugged in with `register_core`, from
this module (kernels never import it): the C++ core for ``"cpu"``, the Triton core for
``"cuda"`` (the tests add ``"cpu"``, where it runs under Triton's interpreter)::

    register_core("cuda", "triton", forward, backward, stats)
    # forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale) -> (out (B, T, H, D), stats or None)
    # backward(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, scale, want)
    #     -> [dq, dk, dv, dmq1, dmk1, dmq2, dmk2]
    # stats(q, k, v) -> an empty tensor shaped as forward's statistics (fake-tensor rule)

with the op's arguments: q, k, v (B, H, N, D) on any strides, mask additive and
broadcastable to (B, H, T, S) or None, mq* (B|1, T|1, H, H), mk* (B, S, H, H) or None
(for the Triton core as its kernels read them, `triton_core.kernel_matrices`: zero-padded
to 8 × 8 at up to 7 heads from Triton 3.8 on, before the op, so that autograd keeps them
so for the backward), ``grad`` of the output's (B, H, T, D) view, ``want`` the matrix
gradients autograd needs.
A kernel given operands it cannot take raises; `select_impl` never sends it those. The op
returns the statistics beside the output (a zero-size tensor for a core that keeps none,
such as the C++ one) and hands them, as they are, to the backward.

FLOP counting: ``torch.utils.flop_counter`` formulas are registered for both ops, so that
``FlopCounterMode`` counts a kernel core as the reference core's products: q kᵀ and p v
(`attention_macs`) and both Compose stages in the paper's formulation
(`dcvit.matrices.compose_stage_macs`, passed by the layer as ``compose_macs``), 2 FLOPs
per multiply-add; the backward counts twice the forward (each product's two operand
gradients, as torch counts its own attention's backward; the kernels' recomputation of the
maps is not counted).

The module runs past 400 lines because the chooser, the op with its autograd, fake and FLOP
rules, and the device registrations are one contract: each rule is written once for every
core, and a kernel plugs into all of them in one place.
"""
import contextlib
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils import flop_counter

from .kernels import compose_cpu
from .matrices import ComposeMatrices, attention_with_matrices

__all__ = ["IMPLS", "attention_impl", "select_impl", "composed_attention",
           "composed_attention_compile", "attention_macs"]

# "auto" (choose) and every core `select_impl` can return.
IMPLS = ("auto", "reference", "cpp", "triton", "compile", "export")

_KERNEL_CORES = ("cpp", "triton")   # the cores that run through the custom op

_override: List[str] = []


@contextlib.contextmanager
def attention_impl(name: str) -> Iterator[None]:
    """Force every DCMHA layer to the attention core ``name`` (one of `IMPLS`) in this block.

    Takes precedence over each layer's ``attn_impl`` attribute. ``"auto"`` restores the
    automatic choice inside an outer forced block.
    """
    _check_impl(name)
    _override.append(name)
    try:
        yield
    finally:
        _override.pop()


def _check_impl(name: str) -> None:
    if name not in IMPLS:
        raise ValueError(f"unknown DCMHA attention implementation {name!r}; choose one of {IMPLS}")


def _is_fx_tracing() -> bool:
    fx = torch.fx._symbolic_trace                    # is_fx_symbolic_tracing: torch >= 2.5
    return getattr(fx, "is_fx_symbolic_tracing", fx.is_fx_tracing)()


def _is_exporting() -> bool:
    """Inside torch.export (and so the ONNX exporter): the program gets standard ops only."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting is not None and is_exporting())


def select_impl(layer_impl: str, q: Tensor, *, weights: bool = False,
                mask: Optional[Tensor] = None) -> Tuple[str, str]:
    """The attention core for queries ``q`` (B, H, N, D), and why: the one place that picks it.

    ``weights``: the layer needs the attention weights themselves (attention dropout in
    training); ``mask``: the additive or boolean mask it will pass (one that requires grad
    needs a differentiable core). Returns ``(core, reason)``, the reason a short sentence.

    ``torch.export`` (ONNX export, AOTInductor) -> ``export`` (`dcvit.export_core`: standard
    ops arranged for inference engines; ``reference`` when the weights are needed) unless
    ``reference`` (the paper's graph) or ``cpp`` (the C++ custom op kept in the program) is
    forced. Tracing (``torch.jit.trace``, FX) -> ``reference`` whatever is forced, so that the
    trace records every op of the spec; meta tensors likewise (shapes only). Otherwise the
    forced core (`attention_impl`, then the layer's ``attn_impl``): a forced kernel that
    cannot take the inputs raises ``ValueError`` with the reason; a forced ``export`` runs
    its graph in eager mode. ``auto``: the weights or a mask gradient -> ``compile``; CPU ->
    ``cpp`` when the kernel is built and takes the inputs; CUDA -> ``triton`` when it takes
    the inputs and its kernels pass their one-time check on this device
    (`triton_core.works_for`); everything else -> ``compile``. Inside ``torch.compile`` the
    same: a kernel core is one custom op that the graph keeps, and the Triton check runs once
    while the graph is traced.

    The core also fixes how its per-token matrices are built (`dcvit.core.DCMHACore.matrices`):
    by the C++ kernel for ``cpp``, in PyTorch for the others.
    """
    name = _override[-1] if _override and _override[-1] != "auto" else layer_impl
    _check_impl(name)
    if _is_exporting() and name not in ("reference", "cpp"):
        if weights:
            return "reference", "exported in training with attention dropout: the weights themselves"
        return "export", "exported: standard ops arranged for inference engines (dcvit.export_core)"
    if _is_fx_tracing() or torch.jit.is_tracing():
        return "reference", "traced: the trace records every op of the spec"
    if _is_exporting() and name == "reference":
        return "reference", "forced, exported: the paper's graph"
    if q.device.type == "meta":
        return "reference", "meta tensors: shapes only"
    if name in _KERNEL_CORES:
        why = _refuses(name, q, weights, mask)
        if why:
            raise ValueError(f"DCMHA's attention core {name!r} cannot run here: {why}; force "
                             "'compile' or 'reference', or let 'auto' choose")
        return name, "forced"
    if name == "export" and weights:
        return "reference", "forced 'export', but the attention weights themselves are needed"
    if name != "auto":
        return name, "forced"
    if weights:
        return "compile", "the attention weights themselves are needed (attention dropout in training)"
    if mask is not None and mask.requires_grad:
        return "compile", "the mask requires grad (the kernels return no mask gradient)"
    compiling = torch.compiler.is_compiling()
    in_graph = ", one op in the graph" if compiling else ""
    if q.device.type in _TRITON_DEVICES:
        why = _refuses("triton", q, weights, mask)
        if why is None and not _triton().works_for(str(q.device), q.dtype, q.shape[1], q.shape[3]):
            why = "the Triton kernels failed their one-time check on this device (see the warning)"
        return ("compile", why) if why else ("triton", "CUDA: the Triton kernels passed their check here" + in_graph)
    why = _refuses("cpp", q, weights, mask)
    if why:
        return "compile", why
    cast = " (computed in float32)" if q.dtype in _CPP_CAST else ""
    return "cpp", "CPU: the C++ kernels" + cast + in_graph


_CPP_CAST = (torch.bfloat16, torch.float16)   # run by the C++ core in float32
_TRITON_DEVICES = ("cuda",)                   # where "auto" runs the Triton core, eager and compiled


def _refuses(core: str, q: Tensor, weights: bool, mask: Optional[Tensor]) -> Optional[str]:
    """Why the kernel core ``core`` cannot take these inputs, or None when it can."""
    if weights:
        return f"the {core!r} kernels do not return the attention weights (attention dropout in training)"
    if mask is not None and mask.requires_grad:
        return f"the mask requires grad and the {core!r} kernels return no mask gradient"
    H = q.shape[1]
    if core == "cpp":
        if q.device.type != "cpu":
            return f"the C++ kernels run on CPU tensors, got {q.device.type}"
        if q.dtype not in (torch.float32, torch.float64, *_CPP_CAST):
            return f"the C++ kernels take floating-point tensors, got {q.dtype}"
        if H > compose_cpu.MAX_HEADS:
            return f"{H} heads, more than the C++ kernels' {compose_cpu.MAX_HEADS}"
        if not compose_cpu.available():
            return "the C++ kernels are not built here (see the warning; DCVIT_NO_CPP_KERNEL)"
        return None
    triton_core = _triton()
    unsupported = triton_core.unsupported_reason()
    if unsupported:
        return unsupported
    if q.device.type != "cuda" and not (triton_core.interpreted() and (q.device.type, "triton") in _CORES):
        return f"the Triton kernels run on CUDA tensors, got {q.device.type}"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the Triton kernels take float32/bfloat16/float16, got {q.dtype}"
    if H > triton_core.MAX_HEADS:
        return f"{H} heads, more than the Triton kernels' {triton_core.MAX_HEADS}"
    if mask is not None:
        return triton_core.mask_unsupported(str(q.device), H)
    return None


def _triton():
    """`dcvit.kernels.triton_core`, imported on first use (importing Triton takes about a
    second, and only CUDA runs it)."""
    from .kernels import triton_core
    return triton_core


# ---------------------------------------------------------------------- the custom ops
# The kernel cores as torch.library custom ops, dcvit::composed_attention and its backward
# dcvit::composed_attention_backward: one opaque op in eager mode and inside torch.compile
# (the compiled graph keeps the kernels instead of re-deriving the maths). The autograd and
# fake-tensor rules below serve every device and core; a device's kernels for a core are
# plugged in with `register_core`. The forward returns (output, statistics): what the core
# keeps from forward for backward (the Triton core's row log-sum-exp), a zero-size tensor
# for a core that keeps none. Absent optional gradients travel as zero-size tensors.

CoreForward = Callable[..., Tuple[Tensor, Optional[Tensor]]]
CoreBackward = Callable[..., Sequence[Optional[Tensor]]]
CoreStats = Callable[[Tensor, Tensor, Tensor], Tensor]


class _Core(NamedTuple):
    """One core's kernels on one device (see `register_core`)."""
    forward: CoreForward
    backward: CoreBackward
    stats: Optional[CoreStats]


_CORES: Dict[Tuple[str, str], _Core] = {}        # (device type, core) -> its kernels


def register_core(device: str, impl: str, forward: CoreForward, backward: CoreBackward,
                  stats: Optional[CoreStats] = None) -> None:
    """Make ``forward``/``backward`` the ``device`` kernels of the core ``impl`` in the ops
    ``dcvit::composed_attention`` / ``dcvit::composed_attention_backward`` (one pair per
    device and core; registering again replaces it).

    ``forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale)`` returns ``(out, stats)``: the
    (B, T, H, D) output and the statistics the core keeps for its backward (None: it keeps
    none). ``backward(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, scale, want)``, with
    ``grad`` of the output's (B, H, T, D) view, ``stats`` the tensor the op returned beside
    the output (zero-size for a core that keeps none) and ``want`` the four flags of the
    matrix gradients autograd needs, returns ``[dq, dk, dv, dmq1, dmk1, dmq2, dmk2]``
    (matrix gradients per token, (B, T, H, H) / (B, S, H, H), summed here to broadcast
    inputs' shapes; None for absent or unwanted ones). Arguments as `composed_attention`'s:
    q, k, v (B, H, N, D) on any strides, mask additive and broadcastable, matrices in any
    float dtype. Operands a kernel cannot take raise an error that names the fix. A core
    that keeps statistics gives ``stats(q, k, v)``: an empty tensor of their shape, dtype
    and device for these operands (the fake-tensor rule returns it). The ops' autograd and
    fake rules are shared: a kernel registered here is used in eager mode, under autograd
    and inside ``torch.compile`` alike.
    """
    _CORES[(device, impl)] = _Core(forward, backward, stats)


def _kernels(q: Tensor, impl: str) -> _Core:
    core = _CORES.get((q.device.type, impl))
    if core is None:
        have = sorted(i for d, i in _CORES if d == q.device.type)
        raise RuntimeError(f"no {impl!r} attention kernels for {q.device.type} tensors (there: "
                           f"{have}); let dcvit.fused.select_impl choose the core")
    return core


def _no_stats(q: Tensor) -> Tensor:
    return q.new_empty(0)


@torch.library.custom_op("dcvit::composed_attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                  mq1: Optional[Tensor], mk1: Optional[Tensor], mq2: Optional[Tensor],
                  mk2: Optional[Tensor], impl: str, scale: float,
                  compose_macs: int = 0) -> Tuple[Tensor, Tensor]:
    out, stats = _kernels(q, impl).forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale)
    return out, _no_stats(q) if stats is None else stats


@_attention_op.register_fake
def _(q, k, v, mask, mq1, mk1, mq2, mk2, impl, scale, compose_macs=0):
    core = _kernels(q, impl)
    B, H, T, _ = q.shape
    out = v.new_empty(B, T, H, v.shape[-1])
    return out, _no_stats(q) if core.stats is None else core.stats(q, k, v)


@torch.library.custom_op("dcvit::composed_attention_backward", mutates_args=())
def _attention_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor,
                           mask: Optional[Tensor], mq1: Optional[Tensor], mk1: Optional[Tensor],
                           mq2: Optional[Tensor], mk2: Optional[Tensor], stats: Tensor, impl: str,
                           scale: float, want: List[bool], compose_macs: int = 0) -> List[Tensor]:
    mats = (mq1, mk1, mq2, mk2)
    grads = _kernels(q, impl).backward(grad.transpose(1, 2), q, k, v, mask, *mats, stats, scale, want)
    grads = [*grads[:3], *(_reduce_to(d, m) for d, m in zip(grads[3:], mats))]
    return [q.new_empty(0) if d is None or (i >= 3 and not want[i - 3]) else d
            for i, d in enumerate(grads)]


def _wanted(q: Tensor, k: Tensor, v: Tensor, mats: Sequence[Optional[Tensor]],
            want: Sequence[bool]) -> Tuple[Optional[Tensor], ...]:
    """The backward's seven inputs that get a gradient: q, k, v and each matrix that is
    present and wanted (None for the others)."""
    return (q, k, v) + tuple(m if w else None for m, w in zip(mats, want))


@_attention_backward_op.register_fake
def _(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, impl, scale, want, compose_macs=0):
    fmt = torch.contiguous_format                                   # as the real op's
    wanted = _wanted(q, k, v, (mq1, mk1, mq2, mk2), want)
    return [q.new_empty(0) if t is None else torch.empty_like(t, memory_format=fmt) for t in wanted]


def _reduce_to(grad: Optional[Tensor], like: Optional[Tensor]) -> Optional[Tensor]:
    """Sum a (B, T, H, H) gradient down to a broadcast input's shape, in its dtype."""
    if grad is None or like is None:
        return None
    if grad.shape != like.shape:
        dims = [i for i, (g, l) in enumerate(zip(grad.shape, like.shape)) if l == 1 and g != 1]
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.to(like.dtype)


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, mask, mq1, mk1, mq2, mk2, impl, scale, *rest = inputs
    ctx.save_for_backward(q, k, v, mask, mq1, mk1, mq2, mk2, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)            # no zeros for the statistics' gradient
    ctx.impl, ctx.scale, ctx.compose_macs = impl, scale, (rest[0] if rest else 0)
    ctx.want = [bool(ctx.needs_input_grad[i]) for i in (4, 5, 6, 7)]


def _attention_grad(ctx, grad: Optional[Tensor], _grad_stats: Optional[Tensor]):
    if grad is None:                                        # the output got no gradient
        return (None,) * 11
    q, k, v, mask, mq1, mk1, mq2, mk2, stats = ctx.saved_tensors
    grads = _attention_backward_op(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, ctx.impl,
                                   ctx.scale, ctx.want, ctx.compose_macs)
    wanted = _wanted(q, k, v, (mq1, mk1, mq2, mk2), ctx.want)
    dq, dk, dv, d1, d2, d3, d4 = [None if t is None else g for g, t in zip(grads, wanted)]
    return dq, dk, dv, None, d1, d2, d3, d4, None, None, None


_attention_op.register_autograd(_attention_grad, setup_context=_attention_setup)


# ------------------------------------------------------------------------ FLOP counting

def attention_macs(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int]) -> int:
    """Multiply-adds of attention's two products, q kᵀ and p v, for q (..., T, D), k
    (..., S, D) and v (..., S, Dv): (batch · heads) · T · S · (D + Dv). `dcvit.accounting`
    counts attention with this formula too."""
    batch_heads = 1
    for n in q_shape[:-2]:
        batch_heads *= n
    T, D, S, Dv = q_shape[-2], q_shape[-1], k_shape[-2], v_shape[-1]
    return batch_heads * T * S * (D + Dv)


def _core_flops(q_shape, k_shape, v_shape, compose_macs: int) -> int:
    """FLOPs (2 per multiply-add) of one forward of the core: both products and both
    Compose stages (``compose_macs`` per (batch element, query, key))."""
    B, T, S = q_shape[0], q_shape[-2], k_shape[-2]
    return 2 * (attention_macs(q_shape, k_shape, v_shape) + B * T * S * compose_macs)


def _flop_formula(op):
    """``torch.utils.flop_counter.register_flop_formula(op)``, keyed by the op's overload
    packet as `FlopCounterMode` looks it up (torch before 2.5 keyed a custom op's formula by
    its overloads only, so that the counter never found it)."""
    def register(formula):
        flop_counter.register_flop_formula(op)(formula)
        flop_counter.flop_registry.setdefault(op, flop_counter.shape_wrapper(formula))
        return formula
    return register


@_flop_formula(torch.ops.dcvit.composed_attention)
def _attention_flops(q, k, v, mask, mq1, mk1, mq2, mk2, impl, scale, compose_macs=0, *,
                     out_shape=None, **kwargs) -> int:
    return _core_flops(q, k, v, compose_macs)


@_flop_formula(torch.ops.dcvit.composed_attention_backward)
def _attention_backward_flops(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, impl, scale, want,
                              compose_macs=0, *, out_shape=None, **kwargs) -> int:
    return 2 * _core_flops(q, k, v, compose_macs)


# ------------------------------------------------------------------ the kernels, plugged in

def _cpp_check(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise unless the C++ kernels take these operands: float32/float64 of one dtype, at
    most `compose_cpu.MAX_HEADS` heads, the kernels built."""
    if q.dtype not in (torch.float32, torch.float64) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"the C++ attention kernels take float32 or float64 q, k, v of one dtype, "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}; dcvit.fused.composed_attention casts "
                         "bfloat16/float16 for them")
    if q.shape[1] > compose_cpu.MAX_HEADS:
        raise ValueError(f"the C++ attention kernels take up to {compose_cpu.MAX_HEADS} heads, got "
                         f"{q.shape[1]}; use the 'compile' core")
    if not compose_cpu.available():
        raise RuntimeError("the C++ attention kernels are not built here (see the warning at load); "
                           "use the 'compile' core")


def _cpp_forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale) -> Tuple[Tensor, None]:
    _cpp_check(q, k, v)
    return torch.ops.dcvit_cpu.attention_forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale), None


def _cpp_backward(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, scale, want) -> List[Optional[Tensor]]:
    _cpp_check(q, k, v)
    grads = torch.ops.dcvit_cpu.attention_backward(grad, q, k, v, mask, mq1, mk1, mq2, mk2, scale, want)
    wanted = _wanted(q, k, v, (mq1, mk1, mq2, mk2), want)
    return [None if t is None else g for g, t in zip(grads, wanted)]


register_core("cpu", "cpp", _cpp_forward, _cpp_backward)


def _triton_forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale) -> Tuple[Tensor, Tensor]:
    return _triton().attention_forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale)


def _triton_backward(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, scale, want) -> List[Optional[Tensor]]:
    return _triton().attention_backward(grad.transpose(1, 2), q, k, v, mask, mq1, mk1, mq2, mk2,
                                        stats, scale, want)


def _triton_stats(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The Triton core's statistics: each head's row log-sum-exp, (B, H, T) float32."""
    B, H, T, _ = q.shape
    return q.new_empty(B, H, T, dtype=torch.float32)


# The Triton core on CUDA (Triton itself is imported on first use). The tests also register
# it for CPU tensors, which it takes under Triton's interpreter (tests/conftest.py).
register_core("cuda", "triton", _triton_forward, _triton_backward, _triton_stats)


# ------------------------------------------------------------------------------ the cores

def composed_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                       mats: ComposeMatrices, impl: str, scale: float = 1.0,
                       compose_macs: int = 0) -> Tensor:
    """The DCMHA attention core on a kernel core (``"cpp"`` or ``"triton"``, as `select_impl`
    chose it for q; see module docstring).

    q, k, v: (B, H, N, D), any strides; scale: multiplies q k^T (folded into the GEMM);
    mask: additive, broadcast to (B, H, T, S), or None; mats: `ComposeMatrices` (both
    matrices of an absent stage None); compose_macs: both Compose stages' multiply-adds per
    (batch element, query, key) in the paper's formulation, for FLOP counters only. On the
    C++ core bfloat16/float16 operands are computed in float32 and the output cast back.
    Returns (B, H, T, D), a view of a (B, T, H, D) tensor, so that merging the heads costs
    no copy.
    """
    if impl not in _KERNEL_CORES:
        raise ValueError(f"composed_attention runs the kernel cores {_KERNEL_CORES}, got {impl!r}")
    dtype = q.dtype
    if impl == "cpp" and dtype in _CPP_CAST:
        q, k, v = q.float(), k.float(), v.float()
    if impl == "triton":                    # padded here, so that the op saves them padded for its backward
        mats = ComposeMatrices(*_triton().kernel_matrices(mats, q.shape[1], q.device))
    out, _ = _attention_op(q, k, v, mask, *mats, impl, float(scale), int(compose_macs))
    return out.to(dtype).transpose(1, 2)


def composed_attention_compile(q: Tensor, k: Tensor, v: Optional[Tensor], mask: Optional[Tensor],
                               mats: ComposeMatrices, scale: float = 1.0) -> Tensor:
    """The core in plain differentiable PyTorch (the ``"compile"`` core): (B, H, T, D), or the
    composed weights (B, H, T, S) when ``v`` is None. `dcvit.matrices.attention_with_matrices`,
    the one PyTorch formulation: in eager mode, inside ``torch.compile`` and in exported
    graphs (`dcvit.export_core`) alike."""
    return attention_with_matrices(q, k, v, mask, mats, scale)
