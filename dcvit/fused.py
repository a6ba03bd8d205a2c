"""Fast attention cores for DCMHA: composed attention without one (B, H, T, S) tensor per term.

With each Compose stage merged into per-token H×H matrices (`dcvit.matrices`), the attention
core ``softmax(compose1(scale q k^T) + mask) -> compose2 -> @ v`` is one custom op,
``dcvit::composed_attention`` (`composed_attention`), with its own backward op,
``dcvit::composed_attention_backward``: it saves q, k, v, the matrices and whatever
statistics the core keeps (none, or the softmax's row log-sum-exp), recomputes the
(B, H, T, S) maps in backward, and ``torch.compile`` keeps it as one node.
Its cores (the op's ``impl`` argument):

* ``"cpp"``:    the C++ kernels (`dcvit.kernels.compose_cpu`, operators ``dcvit_cpu::*``),
  CPU fp32/fp64: the whole core, products included, flash-style per batch element and
  block of queries on each thread;
* ``"triton"``: the whole core, forward and backward, in Triton kernels
  (`dcvit.kernels.triton_core`), CUDA (and CPU tensors under Triton's interpreter): the
  forward keeps each head's row log-sum-exp for the backward;
* ``"torch"``:  the same maths in PyTorch ops (any device).

"torch" (and "cpp" for bf16 inputs, "cpp"/"triton" when the weights themselves are
returned) run in the tiled driver (`_attention_forward`, `_attention_backward`): tiles of
(batch, queries) of about 2 MiB on CPU (`TILE_ELEMENTS`, `_tiles`), q k^T and p v by
``baddbmm`` around the rows (all heads of one query together). Two more cores skip the
custom op:

* ``"compile"``: plain differentiable PyTorch written for inductor to fuse (no graph breaks);
* ``"reference"``: the `Compose` modules, one tensor per term (hooks see every map;
  TorchScript and ``torch.jit.trace`` use it); ``torch.export`` records ``"export"``,
  `dcvit.export_core` (standard ops for inference engines).

`select_impl` is the one place that picks a core (by device, dtype and context);
`attention_impl` forces one. The per-slot Compose matrices travel as
`dcvit.matrices.ComposeMatrices`.

Device kernels. The ops' autograd and fake-tensor rules are written once, for every device
and core; a device's kernels for one core are plugged in with `register_core`, from this
module (kernels never import it): the C++ core for ``"cpu"``, the Triton core for
``"cuda"`` (and ``"cpu"``, where it runs only under the interpreter)::

    register_core("cuda", "triton", forward, backward, stats)
    # forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale) -> (out (B, T, H, D), stats or None), or None
    # backward(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, scale, want)
    #     -> [dq, dk, dv, dmq1, dmk1, dmq2, dmk2], or None
    # stats(q, k, v) -> an empty tensor shaped as forward's statistics (fake-tensor rule)

with the op's arguments: q, k, v (B, H, N, D) on any strides (v None: the weights
(B, H, T, S) are wanted), mask additive and broadcastable to (B, H, T, S) or None, mq*
(B|1, T|1, H, H), mk* (B, S, H, H) or None, ``grad`` of the output's (B, H, T, D) view,
``want`` the matrix gradients autograd needs. Returning None declines (the tiled driver
runs); `select_impl` decides which core runs. The op returns the statistics beside the
output (a zero-size tensor for a core that keeps none, such as the C++ one) and hands them
to the backward.
"""
import contextlib
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .kernels import compose_cpu
from .matrices import ComposeMatrices, mix, mix_fusable

__all__ = ["IMPLS", "attention_impl", "select_impl", "TILE_ELEMENTS", "composed_attention",
           "composed_attention_compile", "CUDA_MEASURED"]

IMPLS = ("auto", "reference", "torch", "cpp", "triton", "compile")

TILE_ELEMENTS = 1 << 19   # per tile of the (b, H, t, S) maps on CPU (float32: 2 MiB)

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


def select_impl(layer_impl: str, q: Tensor, training: bool = False) -> str:
    """The attention core to run on queries ``q`` (B, H, N, D): the one place that picks it.

    ``torch.export`` (ONNX export, AOTInductor) -> ``export`` (`dcvit.export_core`: standard
    ops arranged for inference engines) unless ``reference`` or ``cpp`` is forced (the paper's
    graph; the C++ custom op kept in the program). ``torch.jit.trace`` tracing (fvcore traces)
    -> ``reference`` whatever is forced, so that the trace records every op rather than one
    opaque fused call. (FX symbolic tracing
    records DCMHA's core as one call, which runs this selection when the graph runs.) Otherwise the
    forced core (context, then layer) or, for ``auto``: inside ``torch.compile`` -> ``cpp``
    on CPU when the kernel builds (a custom op the graph keeps), on CUDA the measured core
    (`CUDA_MEASURED`) or else ``compile``; CUDA eager -> the measured core, or else
    ``triton`` when its kernels pass their one-time check on this device
    (`triton_core.works_on`), or else ``torch``; CPU -> ``cpp`` when the kernel builds;
    otherwise ``torch``. A core that cannot take ``q`` becomes ``torch``: ``cpp`` for dtypes
    other than float32/float64/bfloat16 or when the kernel did not build, ``triton`` for
    float64 or more than 16 heads. ``cpp`` on a non-CPU device is an error.
    """
    name = _override[-1] if _override and _override[-1] != "auto" else layer_impl
    _check_impl(name)
    if _is_exporting() and name not in ("reference", "cpp"):
        return "export"                              # dcvit.export_core (forced reference/cpp: kept)
    if _is_fx_tracing() or torch.jit.is_tracing() or q.device.type == "meta":
        return "reference"                           # meta: shapes only, as timm's config tests run
    cpu = q.device.type == "cpu"
    cuda = q.device.type == "cuda"
    if name == "auto":
        if torch.compiler.is_compiling():
            name = (_cuda_measured(q, "compile") if cuda else None) or (
                "cpp" if cpu and compose_cpu.available() else "compile")
        elif cuda:
            name = _cuda_measured(q, "eager") or ("triton" if _triton().works_on(q) else "torch")
        else:
            name = "cpp" if cpu and compose_cpu.available() else "torch"
    if name == "cpp":
        if not cpu:
            raise ValueError(f"the 'cpp' attention core runs on CPU tensors, got {q.device}; "
                             "use 'triton' or 'torch'")
        if q.dtype not in (torch.float32, torch.float64, torch.bfloat16) or not compose_cpu.available():
            return "torch"
    if name == "triton" and (q.dtype == torch.float64 or q.shape[1] > _triton().MAX_HEADS):
        return "torch"
    return name


# The CUDA cores chosen from `scripts/gpu_check.sh` figures (the fastest training step at
# bf16, batch 256, for DCViT-S/16 and B/16), by GPU: a substring of
# torch.cuda.get_device_name() -> {"eager": core, "compile": core}. A GPU without an entry
# gets the safest core (docs/performance.md, "On CUDA").
CUDA_MEASURED: Dict[str, Dict[str, str]] = {}


def _cuda_measured(q: Tensor, mode: str) -> Optional[str]:
    """The core measured fastest on q's GPU in ``mode`` ("eager" or "compile"), or None."""
    if not CUDA_MEASURED:
        return None
    name = torch.cuda.get_device_name(q.device)
    for key, cores in CUDA_MEASURED.items():
        if key in name and mode in cores:
            return cores[mode]
    return None


def _triton():
    """`dcvit.kernels.triton_core`, imported on first use (importing Triton takes about a
    second, and only CUDA runs it)."""
    from .kernels import triton_core
    return triton_core


# ------------------------------------------------------------------------------ tiles

Stage = Tuple[Optional[Tensor], Optional[Tensor]]    # one stage's (mq, mk)


def _tiles(B: int, H: int, T: int, S: int, budget: Optional[int]) -> List[Tuple[slice, slice]]:
    """(batch, query) ranges whose (b, H, t, S) maps hold about ``budget`` elements: whole
    batch elements while they fit, else blocks of queries of one element; one tile when
    ``budget`` is None or everything fits."""
    if budget is None or B * H * T * S <= budget:
        return [(slice(0, B), slice(0, T))]
    if H * T * S <= budget:
        c = budget // (H * T * S)
        return [(slice(b, min(B, b + c)), slice(0, T)) for b in range(0, B, c)]
    tq = max(1, budget // (H * S))
    return [(slice(b, b + 1), slice(t, min(T, t + tq))) for b in range(B) for t in range(0, T, tq)]


def _tile(m: Optional[Tensor], bs: slice, ts: Optional[slice] = None) -> Optional[Tensor]:
    """A (B|1, T|1, ...) tensor's rows for batch range bs (and query range ts); broadcast
    dims stay."""
    if m is None:
        return None
    m = m if m.shape[0] == 1 else m[bs]
    return m if ts is None or m.shape[1] == 1 else m[:, ts]


def _stage_tile(stage: Stage, bs: slice, ts: slice) -> Stage:
    return _tile(stage[0], bs, ts), _tile(stage[1], bs)


# ------------------------------------------------------------------ rows, pure PyTorch

def _rows_forward_torch(s0: Tensor, mask: Optional[Tensor], pre: Stage, post: Stage) -> Tensor:
    B, H, T, S = s0.shape
    out = torch.empty_like(s0)
    for bs, ts in _tiles(B, H, T, S, TILE_ELEMENTS):                        # temporaries' size
        a = s0[bs, :, ts]                                                    # (b, H, t, S)
        mq1, mk1 = _stage_tile(pre, bs, ts)
        mq2, mk2 = _stage_tile(post, bs, ts)
        if mq1 is not None:
            a = mix(a, mq1, mk1)
        if mask is not None:
            a = a + mask[bs, :, ts]
        p = a.softmax(dim=-1)
        if mq2 is not None:
            p = mix(p, mq2, mk2)
        out[bs, :, ts] = p
    return out


def _mix_grads(a: Tensor, d: Tensor, mq: Tensor, mk: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    dmq = torch.einsum("bgts,bhts->btgh", a, d)                              # (B, t, H, H)
    dmk = torch.einsum("bgts,bhts->bsgh", a, d) if mk is not None else None  # (B, S, H, H)
    return dmq, dmk


def _t(m: Tensor) -> Tensor:
    return m.transpose(-1, -2)


def _rows_backward_torch(s0: Tensor, mask: Optional[Tensor], pre: Stage, post: Stage,
                         dp2: Tensor) -> Tuple[Tensor, Tensor, Stage, Stage]:
    """Recompute the rows from s0 and back-propagate dp2: (p2, ds0, dpre, dpost)."""
    B, H, T, S = s0.shape
    p2, ds0 = torch.empty_like(s0), torch.empty_like(s0)
    grads = _MatrixGrads(B, T, S, H)
    for bs, ts in _tiles(B, H, T, S, TILE_ELEMENTS):                        # temporaries' size
        a = s0[bs, :, ts]                                                    # (b, H, t, S)
        mq1, mk1 = _stage_tile(pre, bs, ts)
        mq2, mk2 = _stage_tile(post, bs, ts)
        s1 = mix(a, mq1, mk1) if mq1 is not None else a
        if mask is not None:
            s1 = s1 + mask[bs, :, ts]
        p = s1.softmax(dim=-1)                                               # (b, H, t, S)
        d = dp2[bs, :, ts]
        if mq2 is not None:
            p2[bs, :, ts] = mix(p, mq2, mk2)
            grads.add(2, bs, ts, *_mix_grads(p, d, mq2, mk2))
            d = mix(d, _t(mq2), None if mk2 is None else _t(mk2))
        else:
            p2[bs, :, ts] = p
        d = p * (d - (p * d).sum(dim=-1, keepdim=True))                      # softmax backward
        if mq1 is not None:
            grads.add(0, bs, ts, *_mix_grads(a, d, mq1, mk1))
            d = mix(d, _t(mq1), None if mk1 is None else _t(mk1))
        ds0[bs, :, ts] = d
    g = grads.out
    return p2, ds0, (g[0], g[1]), (g[2], g[3])


class _MatrixGrads:
    """The four matrices' gradients assembled over tiles: dmq* (B, T, H, H) per query row,
    dmk* (B, S, H, H) summed over the tiles of queries; None until a tile adds one."""

    def __init__(self, B: int, T: int, S: int, H: int) -> None:
        self.shape = ((B, T, H, H), (B, S, H, H))
        self.out: List[Optional[Tensor]] = [None] * 4

    def add(self, i: int, bs: slice, ts: slice, dmq: Tensor, dmk: Optional[Tensor]) -> None:
        """Tile (bs, ts)'s gradients of stage i // 2 (i = 0: pre, 2: post)."""
        for j, d in ((i, dmq), (i + 1, dmk)):
            if d is None:
                continue
            if self.out[j] is None:
                self.out[j] = d.new_zeros(self.shape[j % 2])
            if j % 2 == 0:
                self.out[j][bs, ts] = d                                      # per query row
            else:
                self.out[j][bs] += d                                         # summed over query tiles


# ------------------------------------------------------------------------ rows, C++

def _rows_forward_cpp(s0: Tensor, mask: Optional[Tensor], pre: Stage, post: Stage) -> Tensor:
    if s0.shape[1] > compose_cpu.MAX_HEADS:
        return _rows_forward_torch(s0, mask, pre, post)
    return torch.ops.dcvit_cpu.rows_forward(s0, mask, *pre, *post)


def _rows_backward_cpp(s0: Tensor, mask: Optional[Tensor], pre: Stage, post: Stage,
                       dp2: Tensor) -> Tuple[Tensor, Tensor, Stage, Stage]:
    if s0.shape[1] > compose_cpu.MAX_HEADS:
        return _rows_backward_torch(s0, mask, pre, post, dp2)
    p2, ds0, *d = torch.ops.dcvit_cpu.rows_backward(s0, dp2, mask, *pre, *post)
    d = [None if m is None else g for g, m in zip(d, (*pre, *post))]
    return p2, ds0, (d[0], d[1]), (d[2], d[3])


# ------------------------------------------------------------- the core, tile by tile

def _reduce_to(grad: Optional[Tensor], like: Optional[Tensor]) -> Optional[Tensor]:
    """Sum a (B, T, H, H) gradient down to a broadcast input's shape, in its dtype."""
    if grad is None or like is None:
        return None
    if grad.shape != like.shape:
        dims = [i for i, (g, l) in enumerate(zip(grad.shape, like.shape)) if l == 1 and g != 1]
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.to(like.dtype)


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _core_tiles(q: Tensor, S: int) -> List[Tuple[slice, slice]]:
    """The driver's tiles, flash-style: on CPU each tile's (b, H, t, S) maps hold about 2 MiB
    of float32, so that q k^T, the rows and p v pass them through cache instead of memory
    (and no large buffer is allocated per layer); one tile elsewhere."""
    B, H, T, _ = q.shape
    return _tiles(B, H, T, S, TILE_ELEMENTS if q.device.type == "cpu" else None)


def _attention_forward(q: Tensor, k: Tensor, v: Optional[Tensor], mask: Optional[Tensor],
                       mq1: Optional[Tensor], mk1: Optional[Tensor], mq2: Optional[Tensor],
                       mk2: Optional[Tensor], impl: str, scale: float) -> Tensor:
    """compose2(softmax(compose1(scale q k^T) + mask)) @ v, tile by tile (no autograd), as
    (B, T, H, D) (so that merging the heads is free), or the weights (B, H, T, S) without v;
    the rows by core ``impl``."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    mask = _mask_to(mask, (B, H, T, S), _compute_dtype(q))
    mq1, mk1, mq2, mk2 = _matrices_for(impl, (B, T, H), _compute_dtype(q), (mq1, mk1, mq2, mk2))
    out = q.new_empty(B, H, T, S) if v is None else _out_like(q, v)
    view = out if v is None else out.transpose(1, 2)                        # (B, H, T, S|D)
    for bs, ts in _core_tiles(q, S):
        s0 = _scores(q[bs, :, ts], k[bs], scale)                             # (b, H, t, S)
        pre, post = _stage_tile((mq1, mk1), bs, ts), _stage_tile((mq2, mk2), bs, ts)
        p2 = _rows_forward(impl, s0, None if mask is None else mask[bs, :, ts], pre, post)
        view[bs, :, ts] = p2 if v is None else _bmm(p2.to(v.dtype), v[bs])
    return out


def _out_like(q: Tensor, v: Tensor) -> Tensor:
    """The core's output: (B, T, H, D)."""
    B, H, T, _ = q.shape
    return v.new_empty(B, T, H, v.shape[-1])


def _attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Optional[Tensor],
                        mask: Optional[Tensor], mq1: Optional[Tensor], mk1: Optional[Tensor],
                        mq2: Optional[Tensor], mk2: Optional[Tensor], impl: str,
                        scale: float) -> List[Optional[Tensor]]:
    """Gradients of `_attention_forward` for q, k, v, mq1, mk1, mq2, mk2 (``grad`` of its
    (B, H, T, D) view, or of the weights): the maps are recomputed tile by tile, nothing was
    saved but the inputs."""
    cdt = _compute_dtype(q)
    B, H, T, _ = q.shape
    S = k.shape[2]
    mask = _mask_to(mask, (B, H, T, S), cdt)
    mats = _matrices_for(impl, (B, T, H), cdt, (mq1, mk1, mq2, mk2))
    tiles = _core_tiles(q, S)
    whole = all(ts == slice(0, T) for _, ts in tiles)          # each batch element in one tile
    fmt = torch.contiguous_format                               # GEMMs write the grads in place
    new = torch.empty_like if whole else torch.zeros_like
    dq, dk = torch.empty_like(q, memory_format=fmt), new(k, memory_format=fmt)
    dv = None if v is None else new(v, memory_format=fmt)
    dmats = _MatrixGrads(B, T, S, H)
    for bs, ts in tiles:
        qt, g = q[bs, :, ts], grad[bs, :, ts]
        s0 = _scores(qt, k[bs], scale)                                       # (b, H, t, S)
        dp2 = g.to(cdt).contiguous() if v is None else _bmm(g, v[bs].transpose(-2, -1)).to(cdt)
        pre, post = _stage_tile(mats[:2], bs, ts), _stage_tile(mats[2:], bs, ts)
        p2, ds0, dpre, dpost = _rows_backward(impl, s0, None if mask is None else mask[bs, :, ts],
                                              pre, post, dp2)
        dmats.add(0, bs, ts, *dpre)
        dmats.add(2, bs, ts, *dpost)
        ds0 = ds0.to(q.dtype)
        if whole:                                                             # in place
            if dv is not None:
                _bmm(p2.to(v.dtype).transpose(-2, -1), g, out=dv[bs])         # (b, H, S, D)
            _bmm(ds0, k[bs], scale, out=dq[bs])                               # (b, H, T, D)
            _bmm(ds0.transpose(-2, -1), qt, scale, out=dk[bs])                # (b, H, S, D)
            continue
        if dv is not None:
            dv[bs] += _bmm(p2.to(v.dtype).transpose(-2, -1), g).to(dv.dtype)  # summed over query tiles
        dq[bs, :, ts] = _bmm(ds0, k[bs], scale)
        dk[bs] += _bmm(ds0.transpose(-2, -1), qt, scale)
    return [dq, dk, dv, *(_reduce_to(d, m) for d, m in zip(dmats.out, (mq1, mk1, mq2, mk2)))]


# ---------------------------------------------------------------------- the custom ops
# The core as torch.library custom ops, dcvit::composed_attention and its backward
# dcvit::composed_attention_backward: one opaque op in eager mode and inside torch.compile
# (the compiled graph keeps the kernels instead of re-deriving the maths). The autograd and
# fake-tensor rules below serve every device and core; a device's kernels for a core are
# plugged in with `register_core`, the tiled driver above runs everything else. The forward
# returns (output, statistics): what the core keeps from forward for backward (the Triton
# core's row log-sum-exp), a zero-size tensor for a core that keeps none. Absent optional
# gradients travel as zero-size tensors.

CoreForward = Callable[..., Optional[Tuple[Tensor, Optional[Tensor]]]]
CoreBackward = Callable[..., Optional[Sequence[Optional[Tensor]]]]
CoreStats = Callable[[Tensor, Tensor, Optional[Tensor]], Optional[Tensor]]


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
    none), or None to decline (the tiled driver then runs). ``backward(grad, q, k, v, mask,
    mq1, mk1, mq2, mk2, stats, scale, want)``, with ``grad`` of the output's (B, H, T, D)
    view, ``stats`` as forward returned them (None if it kept none) and ``want`` the four
    flags of the matrix gradients autograd needs, returns ``[dq, dk, dv, dmq1, dmk1, dmq2,
    dmk2]`` (matrix gradients per token, (B, T, H, H) / (B, S, H, H), summed here to
    broadcast inputs' shapes; None for absent or unwanted ones), or None to decline.
    Arguments as `composed_attention`'s: q, k, v (B, H, N, D) on any strides, v None when
    the weights themselves are wanted, mask additive and broadcastable, matrices in any
    float dtype. A core that keeps statistics gives ``stats(q, k, v)``: an empty tensor of
    their shape, dtype and device for these operands (the fake-tensor rule returns it), or
    None where its forward declines. The ops' autograd and fake rules are shared: a kernel
    registered here is used in eager mode, under autograd and inside ``torch.compile`` alike.
    """
    _CORES[(device, impl)] = _Core(forward, backward, stats)


def _no_stats(q: Tensor) -> Tensor:
    return q.new_empty(0)


@torch.library.custom_op("dcvit::composed_attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Optional[Tensor], mask: Optional[Tensor],
                  mq1: Optional[Tensor], mk1: Optional[Tensor], mq2: Optional[Tensor],
                  mk2: Optional[Tensor], impl: str, scale: float) -> Tuple[Tensor, Tensor]:
    core = _CORES.get((q.device.type, impl))
    if core is not None:
        got = core.forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale)
        if got is not None:
            out, stats = got
            return out, _no_stats(q) if stats is None else stats
        if core.stats is not None and core.stats(q, k, v) is not None:
            raise RuntimeError(f"the {impl!r} core's {q.device.type} forward declined operands for "
                               "which its stats rule promises statistics; make the two agree")
    return _attention_forward(q, k, v, mask, mq1, mk1, mq2, mk2, impl, scale), _no_stats(q)


@_attention_op.register_fake
def _(q, k, v, mask, mq1, mk1, mq2, mk2, impl, scale):
    B, H, T, _ = q.shape
    out = q.new_empty(B, H, T, k.shape[2]) if v is None else _out_like(q, v)
    core = _CORES.get((q.device.type, impl))
    stats = None if core is None or core.stats is None else core.stats(q, k, v)
    return out, _no_stats(q) if stats is None else stats


@torch.library.custom_op("dcvit::composed_attention_backward", mutates_args=())
def _attention_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Optional[Tensor],
                           mask: Optional[Tensor], mq1: Optional[Tensor], mk1: Optional[Tensor],
                           mq2: Optional[Tensor], mk2: Optional[Tensor], stats: Tensor, impl: str,
                           scale: float, want: List[bool]) -> List[Tensor]:
    g = grad if v is None else grad.transpose(1, 2)             # of the (B, T, H, D) output
    mats = (mq1, mk1, mq2, mk2)
    core = _CORES.get((q.device.type, impl))
    grads = None
    if core is not None:
        grads = core.backward(g, q, k, v, mask, *mats, stats if stats.numel() else None, scale, want)
    if grads is None:
        grads = _attention_backward(g, q, k, v, mask, *mats, impl, scale)
    else:
        grads = [*grads[:3], *(_reduce_to(d, m) for d, m in zip(grads[3:], mats))]
    return [q.new_empty(0) if d is None or (i >= 3 and not want[i - 3]) else d
            for i, d in enumerate(grads)]


@_attention_backward_op.register_fake
def _(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, impl, scale, want):
    fmt = torch.contiguous_format                                   # as the real op's
    wanted = (q, k, v) + tuple(m if w else None for m, w in zip((mq1, mk1, mq2, mk2), want))
    return [q.new_empty(0) if t is None else torch.empty_like(t, memory_format=fmt) for t in wanted]


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, mask, mq1, mk1, mq2, mk2, impl, scale = inputs
    ctx.save_for_backward(q, k, v, mask, mq1, mk1, mq2, mk2, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)            # no zeros for the statistics' gradient
    ctx.impl, ctx.scale = impl, scale
    ctx.want = [bool(ctx.needs_input_grad[i]) for i in (4, 5, 6, 7)]


def _attention_grad(ctx, grad: Optional[Tensor], _grad_stats: Optional[Tensor]):
    if grad is None:                                        # the output got no gradient
        return (None,) * 10
    q, k, v, mask, mq1, mk1, mq2, mk2, stats = ctx.saved_tensors
    grads = _attention_backward_op(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, ctx.impl,
                                   ctx.scale, ctx.want)
    wanted = (q, k, v) + tuple(m if w else None for m, w in zip((mq1, mk1, mq2, mk2), ctx.want))
    dq, dk, dv, d1, d2, d3, d4 = [None if t is None else g for g, t in zip(grads, wanted)]
    return dq, dk, dv, None, d1, d2, d3, d4, None, None


_attention_op.register_autograd(_attention_grad, setup_context=_attention_setup)


def _cpp_takes(q: Tensor, k: Tensor, v: Optional[Tensor]) -> bool:
    """Whether the C++ kernel runs the whole core (products included): float32/float64
    operands of one dtype, with values, at most `compose_cpu.MAX_HEADS` heads."""
    return (v is not None and q.dtype in (torch.float32, torch.float64) and k.dtype == q.dtype
            and v.dtype == q.dtype and v.shape[-1] == q.shape[-1]
            and q.shape[1] <= compose_cpu.MAX_HEADS and compose_cpu.available())


def _cpp_forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale) -> Optional[Tuple[Tensor, None]]:
    if not _cpp_takes(q, k, v):
        return None
    return torch.ops.dcvit_cpu.attention_forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale), None


def _cpp_backward(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, scale,
                  want) -> Optional[List[Optional[Tensor]]]:
    if not _cpp_takes(q, k, v):
        return None
    grads = torch.ops.dcvit_cpu.attention_backward(grad, q, k, v, mask, mq1, mk1, mq2, mk2, scale)
    return [None if t is None else g for g, t in zip(grads, (q, k, v, mq1, mk1, mq2, mk2))]


register_core("cpu", "cpp", _cpp_forward, _cpp_backward)


def _triton_forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale) -> Optional[Tuple[Tensor, Tensor]]:
    if v is None:
        return None                     # the weights themselves: the tiled driver's torch rows
    return _triton().attention_forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale)


def _triton_backward(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, scale,
                     want) -> Optional[List[Optional[Tensor]]]:
    if v is None:
        return None
    return _triton().attention_backward(grad.transpose(1, 2), q, k, v, mask, mq1, mk1, mq2, mk2,
                                        stats, scale, want)


def _triton_stats(q: Tensor, k: Tensor, v: Optional[Tensor]) -> Optional[Tensor]:
    """The Triton core's statistics: each head's row log-sum-exp, (B, H, T) float32."""
    B, H, T, _ = q.shape
    return None if v is None else q.new_empty(B, H, T, dtype=torch.float32)


# The Triton core on CUDA, and on CPU tensors under Triton's interpreter (elsewhere its
# forward raises an error that names the fix). Triton itself is imported on first use.
for _device in ("cuda", "cpu"):
    register_core(_device, "triton", _triton_forward, _triton_backward, _triton_stats)


def _matrices_for(impl: str, btH: Tuple[int, int, int], dtype: torch.dtype,
                  mats: Tuple[Optional[Tensor], ...]) -> List[Optional[Tensor]]:
    """The four matrices in the compute dtype; for the C++ kernel also expanded and
    contiguous once, so that every tile is a contiguous slice."""
    out = [_cast(m, dtype) for m in mats]
    if impl == "cpp":
        B, T, H = btH
        out = [None if m is None else (m.expand(B, T, H, H) if i % 2 == 0 else m).contiguous()
               for i, m in enumerate(out)]
    return out


def _rows_forward(impl: str, s0: Tensor, mask: Optional[Tensor], pre: Stage, post: Stage) -> Tensor:
    if impl == "cpp":
        return _rows_forward_cpp(s0, mask, pre, post)
    return _rows_forward_torch(s0, mask, pre, post)


def _rows_backward(impl: str, s0: Tensor, mask: Optional[Tensor], pre: Stage, post: Stage,
                   dp2: Tensor) -> Tuple[Tensor, Tensor, Stage, Stage]:
    if impl == "cpp":
        return _rows_backward_cpp(s0, mask, pre, post, dp2)
    return _rows_backward_torch(s0, mask, pre, post, dp2)


def _cast(m: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    return None if m is None else m.to(dtype)


def _merges(t: Tensor) -> bool:
    """Whether a (b, H, n, k) tensor's two leading dims merge into one without a copy."""
    return t.shape[0] == 1 or t.shape[1] == 1 or t.stride(0) == t.stride(1) * t.shape[1]


def _bmm(a: Tensor, b: Tensor, alpha: float = 1.0, out: Optional[Tensor] = None) -> Tensor:
    """``alpha * a @ b`` for (b, H, n, k) @ (b, H, k, m) operands of one dtype (scale folded
    into the GEMM), into ``out`` (contiguous) when given. On CPU, operands whose (b, H) dims
    do not merge (q, k, v as views of the qkv projection, the incoming gradient) are
    multiplied one batch element at a time on their strides, so that they are never copied."""
    n, m = a.shape[-2], b.shape[-1]
    if out is None:
        out = a.new_empty(*a.shape[:-1], m)
    zero = a.new_zeros(())
    with torch.autocast(a.device.type, enabled=False):                      # operands are cast
        if a.device.type == "cpu" and not (_merges(a) and _merges(b)):
            for i in range(a.shape[0]):
                torch.baddbmm(zero, a[i], b[i], beta=0, alpha=alpha, out=out[i])
        else:
            torch.baddbmm(zero, a.reshape(-1, n, a.shape[-1]), b.reshape(-1, b.shape[-2], m),
                          beta=0, alpha=alpha, out=out.view(-1, n, m))
    return out


def _scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Scaled scores ``scale q k^T`` in the compute dtype (float32 for bf16/fp16 inputs)."""
    return _bmm(q, k.transpose(-2, -1), scale).to(_compute_dtype(q))       # (B, H, T, S)


def _mask_to(mask: Optional[Tensor], shape: Tuple[int, int, int, int], dtype: torch.dtype) -> Optional[Tensor]:
    """The additive mask as a (B, H, T, S)-broadcast view in ``dtype`` (strides may be 0)."""
    if mask is None:
        return None
    m = mask.to(dtype)
    while m.dim() < 4:
        m = m.unsqueeze(0)
    return m.expand(shape)


_CORE_IMPLS = ("cpp", "triton", "torch")   # the cores that run through the custom op


def composed_attention(q: Tensor, k: Tensor, v: Optional[Tensor], mask: Optional[Tensor],
                       mats: ComposeMatrices, impl: str, scale: float = 1.0) -> Tensor:
    """The DCMHA attention core with per-token compose matrices (see module docstring).

    q, k, v: (B, H, N, D), any strides; scale: multiplies q k^T (folded into the GEMM);
    mask: additive, broadcast to (B, H, T, S), or None; mats: `ComposeMatrices` (both
    matrices of an absent stage None); impl: ``"cpp"``, ``"triton"`` or ``"torch"``, as
    `select_impl` chose it for q. Returns (B, H, T, D) (a view of a (B, T, H, D) tensor, so
    that merging the heads costs no copy), or the composed weights (B, H, T, S) when ``v``
    is None.
    """
    if impl not in _CORE_IMPLS:
        raise ValueError(f"composed_attention runs the cores {_CORE_IMPLS}, got {impl!r}")
    out, _ = _attention_op(q, k, v, mask, *mats, impl, float(scale))
    return out if v is None else out.transpose(1, 2)


def composed_attention_compile(q: Tensor, k: Tensor, v: Optional[Tensor], mask: Optional[Tensor],
                               mats: ComposeMatrices, scale: float = 1.0) -> Tensor:
    """Plain differentiable form of `composed_attention` for ``torch.compile`` to fuse."""
    a = (q * scale) @ k.transpose(-2, -1)                                    # (B, H, T, S)
    for mq, mk, softmax in ((mats.pre_q, mats.pre_k, True), (mats.post_q, mats.post_k, False)):
        if mq is not None:
            a = mix_fusable(a, mq.to(a.dtype), None if mk is None else mk.to(a.dtype))
        if softmax:
            a = a if mask is None else a + mask
            a = a.softmax(dim=-1)
    return a if v is None else a.to(v.dtype) @ v
