"""FLOP and parameter accounting for one model: fvcore with exact op handles, cross-checked.

Convention (docs/spec.md §3): fvcore's unit, one multiply-add = one "FLOP" (reported as MACs/GMACs).
fvcore counts the matrix products (``linear``, ``matmul``, ``einsum``, ``conv``), and norms
at 5 per element; element-wise ops (``add``, ``mul``, ``gelu``, ``tanh``, ``softmax``, ...)
are *not* counted. They are never silently dropped: every op fvcore skipped is returned in
``Accounting.skipped_ops`` with its number of occurrences.

Two handles replace or extend fvcore's defaults:

* ``aten::einsum``: exact. fvcore's default asks ``numpy.einsum_path`` and halves its
  estimate, which rounds to 4 significant figures and counts an element-wise product
  (a gate) at half a MAC per element. Here a contraction of two operands costs the product
  of the sizes of all its indices.
* ``aten::scaled_dot_product_attention``: the two matrix products of attention,
  ``q @ k^T`` and ``p @ v``, as fvcore counts them when timm's fused attention is off; with
  it, fused baselines give the published anchors (ViT-S/16 at 224²: 4,608,338,304 MACs).

DCMHA's ``dynamic_weights`` and ``pre_compose``/``post_compose`` are modules, so they are
rows of `module_table`. Two independent cross-checks: `analytic_macs` (a closed formula
from the model's hyper-parameters) and `flop_counter_macs`
(``torch.utils.flop_counter.FlopCounterMode``, which counts only the matrix products, at
2 FLOPs per MAC; compare it with `Accounting.matmul_macs`).
"""
import contextlib
import copy
import dataclasses
import math
import re
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from fvcore.nn import FlopCountAnalysis


def _fvcore() -> ModuleType:
    """``fvcore.nn``, imported on first use: only the functions that count FLOPs or
    parameters need it, so `analytic_macs`, `einsum_macs` and whoever imports this module
    (``python -m dcvit.bench.kernels --estimate``, ``dcvit-report --help``) run without fvcore installed.

    fvcore.nn scripts its focal losses with torch.jit.script at import time, which torch
    deprecates with a FutureWarning; it says nothing about this module, so only that warning,
    only during this import, is ignored (the caller's filters are restored as they were)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is", category=FutureWarning)
        import fvcore.nn
        import fvcore.nn.jit_handles  # noqa: F401  (get_shape, for the op handles)
    return fvcore.nn

from .attention import DCMHA, DCMHA_PARTS, hidden_width
from .fused import attention_impl, attention_macs
from .matrices import compose_stage_macs

__all__ = [
    "Accounting", "account", "flop_analysis", "einsum_macs", "module_table",
    "analytic_macs", "flop_counter_macs", "input_shape_of", "MATMUL_OPS",
]

# fvcore operator names (as in ``by_operator``) that are matrix products; the rest are norms
# and the few element-wise ops fvcore counts by default (pooling, upsampling).
MATMUL_OPS = frozenset({"conv", "linear", "matmul", "mm", "bmm", "addmm", "einsum",
                        "scaled_dot_product_attention"})

# Modules that are always rows of the per-module table, whatever its depth.
_OVERHEAD_MODULES = DCMHA_PARTS


def _parse_einsum(equation: str, shapes: Sequence[Sequence[int]]) -> Tuple[List[str], str]:
    """Operand and output subscripts with any ``...`` replaced by explicit letters."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise ValueError(f"einsum {equation!r} has {len(terms)} operands but {len(shapes)} shapes")
    if "..." in eq:
        free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in eq]
        ranks = [len(s) - (len(t) - 3) for t, s in zip(terms, shapes) if "..." in t]
        ell = "".join(free[:max(ranks, default=0)])
        terms = [t.replace("...", ell[len(ell) - (len(s) - (len(t) - 3)):]) if "..." in t else t
                 for t, s in zip(terms, shapes)]
        rhs = rhs.replace("...", ell) if arrow else rhs
        if not arrow:
            arrow, rhs = "->", ell + "".join(sorted(c for c in set("".join(terms)) - set(ell)
                                                    if "".join(terms).count(c) == 1))
    if not arrow:  # numpy's implicit mode: indices that appear once, in alphabetical order
        joined = "".join(terms)
        rhs = "".join(sorted(c for c in set(joined) if joined.count(c) == 1))
    return terms, rhs


def einsum_macs(equation: str, shapes: Sequence[Sequence[int]]) -> int:
    """Exact multiply-adds of ``torch.einsum(equation, *operands)`` for operand ``shapes``.

    Two operands: the product of the sizes of every index (one multiply per point of the
    joint index space), so a contraction ``bnc,cgk->bngk`` costs B·N·C·G·K and an
    element-wise gate ``bhts,bth->bhts`` costs B·H·T·S. One operand (a sum or a transpose)
    has no products: 0. More operands are contracted pairwise along numpy's optimal path.
    """
    terms, rhs = _parse_einsum(equation, shapes)
    sizes: Dict[str, int] = {}
    for term, shape in zip(terms, shapes):
        if len(term) != len(shape):
            raise ValueError(f"einsum {equation!r}: subscripts {term!r} do not fit shape {list(shape)}")
        for letter, n in zip(term, shape):
            sizes[letter] = max(sizes.get(letter, 1), int(n))
    if len(terms) == 1:
        return 0
    if len(terms) == 2:
        return math.prod(sizes[c] for c in set(terms[0]) | set(terms[1]))
    views = [np.broadcast_to(np.zeros((), dtype=np.float32), tuple(s)) for s in shapes]
    path = np.einsum_path(",".join(terms) + "->" + rhs, *views, optimize="optimal")[0][1:]
    operands, macs = list(terms), 0
    for step in path:
        picked = [operands[i] for i in step]
        for i in sorted(step, reverse=True):
            operands.pop(i)
        joint = set("".join(picked))
        keep = set("".join(operands)) | set(rhs)
        if len(picked) > 1:
            macs += math.prod(sizes[c] for c in joint)
        operands.append("".join(c for c in sorted(joint) if c in keep))
    return macs


def _einsum_handle(inputs: List[Any], outputs: List[Any]) -> int:
    equation = inputs[0].toIValue()
    get_shape = _fvcore().jit_handles.get_shape
    shapes = [get_shape(v) for v in inputs[1].node().inputs()]
    return einsum_macs(equation, shapes)


def _sdpa_handle(inputs: List[Any], outputs: List[Any]) -> int:
    get_shape = _fvcore().jit_handles.get_shape
    return attention_macs(*(get_shape(x) for x in inputs[:3]))   # q @ k^T, then p @ v


def flop_analysis(model: nn.Module, inputs: Any) -> "FlopCountAnalysis":
    """fvcore's ``FlopCountAnalysis`` with the exact einsum and the SDPA handles installed.

    fvcore's own warnings are off: `account` returns what they would have said
    (skipped ops, uncalled modules).
    """
    analysis = _fvcore().FlopCountAnalysis(model, inputs)
    analysis.set_op_handle("aten::einsum", _einsum_handle,
                           "aten::scaled_dot_product_attention", _sdpa_handle)
    return analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)


@contextlib.contextmanager
def _reference_attention(model: nn.Module) -> Iterator[None]:
    """Run DCMHA's reference core (the `Compose` modules, ops fvcore can see) in this block.

    The kernel cores of `dcvit.fused` are one custom op (``FlopCounterMode`` counts it by its
    registered formula, the same MACs; a tracer sees one opaque call); MACs are those of the
    paper's formulation, whichever core runs in production.
    """
    from .conversion import is_converted   # DCMHA layers, dcvit's own or converted ones
    if not is_converted(model):
        yield
        return
    with attention_impl("reference"):
        yield


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Count on one thread: batch-1 tensors are small, and on a busy machine thread
    hand-offs made tracing DCViT-S 20x slower than the arithmetic itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class Accounting:
    """Parameters and MACs of one model at one input shape (fvcore convention)."""

    input_shape: Tuple[int, ...]
    params: int
    macs: int
    macs_by_operator: Dict[str, int]
    macs_by_module: Dict[str, int]      # submodules with MACs or parameters, in model order
    params_by_module: Dict[str, int]
    skipped_ops: Dict[str, int] = field(default_factory=dict)   # op -> occurrences, not counted
    uncalled_modules: List[str] = field(default_factory=list)

    @property
    def gmacs(self) -> float:
        return self.macs / 1e9

    @property
    def matmul_macs(self) -> int:
        """MACs of the matrix products only: what ``FlopCounterMode`` counts (at 2 per MAC)."""
        return sum(v for k, v in self.macs_by_operator.items() if k in MATMUL_OPS)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def input_shape_of(model: nn.Module, batch_size: int = 1) -> Tuple[int, ...]:
    """(B, C, H, W) the model is built for: its patch embedding, else its pretrained cfg."""
    patch_embed = getattr(model, "patch_embed", None)
    img_size = getattr(patch_embed, "img_size", None)
    proj = getattr(patch_embed, "proj", None)
    if img_size is not None and isinstance(proj, nn.Conv2d):
        return (batch_size, proj.in_channels, *img_size)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if "input_size" not in cfg:
        raise ValueError(f"cannot tell the input size of {type(model).__name__}; pass input_shape=")
    return (batch_size, *cfg["input_size"])


@torch.no_grad()
def account(model: nn.Module, input_shape: Optional[Sequence[int]] = None) -> Accounting:
    """Count the parameters and MACs of ``model`` on a zero input of ``input_shape``.

    ``input_shape`` defaults to ``(1, *model's input size)``. The model is traced in eval
    mode (restored afterwards), with DCMHA on its reference path where DCMHA has fast ones.
    """
    shape = tuple(input_shape) if input_shape is not None else input_shape_of(model)
    ref = next(model.parameters(), None)
    x = torch.zeros(shape, device=ref.device if ref is not None else None)
    was_training = model.training
    model.eval()
    try:
        with _reference_attention(model), _one_thread():
            analysis = flop_analysis(model, x)
            by_module = analysis.by_module()
            by_operator = analysis.by_operator()
            skipped = analysis.unsupported_ops()
            uncalled = sorted(analysis.uncalled_modules())
    finally:
        model.train(was_training)
    params = _fvcore().parameter_count(model)
    names = [n for n, _ in model.named_modules() if n and (by_module.get(n) or params.get(n))]
    return Accounting(
        input_shape=shape,
        params=int(params[""]),
        macs=int(by_module[""]),
        macs_by_operator={k: int(v) for k, v in sorted(by_operator.items())},
        macs_by_module={n: int(by_module.get(n, 0)) for n in names},
        params_by_module={n: int(params.get(n, 0)) for n in names},
        skipped_ops=dict(sorted(skipped.items())),
        uncalled_modules=uncalled,
    )


def module_table(acc: Accounting, max_depth: int = 4, collapse_blocks: bool = True
                 ) -> List[Dict[str, Any]]:
    """Per-module rows ``{"module", "params", "macs", "macs_pct"}`` in depth-first order.

    With ``collapse_blocks`` the repeated blocks are summed into ``blocks.*`` rows, so the
    table reads as "per model, by kind of module". Rows deeper than ``max_depth`` are left
    out, except DCMHA's ``dynamic_weights``/``pre_compose``/``post_compose``, which are
    always shown: they are the overhead this table exists to show.
    """
    def key(name: str) -> str:
        return re.sub(r"(^|\.)(\d+)(?=\.|$)", r"\1*", name) if collapse_blocks else name

    rows: Dict[str, Dict[str, int]] = {}
    for name in dict.fromkeys([*acc.macs_by_module, *acc.params_by_module]):
        if name:
            row = rows.setdefault(key(name), {"params": 0, "macs": 0})
            row["params"] += acc.params_by_module.get(name, 0)
            row["macs"] += acc.macs_by_module.get(name, 0)
    out = [{"module": "(total)", "params": acc.params, "macs": acc.macs, "macs_pct": 100.0}]
    for name in rows:  # the model's own order (named_modules)
        depth = len(name.split("."))
        if name.endswith("*") or (depth > max_depth and name.split(".")[-1] not in _OVERHEAD_MODULES):
            continue
        row = rows[name]
        pct = 100.0 * row["macs"] / acc.macs if acc.macs else 0.0
        out.append({"module": name, "params": row["params"], "macs": row["macs"], "macs_pct": pct})
    return out


def _norm_macs(norm: nn.Module, elements: int) -> int:
    """fvcore's count for a norm layer: 5 per element with an affine transform, else 4."""
    if isinstance(norm, nn.Identity):
        return 0
    if not isinstance(norm, nn.LayerNorm):
        raise ValueError(f"analytic_macs knows LayerNorm only, got {type(norm).__name__}")
    return elements * (5 if norm.weight is not None else 4)


def _dcmha_macs(attn: DCMHA, n: int) -> Dict[str, int]:
    """DCMHA's additions to one attention layer over n tokens (docs/spec.md §1.2, formula per term)."""
    o, c, h = attn.options, attn.dim, attn.num_heads
    r, k = o.rank, hidden_width(h)
    slots = attn.core.slots.count
    out = {"dynamic_weights": 0, "pre_compose": 0, "post_compose": 0}
    if o.dynamic_proj:
        out["dynamic_weights"] += n * c * slots * k          # x @ dw1 -> (N, G, K)
        out["dynamic_weights"] += n * slots * k * 2 * r * h  # hidden @ qkw -> (N, G, 2R, H)
    if o.dynamic_gate:
        out["dynamic_weights"] += n * c * slots * h          # x @ dd_w -> (N, G·H)
    for stage, module in (("pre", attn.core.pre_compose), ("post", attn.core.post_compose)):
        if module is not None:                               # per (t, s): low-rank and static terms
            out[stage + "_compose"] += n * n * compose_stage_macs(attn.core.slots, stage, h, r, o.dynamic_proj,
                                                                  module.static is not None)
    return out


def analytic_macs(model: nn.Module, batch_size: int = 1) -> Dict[str, int]:
    """MACs of a timm ``VisionTransformer`` (ViT or DCViT) from a closed formula.

    Independent of any tracer: hyper-parameters are read off the model (dims, heads, tokens,
    MLP width, DCMHA options) and each term is written out. Same convention as `account`:
    products and LayerNorms (5 per element), no element-wise ops. Returns per-part totals and
    ``"total"``.
    """
    from timm.models.vision_transformer import VisionTransformer
    if not isinstance(model, VisionTransformer):
        raise ValueError(f"analytic_macs covers timm VisionTransformer models, got {type(model).__name__}")
    if model.global_pool == "map":
        raise ValueError("analytic_macs does not cover attention pooling (global_pool='map')")
    pe = model.patch_embed
    c = model.embed_dim
    grid = math.prod(pe.grid_size)
    n = grid + model.num_prefix_tokens
    kh, kw = pe.proj.kernel_size
    parts: Dict[str, int] = {
        "patch_embed": grid * c * pe.proj.in_channels * kh * kw + _norm_macs(pe.norm, grid * c),
        "norms": _norm_macs(model.norm_pre, n * c) + _norm_macs(model.norm, n * c),
        "qkv": 0, "attention": 0, "proj": 0, "mlp": 0,
        "dynamic_weights": 0, "pre_compose": 0, "post_compose": 0, "head": 0,
    }
    for block in model.blocks:
        attn = block.attn
        parts["norms"] += _norm_macs(block.norm1, n * c) + _norm_macs(block.norm2, n * c)
        parts["norms"] += 2 * _norm_macs(attn.q_norm, n * c) + _norm_macs(attn.norm, n * c)
        parts["qkv"] += n * c * attn.qkv.out_features
        d = attn.head_dim
        parts["attention"] += attention_macs((attn.num_heads, n, d), (n, d), (n, d))   # q k^T, p v
        parts["proj"] += n * c * c
        parts["mlp"] += n * (c * block.mlp.fc1.out_features + block.mlp.fc2.in_features * c)
        if isinstance(attn, DCMHA):
            for name, macs in _dcmha_macs(attn, n).items():
                parts[name] += macs
    pooled = 1 if model.global_pool else n
    parts["norms"] += _norm_macs(model.fc_norm, pooled * c)
    pre_logits = getattr(model, "pre_logits", None)      # the big_vision body's Linear+tanh
    if isinstance(pre_logits, nn.Sequential):
        parts["head"] += pooled * c * pre_logits.fc.out_features
    if model.num_classes:
        parts["head"] += pooled * c * model.num_classes
    parts = {k: batch_size * v for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def _sdpa_flops(query_shape, key_shape, value_shape, *args: Any, **kwargs: Any) -> int:
    return 2 * attention_macs(query_shape, key_shape, value_shape)


@torch.no_grad()
def flop_counter_macs(model: nn.Module, input_shape: Optional[Sequence[int]] = None,
                      device: str = "meta") -> Dict[str, int]:
    """Matrix-product MACs by ``torch.utils.flop_counter.FlopCounterMode`` (FLOPs / 2).

    Runs a copy of the model on ``device`` (default ``"meta"``: shapes only, no arithmetic,
    seconds even for ViT-B). Counts matrix products only (no norms, no element-wise ops):
    compare with `Accounting.matmul_macs`. Returns per-operator MACs and ``"total"``.
    """
    from torch.utils.flop_counter import FlopCounterMode
    shape = tuple(input_shape) if input_shape is not None else input_shape_of(model)
    clone = copy.deepcopy(model).eval().to(device)
    aten = torch.ops.aten
    mapping = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops}
    with _reference_attention(clone), _one_thread(), \
            FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        clone(torch.zeros(shape, device=device))
    flops = {str(k): int(v) for k, v in counter.get_flop_counts().get("Global", {}).items()}
    out = {k: v // 2 for k, v in flops.items()}
    out["total"] = sum(flops.values()) // 2
    return out
