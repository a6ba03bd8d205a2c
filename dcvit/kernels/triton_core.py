"""The fused DCMHA attention core on CUDA: launches `dcvit.kernels.triton_attention`.

``attention_forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale)`` computes
``compose2(softmax(compose1(scale q kᵀ) + mask)) @ v`` (docs/spec.md §1.1) with every
stage given as per-token H×H matrices ``(mq, mk)`` (`dcvit.matrices`): one Triton launch,
returning the output (B, T, H, D) and each head's row log-sum-exp (B, H, T), the softmax
statistics that ``attention_backward`` takes instead of the forward's (B, H, T, S) maps (two
launches; at 9-16 heads without a mask a third on the scores' gradient, which the first
launch writes, for dq and dk, or beyond `PRODUCTS_MAX_KEYS` keys two batched products:
`score_grad_map`).
The dispatcher plugs both into its custom op ``dcvit::composed_attention`` as the core
``"triton"`` (`dcvit.fused.register_core`), which carries the statistics from forward to
backward and which ``torch.compile`` keeps as one node.

Operands: q, k, v (B, H, N, D) on any strides, float32/bfloat16/float16 (products in that
dtype with float32 accumulation; float32 products in full precision, not TF32); the
matrices are float32 (cast otherwise), and Compose's head mixing and the matrices'
gradients run on float32 tiles: in full precision for float32 operands, on TF32 tensor
cores for bf16/fp16 ones (a relative rounding of 2⁻¹¹, below the operands' own; the head
mixing on bf16 ones, 2⁻⁸, where the running Triton takes its contraction only padded:
`triton_attention._mm`);
``mq`` (B|1, T|1, H, H), ``mk`` (B, S, H, H); the mask additive, broadcastable to
(B, H, T, S). Up to `MAX_HEADS` heads, any N (keys are processed in blocks).

With ``TRITON_INTERPRET=1`` set before triton is imported, the same kernels run on CPU
tensors in Triton's interpreter: slow, and meant for tests on machines without a GPU.
This module never imports the dispatcher (`dcvit.fused`).
"""
import os
import warnings
from types import ModuleType
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["available", "unsupported_reason", "dot_min", "interpreted", "works_on", "works_for", "known_to_spill",
           "small_shared", "mask_unsupported",
           "score_grad_map", "score_grad_map_row", "pads_matrices", "matrix_side", "kernel_matrices", "attention_forward",
           "attention_backward", "block_sizes", "MAX_HEADS"]

MAX_HEADS = 16
MAX_REGISTERS = 255       # a thread's registers: the hardware's bound, stated to ptxas (`block_sizes`)
PRODUCTS_MAX_KEYS = 256   # `score_grad_products_kernel`: a program holds all keys' k and dk
PRODUCTS_ROWS = 16        # queries per step of it
# Compile options every launch states (and `dcvit.bench.kernels` compiles with): floating-point
# fusion, which the kernels' instruction counts assume (an exponential's argument is one FMA,
# `triton_attention._exp`). Triton 3.9 warns when it is left to the default, which 3.10 turns off.
COMPILE_OPTIONS = {"enable_fp_fusion": True}

_TRITON_VERSION: Optional[str] = None
try:
    import triton
    _TRITON_VERSION = getattr(triton, "__version__", "of unknown version")
    triton.knobs  # noqa: B018  (the kernels' Triton API; older Triton, e.g. torch 2.4's 3.0, lacks it)
    from triton.backends.nvidia.compiler import min_dot_size as _min_dot_size
except Exception:  # noqa: BLE001  (triton missing, broken or too old: `unsupported_reason()` says so)
    triton = None


def available() -> bool:
    """Whether a Triton the kernels can use imports (they compile on first use)."""
    return triton is not None


def unsupported_reason() -> Optional[str]:
    """Why the running Triton cannot serve the kernels (a sentence naming its version), or
    None when it can: the automatic core choice declines the Triton core with this reason
    before any launch. The kernels need the API of Triton 3.4 and newer (``triton.knobs``
    and the NVIDIA backend's ``min_dot_size``); within it they adapt to what the release's
    ``tl.dot`` takes (`dot_min`)."""
    if triton is not None:
        return None
    if _TRITON_VERSION is None:
        return "the triton package is missing (pip install triton)"
    return (f"Triton {_TRITON_VERSION} lacks the API the kernels use (triton.knobs, the NVIDIA "
            "backend's min_dot_size); they need Triton 3.4 or newer")


_dot_mins: Dict[Tuple[int, int], Tuple[int, int, int]] = {}


def dot_min(bits: int, arch: int = 90) -> Tuple[int, int, int]:
    """The smallest (M, N, K) of a `tl.dot` on ``bits``-bit operands (16: bf16/fp16, 32:
    float32 or TF32) that the running Triton compiles for sm_<arch>, as its NVIDIA backend
    states it: Triton 3.4 takes 16 x 16 x 16 at least, 3.5-3.7 any M and N but K >= 16, 3.8
    and newer K >= 8 for 32-bit operands. The kernels pad a float32 product that is smaller
    with zeros (`triton_attention._mm`) and launch only block sizes whose q/k/v products fit
    (`block_sizes`). Under the interpreter: what a GPU's compilation would take."""
    key = (bits, arch)
    if key not in _dot_mins:
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        ty = {16: tl.bfloat16, 32: tl.float32}[bits]
        _dot_mins[key] = tuple(int(x) for x in _min_dot_size(GPUTarget("cuda", arch, 32))(ty, ty))
    return _dot_mins[key]


# Read once, when this module loads: Triton's knob reads the environment through a C
# function that torch.compile cannot trace, and the core choice asks inside compiled graphs.
_INTERPRET = triton is not None and bool(triton.knobs.runtime.interpret)


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1`` was set before
    triton was imported): then the kernels take CPU tensors."""
    return _INTERPRET


def _kernels(device: torch.device) -> ModuleType:
    """The kernel module, checked against the operands' device."""
    if triton is None:
        raise RuntimeError("the 'triton' attention core needs the triton package; install it "
                           "or force another core (dcvit.fused.attention_impl('compile'))")
    if device.type == "cpu" and not interpreted():
        raise RuntimeError("the 'triton' attention core runs on CUDA tensors; on CPU only under "
                           "Triton's interpreter (TRITON_INTERPRET=1 set before importing triton)")
    from . import triton_attention
    return triton_attention


_checked: Dict[Tuple, bool] = {}


def works_on(q: Tensor) -> bool:
    """Whether the kernels compile for q's device, dtype, heads and head dim and agree with
    the attention formula there: `works_for` of q's."""
    return works_for(str(q.device), q.dtype, q.shape[1], q.shape[3])


@torch.compiler.assume_constant_result
def works_for(device: str, dtype: torch.dtype, heads: int, head_dim: int) -> bool:
    """Whether the kernels compile for this device, dtype, heads and head dim and agree with
    the attention formula there (every stage, key-side matrices and a mask; forward and every
    gradient, on a small random problem), and are not known to spill there (`known_to_spill`).
    Checked once per configuration and remembered; a failure is reported once as a warning.
    The automatic core choice asks this before it picks the Triton core on a GPU where it was
    never measured. Inside ``torch.compile`` the call runs once, while the graph is traced,
    and its answer is a constant of the graph (``assume_constant_result``): the arguments are
    plain values for that."""
    key = (device, dtype, heads, head_dim)
    if not available() or heads > MAX_HEADS or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False                                          # outside the kernels' range
    if key not in _checked:
        arch = _arch(torch.device(device))
        reason = known_to_spill(arch, heads) or ""
        if not reason:
            try:                                              # with a mask where the kernels take one
                err = _self_check(torch.device(device), dtype, heads, head_dim,
                                  masked=_mask_unsupported(arch, heads) is None)
                tol = 1e-3 if dtype == torch.float32 else 3e-2
                if not err <= tol:
                    reason = f"relative error {err:.2e} > {tol:.0e} against the formula"
            except Exception as e:  # noqa: BLE001  (compile errors, out of resources, ...)
                reason = f"{type(e).__name__}: {str(e)[:300]}"
        if reason:
            warnings.warn(f"DCMHA: the Triton attention core is not used on {device} for "
                          f"{heads} heads of {head_dim} dims in {dtype} ({reason}); using the 'compile' core",
                          RuntimeWarning, stacklevel=3)
        _checked[key] = not reason
    return _checked[key]


def known_to_spill(arch: int, heads: int) -> Optional[str]:
    """Why the running Triton's compilation of the kernels for ``heads`` heads is declined,
    or None: under Triton 3.4 (`tl.dot` of 16 rows at least, `dot_min`) the kernels spill
    72-2,540 bytes a thread at 9-16 heads (docs/performance.md, "Under each Triton
    release"), where from 3.5 on every variant fits; the `compile` core serves there, and
    the Triton core can still be forced."""
    if _padded_heads(heads) > 8 and _rows_padded(arch):
        return (f"under Triton {_TRITON_VERSION} the kernels spill 72-2,540 bytes a thread at "
                f"9-16 heads; Triton 3.5 or newer runs them without spills")
    return None


def small_shared(arch: int) -> bool:
    """Whether sm_<arch> gives a block at most 99 KiB of shared memory: sm_86 (RTX 30, A10,
    A40, RTX A6000), sm_89 (RTX 40, L4, L40S) and sm_120 (RTX 50, RTX PRO 6000 Blackwell),
    against 163 KiB (A100) and 227 (H100, B200).
    `block_sizes` gives them only candidates that fit (docs/performance.md)."""
    return arch in (86, 89, 120)


@torch.compiler.assume_constant_result
def mask_unsupported(device: str, heads: int) -> Optional[str]:
    """Why the kernels cannot take a mask for ``heads`` heads on ``device``, or None (a
    constant of a compiled graph, as `works_for`'s answer is)."""
    return _mask_unsupported(_arch(torch.device(device)), heads)


def _mask_unsupported(arch: int, heads: int) -> Optional[str]:
    """`mask_unsupported` for sm_<arch> (under 3.4 `known_to_spill` declines 9-16 heads first)."""
    if small_shared(arch) and _padded_heads(heads) > 8 and not _rows_padded(arch):
        return (f"on sm_{arch} (99 KiB of shared memory a block) the backward kernels with a mask "
                f"need 100-112 KiB at 9-16 heads; without a mask they fit")
    return None


def _self_check(device: torch.device, dtype: torch.dtype, H: int, D: int, masked: bool = True) -> float:
    """Largest error of output and gradients against the formula, relative to each one's
    largest reference value, for a random (1, H, 37, D) problem (3 key blocks at least),
    with a mask (``masked``) or without."""
    g = torch.Generator().manual_seed(0)
    N = 37
    q, k, v = (torch.randn(1, H, N, D, generator=g).to(device, dtype) for _ in range(3))
    mats = [(torch.eye(H) * (i % 2 == 0) + 0.3 * torch.randn(1, N, H, H, generator=g)).to(device)
            for i in range(4)]
    mask = torch.randn(1, 1, N, N, generator=g).to(device) if masked else None
    grad = torch.randn(1, N, H, D, generator=g).to(device, dtype)
    scale = D ** -0.5
    with torch.no_grad():
        out, lse = attention_forward(q, k, v, mask, *mats, scale)
        got = [out] + attention_backward(grad, q, k, v, mask, *mats, lse, scale)
    with torch.enable_grad():
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v, *mats)]
        a = scale * leaves[0] @ leaves[1].transpose(-1, -2)
        for stage, m in ((0, mask), (1, None)):
            mq, mk = leaves[3 + 2 * stage], leaves[4 + 2 * stage]
            a = torch.einsum("bgts,btgh->bhts", a, mq) + torch.einsum("bgts,bsgh->bhts", a, mk)
            a = (a if m is None else a + m).softmax(-1) if stage == 0 else a
        want = (a @ leaves[2]).transpose(1, 2)
        wgrads = torch.autograd.grad(want, leaves, grad.float())
    errs = [((x.float() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item()
            for x, w in zip(got, [want.detach(), *wgrads])]
    return max(errs)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_sizes(H: int, kernel: str = "forward_kernel", arch: int = 90, mask: bool = False) -> List[Dict[str, int]]:
    """Candidate blocks (BT queries, BS keys), head groups G, warps and pipeline stages of
    ``kernel`` for H heads on sm_<arch>, with or without a ``mask``. The first is the one the
    interpreter runs; on a GPU Triton's autotuner times the candidates once per (heads, head
    dim, sequence lengths, mask or not) and keeps the fastest (each one more compilation).
    Each candidate compiles without a register spill for sm_80 and sm_90 with bf16/fp16
    operands at head dim 64, up to 16 heads, under every Triton from 3.5 to 3.9
    (``dcvit.bench.kernels``, tests/test_kernel_resources.py, tests/test_triton_releases.py;
    float32 operands spill some at 12-16 heads, and under 3.4 the backward kernels do at
    12-16 heads, docs/performance.md). Always 8 warps and one pipeline stage (a second doubles
    the loaded tiles in shared memory), but for the key kernel's 16 × 16 blocks on sm_90: two,
    each step's loads (q, do, the queries' matrices and statistics) issued during the step
    before, straight into shared memory (141 KiB; 4 % fewer instructions under 3.8, 2 % under
    3.9; on sm_80 it spilled 4 B). Blackwell keeps one: not compiled here.

    Without a mask, as DCViT trains, larger blocks come first, for fewer instructions per
    score: 32 queries by 32 keys in the forward and 32 queries by 16 keys in the query
    kernel at 8 padded heads; where Compose's mixing is not padded in its contraction (3.8
    on) 16 keys in the key kernel at 8 padded heads, and at 16 padded heads, with the
    score-gradient map (`score_grad_map`: no dq, dk accumulators), 16 queries in the query
    kernel and all heads in one key-kernel program.
    Otherwise, and with a mask (its tile takes registers too): 16 queries by 16 keys (8 keys
    in the key kernel); at 16 padded heads 8 queries in the query kernel, 16 or 8 in the
    forward, and the key kernel's heads split between G = 2 programs per key block where
    they do not all fit (each recomputes the scores and Compose of all heads for the
    accumulators of half). Where `tl.dot` takes no 8-row side (3.4, `dot_min`) the forward
    keeps 16 queries only and each backward kernel gets two candidates, both with 16 padded
    heads split between two programs: 16-row blocks, and 8-row ones whose products pad their
    8 columns inside (`triton_attention._mm`): at 3 and 6 heads the 8-row ones spill nothing
    where the 16-row ones spill 12-204 B, yet they issue about 1.6 times the instructions.
    The score-gradient map's products kernel (`score_grad_map`; else no candidate): 16
    queries a step, all keys up to `PRODUCTS_MAX_KEYS` (BS), one program per (head, sequence).
    Every candidate states a thread's register bound, ``maxnreg`` = `MAX_REGISTERS` (PTX
    ``.maxnreg``): without it ptxas fits some light variants in 128 registers, for two
    blocks per SM, and spills a few bytes to do so (the forward at 16 padded heads went
    without it until the scale was folded in: then two masked variants spilled with it, now
    four of its 8-query variants spill without it).
    On GPUs with 99 KiB of shared memory a block (`small_shared`: sm_86, 89, 120) only what fits
    there: no 32-row blocks, and at 16 padded heads the forward's 8 × 16, the query kernel's
    8 × 8 and the key kernel's 16 × 8 in two head groups, both with the score-gradient map
    (68, 84 and 96 KiB); with a mask the backward kernels need 100-112 KiB there, and the
    dispatcher declines it (`mask_unsupported`).
    The forward's and query kernel's candidates say whether a last block that holds at most
    half of its rows runs a body of half the rows (``TAIL``, `triton_attention`): where their
    blocks are 32 rows, in the query kernel where Compose's mixing is not padded in its
    contraction (3.8 on; under 3.5-3.7 its two bodies together spilled 8-56 B). The kernels
    take it as given and `dcvit.bench.kernels` counts by it."""
    if kernel == "score_grad_products_kernel":          # one program per (head, sequence), S ≤ BS keys
        return ([dict(BT=PRODUCTS_ROWS, BS=PRODUCTS_MAX_KEYS, G=1, num_warps=8, num_stages=1, maxnreg=MAX_REGISTERS)]
                if score_grad_map(H, arch, mask) else [])
    wide = _padded_heads(H) > 8
    padded = _rows_padded(arch)
    large = not mask and not padded                     # the larger blocks, first: fewer instructions
    unpadded_mix = dot_min(32, arch)[2] <= 8 if available() else True   # 3.8 on: Compose's mixing unpadded
    by_map = score_grad_map(H, arch, mask)              # no dq, dk accumulators
    small = small_shared(arch) and not padded           # 99 KiB a block: what fits there
    g = 2 if wide and (small or not by_map) else 1      # else every head in one key-kernel program
    if kernel == "forward_kernel":
        blocks = [(16, 16, 1)] + ([(8, 16, 1)] if wide and not padded else [])
        if large and not wide and not small:
            blocks.insert(0, (32, 32, 1))
        if small and wide:
            blocks = [(8, 16, 1)]
    elif padded:                                        # 16 rows, then 8 padded
        blocks = [(16, 16, g), (8, 16, g) if kernel == "backward_query_kernel" else (16, 8, g)]
    elif kernel == "backward_query_kernel":
        if small and by_map:                            # 8 keys: the map's (no dq product over them)
            blocks = [(8, 8, 1)]
        elif wide:
            blocks = ([(16, 16, 1)] if by_map and unpadded_mix else []) + [(8, 16, 1)]
        else:
            blocks = ([(32, 16, 1)] if large and not small else []) + [(16, 16, 1)]
    else:
        blocks = ([(16, 16, 1)] if large and unpadded_mix and not wide else []) + [(16, 8, g)]
    # the key kernel's 16 x 16 blocks on sm_90: each step's loads issued a step ahead (2 stages)
    ahead = {(16, 16, 1)} if kernel == "backward_key_kernel" and arch == 90 else set()
    rows = kernel != "backward_key_kernel"             # a kernel over row blocks: its TAIL
    return [dict(BT=bt, BS=bs, G=g, num_warps=8, num_stages=2 if (bt, bs, g) in ahead else 1, maxnreg=MAX_REGISTERS,
                 **(dict(TAIL=bt >= 32 and (kernel == "forward_kernel" or unpadded_mix)) if rows else {}))
            for bt, bs, g in blocks]


def _rows_padded(arch: int) -> bool:
    """Whether the running Triton's `tl.dot` takes no 8-row or 8-column side (3.4, `dot_min`)."""
    return available() and max(*dot_min(16, arch)[:2], *dot_min(32, arch)[:2]) > 8


def score_grad_map(H: int, arch: int = 90, mask: bool = False) -> bool:
    """Whether the backward goes through a map of the scores' gradient ``ds = dL/ds0`` (B, H,
    T, S), in the operands' dtype: the query kernel writes it where it would multiply it by k,
    and ``dq = scale · ds k`` and ``dk = scale · dsᵀ q`` come from it, by one kernel that
    reads it once (`triton_attention.score_grad_products_kernel`, up to `PRODUCTS_MAX_KEYS`
    keys: a program holds a head's k and dk for all of them) or beyond by two batched
    products (cuBLAS); neither attention kernel holds dq or dk accumulators. With 16 padded
    heads and no mask, from Triton 3.5 on: there the key kernel's dk accumulators would need
    its heads split between two programs (each recomputing every head's scores and Compose),
    and the query kernel's dq ones 8-query blocks; without them both take one program per 16
    queries (3.8 on) or 8 keys, for about 0.6 times the instructions, against the products
    and the map's bytes (docs/performance.md). With a mask, whose tile takes registers too,
    and under 3.4 the split stays, and the map would cost more than it saves. The map lives
    only while the backward runs (at B/16's shape and batch 256, 252 MB: `score_grad_map_row`)."""
    return _padded_heads(H) > 8 and not mask and not _rows_padded(arch)


def score_grad_map_row(S: int) -> int:
    """The score-gradient map's row stride for S keys: S padded to a multiple of 16 where one
    kernel reads the map (S ≤ `PRODUCTS_MAX_KEYS`), so that every row starts 32-byte aligned
    and Triton, which specialises a stride divisible by 16, writes and reads it in vectors
    (at 197 keys the query kernel's stores of a 16 × 16 block went from twelve 2-byte stores
    a thread to vector ones, 3 % of its instructions, for 5.6 % more bytes in the map);
    beyond, S (the batched products take the map as a contiguous (B·H, T, S) tensor)."""
    return -(-S // 16) * 16 if S <= PRODUCTS_MAX_KEYS else S


_tuned: Dict[Tuple, object] = {}
_OPTIONS = ("num_warps", "num_stages", "maxnreg")      # a candidate's compile options; the rest are constexprs


def _arch(device: torch.device) -> int:
    """The compute capability the kernels compile for (sm_90's rules in the interpreter)."""
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _launch(name: str, device: torch.device, H: int, rows: int, block: str, B: int,
            args: Sequence, kwargs: Dict) -> None:
    """Launch kernel ``name`` over (blocks of ``rows`` of size ``block``, B): autotuned on a
    GPU; with the first `block_sizes` candidate in the interpreter or when the environment
    sets ``DCVIT_TRITON_AUTOTUNE=0`` (tests: one compilation per kernel variant)."""
    kernel = getattr(_kernels(device), name)
    arch = _arch(device)
    candidates = block_sizes(H, name, arch, kwargs["HAS_MASK"])
    if interpreted() or os.environ.get("DCVIT_TRITON_AUTOTUNE", "1") == "0":
        c = candidates[0]
        kernel[(triton.cdiv(rows, c[block]), B, c["G"])](*args, **c, **COMPILE_OPTIONS, **kwargs)
        return
    key = (name, H, arch, kwargs["HAS_MASK"])
    if key not in _tuned:
        configs = [triton.Config({k: v for k, v in c.items() if k not in _OPTIONS}, **{k: c[k] for k in _OPTIONS})
                   for c in candidates]
        _tuned[key] = triton.autotune(configs, key=["T", "S", "D"])(kernel)
    _tuned[key][lambda meta: (triton.cdiv(rows, meta[block]), B, meta["G"])](*args, **COMPILE_OPTIONS, **kwargs)


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    B, H, T, D = q.shape
    if H > MAX_HEADS:
        raise ValueError(f"the Triton attention core takes up to {MAX_HEADS} heads, got {H}; "
                         "force the 'compile' core for more")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the Triton attention core takes float32/bfloat16/float16, got {q.dtype}; "
                         "use the 'compile' core for float64")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != (B, H, k.shape[2], D) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         "(B, H, T, D), (B, H, S, D), (B, H, S, D)")


def _matrix_strides(mats: Sequence[Optional[Tensor]]) -> List[int]:
    """Per matrix: batch and token strides; 0 where broadcast or absent (each token's H×H
    matrix is contiguous, `_prepare`)."""
    out: List[int] = []
    for m in mats:
        out += [0, 0] if m is None else [0 if m.shape[0] == 1 else m.stride(0), 0 if m.shape[1] == 1 else m.stride(1)]
    return out


def _mask_args(mask: Optional[Tensor], dummy: Tensor) -> List:
    """The mask's pointer and (b, h, t, s) strides (a dummy pointer when absent)."""
    return [dummy, 0, 0, 0, 0] if mask is None else [mask, *mask.stride()]


def _flags(q: Tensor, mask: Optional[Tensor], mats: Sequence[Optional[Tensor]]) -> Dict:
    """The kernels' compile-time arguments but the blocks and head groups: heads and head dim, padded to
    powers of two, which operands are present, and the precision of the q/k/v products
    (PRECISION) and of Compose's head mixing (MIX), and the smallest rows or columns (DOT_MN) and
    contraction (DOT_K) of a float32 `tl.dot` (`dot_min`): the head mixing and matrix gradients
    are padded where they are smaller; MH: the matrices' row length (`pads_matrices`);
    FAST_EXP: the softmax's exponentials as the GPU's
    flushing ``ex2.approx.ftz`` (`triton_attention._exp`; not in the interpreter);
    MASK_HEADS: the mask (expanded to (B, H, T, S)) differs between heads; else one tile of it
    serves every head (`triton_attention._logits`)."""
    mq1, mk1, mq2, mk2 = mats
    H, D = q.shape[1], q.shape[3]
    m, n, k = dot_min(32, _arch(q.device))
    return dict(H=H, D=D, HP=_padded_heads(H), DP=max(16, _next_pow2(D)), HAS_MASK=mask is not None,
                MASK_HEADS=mask is not None and H > 1 and mask.stride(1) != 0,
                HAS_PRE=mq1 is not None, HAS_MK1=mk1 is not None, HAS_POST=mq2 is not None,
                HAS_MK2=mk2 is not None, MH=matrix_side(H, _arch(q.device)),
                PRECISION=_precision(q.dtype),
                MIX=_mix_precision(q.dtype), DOT_MN=max(m, n), DOT_K=k, FAST_EXP=not interpreted())


def _padded_heads(H: int) -> int:
    """The kernels' head axis: a power of two, at least 8 (the smallest contraction of a
    float32 `tl.dot`, Compose's head mixing, in Triton 3.8 and newer; older ones pad that
    contraction to 16 inside the product, `triton_attention._mm`)."""
    return max(8, _next_pow2(H))


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's precision: float32 in full ("ieee", not TF32); bf16/fp16 natively. In the
    interpreter, float32 and bf16 products are summed in a fixed order ("exact", see
    `triton_attention._dot`; it cannot multiply bf16 tiles at all)."""
    if interpreted() and dtype in (torch.float32, torch.bfloat16):
        return "exact"
    return "ieee" if dtype == torch.float32 else "tf32"


def _mix_precision(dtype: torch.dtype) -> str:
    """Compose's precision (MIX; `triton_attention._mm`): float32 operands in full ("ieee"),
    bf16/fp16 ones on TF32 tensor cores ("tf32"; bf16 ones where the contraction is padded);
    in the interpreter, for bf16/fp16, those products taken exactly ("exact")."""
    if dtype == torch.float32:
        return "ieee"
    return "exact" if interpreted() else "tf32"


def pads_matrices(H: int, arch: int = 90) -> bool:
    """Whether the kernels take the Compose matrices zero-padded to HP×HP per token (their
    MH): at up to 7 heads (8 padded ones) where the running Triton's `tl.dot` takes Compose's
    8-head contraction as it is (3.8 on, `dot_min`). A block's matrix loads then need no
    head mask and load whole 32-byte rows: 8-15 % fewer instructions in each kernel, more
    than the copy's bytes cost (docs/performance.md). Under 3.4-3.7 the kernels gain 2-5 %,
    less than the copy; at 9-15 heads (16 padded ones) 2-3 %, for a copy four times
    larger."""
    return H < _padded_heads(H) == 8 and dot_min(32, arch)[2] <= 8


def matrix_side(H: int, arch: int = 90) -> int:
    """The rows and columns of each token's matrix as the kernels read it (their MH): HP
    where `pads_matrices`, else H."""
    return _padded_heads(H) if pads_matrices(H, arch) else H


def _prepare(mask: Optional[Tensor], mats: Sequence[Optional[Tensor]], H: int, device: torch.device):
    """The mask as a float32 additive 4-D tensor (bool: True = keep) and the matrices as the
    kernels read them (`kernel_matrices`)."""
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
        mask = mask.to(torch.float32)
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
    return mask, kernel_matrices(mats, H, device)


def kernel_matrices(mats: Sequence[Optional[Tensor]], H: int, device: torch.device) -> List[Optional[Tensor]]:
    """The matrices (B|1, N|1, H, H) as the kernels read them: float32, each token's matrix
    contiguous (the kernels index it with constant offsets: a fifth fewer instructions at 12
    heads than with its strides as arguments), zero-padded to HP×HP where `pads_matrices`
    (broadcast dims kept); matrices already so are taken as they are. Differentiable: the
    dispatcher calls it before its op, so that autograd keeps the padded matrices for the
    backward, which then pads nothing (matrix gradients come back HP×HP for them)."""
    side = matrix_side(H, _arch(device))
    out: List[Optional[Tensor]] = []
    for m in mats:
        if m is not None:
            m = m.to(torch.float32)
            pad = side - m.shape[-1]
            m = torch.nn.functional.pad(m, (0, pad, 0, pad)) if pad else _contiguous_matrices(m)
        out.append(m)
    return out


def _contiguous_matrices(m: Tensor) -> Tensor:
    """m (B|1, N|1, H, H) with each (H, H) matrix contiguous (its broadcast dims kept)."""
    return m if m.stride(3) == 1 and m.stride(2) == m.shape[3] else m.contiguous()


def attention_forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                      mq1: Optional[Tensor], mk1: Optional[Tensor], mq2: Optional[Tensor],
                      mk2: Optional[Tensor], scale: float) -> Tuple[Tensor, Tensor]:
    """The core's forward: (output (B, T, H, D), row log-sum-exp (B, H, T) float32)."""
    _check(q, k, v)
    B, H, T, D = q.shape
    S = k.shape[2]
    mask, (mq1, mk1, mq2, mk2) = _prepare(mask, (mq1, mk1, mq2, mk2), H, q.device)
    if mask is not None:
        mask = mask.expand(B, H, T, S)
    out = v.new_empty(B, T, H, D)
    lse = q.new_empty(B, H, T, dtype=torch.float32)
    o = out.transpose(1, 2)                                                  # (B, H, T, D) view
    mask_args = _mask_args(mask, lse)
    mats = (mq1, mk1, mq2, mk2)
    _launch("forward_kernel", q.device, H, T, "BT", B, (
        q, k, v, o, lse, mask_args[0], *(lse if m is None else m for m in mats),
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *mask_args[1:],
        *_matrix_strides(mats), T, S, float(scale)), _flags(q, mask, mats))
    return out, lse


def attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                       mq1: Optional[Tensor], mk1: Optional[Tensor], mq2: Optional[Tensor],
                       mk2: Optional[Tensor], lse: Tensor, scale: float,
                       want: Sequence[bool] = (True, True, True, True)) -> List[Optional[Tensor]]:
    """Gradients for q, k, v, mq1, mk1, mq2, mk2 from the output's gradient ``grad``
    (B, T, H, D) and the statistics ``lse`` that `attention_forward` returned; ``want``
    skips matrix gradients nobody needs (None). Matrix gradients come back per token,
    (B, T, H, H) / (B, S, H, H) float32, whatever the matrices' broadcast shapes (the
    dispatcher sums them down); HP×HP for matrices given padded (`kernel_matrices`)."""
    if lse is None:
        raise ValueError("the Triton attention core's backward needs the forward's statistics "
                         "(lse); run attention_forward and pass its second result")
    B, H, T, D = q.shape
    S = k.shape[2]
    given = (mq1, mk1, mq2, mk2)
    mask, (mq1, mk1, mq2, mk2) = _prepare(mask, given, H, q.device)
    if mask is not None:
        mask = mask.expand(B, H, T, S)
    g = grad.transpose(1, 2)                                                 # (B, H, T, D)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    mats = (mq1, mk1, mq2, mk2)
    flags = _flags(q, mask, mats)
    side = flags["MH"]                                                      # the gradients as the matrices
    wq1, wk1, wq2, wk2 = (w and m is not None for w, m in zip(want, mats))
    dmq1, dmk1, dmq2, dmk2 = (q.new_empty(B, n, side, side, dtype=torch.float32) if w else None
                              for w, n in ((wq1, T), (wk1, S), (wq2, T), (wk2, S)))
    by_product = score_grad_map(H, _arch(q.device), mask is not None)
    ds = q.new_empty(B, H, T, score_grad_map_row(S))[..., :S] if by_product else None   # dL/ds0, for dq, dk
    delta = torch.empty_like(lse)
    mask_args = _mask_args(mask, lse)
    mat_ptrs = [lse if m is None else m for m in mats]
    strides = _matrix_strides(mats)
    _launch("backward_query_kernel", q.device, H, T, "BT", B, (
        q, k, v, g, lse, delta, dq, lse if dmq1 is None else dmq1, lse if dmq2 is None else dmq2,
        lse if ds is None else ds, mask_args[0], *mat_ptrs,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *dq.stride(), *(ds.stride() if by_product else (0,) * 4),
        *mask_args[1:], *strides, T, S, float(scale)), dict(flags, WANT_DMQ1=wq1, WANT_DMQ2=wq2, DS_MAP=by_product))
    _launch("backward_key_kernel", q.device, H, S, "BS", B, (
        q, k, v, g, lse, delta, dk, dv, lse if dmk1 is None else dmk1, lse if dmk2 is None else dmk2,
        mask_args[0], *mat_ptrs,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *dk.stride(), *mask_args[1:],
        *strides, T, S, float(scale)), dict(flags, WANT_DMK1=wk1, WANT_DMK2=wk2, DS_MAP=by_product))
    if by_product and S <= PRODUCTS_MAX_KEYS:                               # the map read once
        _launch_products(q.device, B, H, (ds, q, k, dq, dk, *ds.stride(), *q.stride(), *k.stride(), *dq.stride(),
                                          *dk.stride(), T, S, float(scale)),
                         dict(D=D, DP=flags["DP"], SP=max(16, _next_pow2(S)), PRECISION=flags["PRECISION"]))
    elif by_product:                                                        # scale applied before rounding
        ds3 = ds.view(B * H, T, S)
        dq.view(B * H, T, D).baddbmm_(ds3, k.reshape(B * H, S, D), beta=0, alpha=scale)
        dk.view(B * H, S, D).baddbmm_(ds3.transpose(1, 2), q.reshape(B * H, T, D), beta=0, alpha=scale)
    dms = [d if d is None or m.shape[-1] == side else d[..., :H, :H].contiguous()    # given unpadded
           for d, m in zip((dmq1, dmk1, dmq2, dmk2), given)]
    return [dq, dk, dv, *dms]


def _launch_products(device: torch.device, B: int, H: int, args: Sequence, kwargs: Dict) -> None:
    """Launch `triton_attention.score_grad_products_kernel`, one program per (head,
    sequence): dq and dk from the score-gradient map where S ≤ `PRODUCTS_MAX_KEYS`."""
    c = block_sizes(H, "score_grad_products_kernel", _arch(device))[0]
    _kernels(device).score_grad_products_kernel[(H, B)](
        *args, BT=c["BT"], num_warps=c["num_warps"], num_stages=c["num_stages"], maxnreg=c["maxnreg"],
        **COMPILE_OPTIONS, **kwargs)
