"""Per-token Compose matrices: each Compose stage of docs/spec.md §1.1 as one H×H map per token.

For query t and key s a stage is one linear map of the heads::

    compose(a)[b,h,t,s] = sum_g a[b,g,t,s] * (Mq[b,t,g,h] + Mk[b,s,g,h])
    Mq[b,t] = I + W + qw1[b,t]^T qw2[b,t] + diag(qdd[b,t])      # (H, H)
    Mk[b,s] =         kw1[b,s]^T kw2[b,s] + diag(kdd[b,s])      # (H, H)

so the low-rank terms, gates, identity and static matrix of a side merge into one small
matrix. A (stage, side) pair of Compose is a *slot*: `ComposeSlots` says, once per layer,
where each slot's dynamic weights live, and `ComposeMatrices` carries the four matrices to
the attention core. A layer builds all its dynamic slots at once from the raw projections
(`slot_matrices_from_projections`: `slot_matrices`, the one PyTorch builder, or with the
``cpp`` core one C++ pass, the custom op ``dcvit::slot_matrices``) and takes each stage's
pair with `stage_matrices`. `mix` applies a pair to a query-major (..., T, H, S) map, the one
PyTorch formulation of Compose on the matrices (eager, compiled and exported graphs), and
`attention_with_matrices` the whole attention core with it. `dcvit.fused` runs the attention
core on them.
"""
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .kernels import compose_cpu  # noqa: F401  (loads the dcvit_cpu operators)

__all__ = ["ComposeSlots", "ComposeMatrices", "compose_stage_macs", "slot_matrices",
           "slot_matrices_from_projections", "stage_matrices", "rms_normalize", "RMS_EPS", "mix",
           "attention_with_matrices"]


class ComposeSlots(NamedTuple):
    """Compose's (stage, side) slots: for each, its index on `DynamicWeights`' slot axis, or
    None when that stage and side is not composed with dynamic weights.

    Built once per layer from the DCMHA options (`from_options`); the layer, the matrix
    builder and the MAC count all read it.
    """
    pre_q: Optional[int]
    pre_k: Optional[int]
    post_q: Optional[int]
    post_k: Optional[int]

    @staticmethod
    def from_options(pre_compose: bool, post_compose: bool, query_wise: bool, key_wise: bool,
                     dynamic: bool) -> "ComposeSlots":
        """The dynamic slots in the order pre-query, pre-key, post-query, post-key."""
        on = [dynamic and stage and side for stage in (pre_compose, post_compose)
              for side in (query_wise, key_wise)]
        index = [sum(on[:i]) if on[i] else None for i in range(4)]
        return ComposeSlots(*index)

    @property
    def count(self) -> int:
        """The number of dynamic slots (G of `DynamicWeights`)."""
        return sum(i is not None for i in self)

    def stage(self, name: str) -> Tuple[Optional[int], Optional[int]]:
        """The (query, key) slots of stage ``"pre"`` or ``"post"``."""
        return (self.pre_q, self.pre_k) if name == "pre" else (self.post_q, self.post_k)

    @property
    def query_slots(self) -> List[int]:
        """The query-side slots: their matrices carry the identity (the skip connection)."""
        return [i for i in (self.pre_q, self.post_q) if i is not None]


def compose_stage_macs(slots: ComposeSlots, stage: str, heads: int, rank: int, dynamic_proj: bool,
                       static: bool) -> int:
    """Multiply-adds of one Compose stage (``"pre"`` or ``"post"``) per (query, key) pair in
    the paper's formulation (docs/spec.md §3): each low-rank slot of the stage maps the H heads
    to R and back (2·H·R), the static matrix costs H²; the gates are element-wise products,
    not counted. `dcvit.accounting` and the fused core's FLOP formula both count with it."""
    low_rank = sum(i is not None for i in slots.stage(stage)) if dynamic_proj else 0
    return low_rank * 2 * heads * rank + (heads * heads if static else 0)


class ComposeMatrices(NamedTuple):
    """One Compose matrix per slot, as the attention core takes them: ``pre_q``/``post_q``
    (B|1, T|1, H, H) with the identity, static and query-wise terms, ``pre_k``/``post_k``
    (B, S, H, H) with the key-wise terms or None; both of a stage None when it is absent."""
    pre_q: Optional[Tensor]
    pre_k: Optional[Tensor]
    post_q: Optional[Tensor]
    post_k: Optional[Tensor]


def _outer_sum(w1: Tensor, w2: Tensor) -> Tensor:
    """``sum_r w1[..., r, g] w2[..., r, h]`` (..., H, H): broadcast products, since a batched
    matmul of thousands of (H, R) @ (R, H) blocks is slow on CPU."""
    return (w1.unsqueeze(-1) * w2.unsqueeze(-2)).sum(dim=-3)


def identity_diagonal(identity_slots: List[int], num_slots: int, dtype: torch.dtype,
                      device: torch.device) -> Tensor:
    """(G, 1): 1 on the rows of ``identity_slots``, 0 elsewhere: the identity's share of the
    slots' diagonals, broadcast over heads."""
    return torch.tensor([[1.0 if g in identity_slots else 0.0] for g in range(num_slots)],
                        dtype=dtype, device=device)


def slot_matrices(w1: Optional[Tensor], w2: Optional[Tensor], dd: Optional[Tensor],
                  identity_slots: List[int], dtype: torch.dtype) -> Optional[Tensor]:
    """Every slot's dynamic matrix at once, in a few large ops: the one PyTorch builder of the
    per-token matrices (eager, compiled and exported; the C++ kernel builds the same in one
    pass, `slot_matrices_from_projections`).

    w1, w2 (B, N, G, R, H) and dd (B, N, G, H) from `DynamicWeights` (either may be None)
    -> (B, N, G, H, H): ``sum_r w1[..r, g] w2[..r, h] + diag(dd)``, plus the identity on the
    ``identity_slots`` (the query-side slots, which carry the skip connection); or None.
    Out of place and with no diagonal op, so that an exported graph holds standard ops only.
    """
    ref = w1 if w1 is not None else dd
    if ref is None:
        return None
    G, H = ref.shape[2], ref.shape[-1]
    diag: Optional[Tensor] = None if dd is None else dd.to(dtype)            # (B, N, G, H)
    if identity_slots:
        eye = identity_diagonal(identity_slots, G, dtype, ref.device)        # (G, 1)
        diag = eye if diag is None else diag + eye
    m: Optional[Tensor] = None
    if w1 is not None and w2 is not None:
        m = _outer_sum(w1.to(dtype), w2.to(dtype))                           # (B, N, G, H, H)
    if diag is None:
        return m
    on_diagonal = diag.unsqueeze(-1) * torch.eye(H, dtype=dtype, device=ref.device)  # (.., G, H, H)
    return on_diagonal if m is None else m + on_diagonal


RMS_EPS = 1e-6   # of the RMS norm of w1 over heads (DynamicWeights)


def rms_normalize(w1: Tensor, eps: float = RMS_EPS) -> Tensor:
    """``w1 * rsqrt(mean_h w1^2 + eps)``: the RMS norm of the low-rank query/key weights."""
    return w1 * torch.rsqrt(w1.pow(2).mean(dim=-1, keepdim=True) + eps)


# The one-pass matrix builder of the C++ kernels as custom ops (forward and backward), so that
# torch.compile keeps it as one node too.

@torch.library.custom_op("dcvit::slot_matrices", mutates_args=())
def _slots_op(w: Tensor, dd: Optional[Tensor], identity_slots: List[int]) -> Tensor:
    return torch.ops.dcvit_cpu.slot_matrices(w, dd, identity_slots, RMS_EPS)


@_slots_op.register_fake
def _(w, dd, identity_slots):
    B, N, G, _, H = w.shape
    return w.new_empty(B, N, G, H, H)


@torch.library.custom_op("dcvit::slot_matrices_backward", mutates_args=())
def _slots_backward_op(w: Tensor, dm: Tensor, with_gate: bool) -> List[Tensor]:
    return torch.ops.dcvit_cpu.slot_matrices_backward(w, dm, with_gate, RMS_EPS)


@_slots_backward_op.register_fake
def _(w, dm, with_gate):
    B, N, G, _, H = w.shape
    return [torch.empty_like(w), w.new_empty(B, N, G, H) if with_gate else w.new_empty(0)]


def _slots_setup(ctx, inputs, output) -> None:
    w, dd, _ = inputs
    ctx.save_for_backward(w)
    ctx.with_gate = dd is not None


def _slots_grad(ctx, dm: Tensor):
    (w,) = ctx.saved_tensors
    dw, ddd = _slots_backward_op(w, dm, ctx.with_gate)
    return dw, ddd if ctx.with_gate else None, None


_slots_op.register_autograd(_slots_grad, setup_context=_slots_setup)


def slot_matrices_from_projections(w: Tensor, dd: Optional[Tensor], identity_slots: List[int],
                                   dtype: torch.dtype, cpp: bool = False) -> Tensor:
    """Every slot's dynamic matrix from the raw projections, in ``dtype``; differentiable.

    w (B, N, G, 2R, H): ``w1, w2 = w.split(R, -2)`` before the RMS norm of w1; dd (B, N, G, H)
    or None. Equals ``slot_matrices(rms_normalize(w1), w2, dd, identity_slots, dtype)``; with
    ``cpp`` (the C++ core runs: CPU tensors, float32/float64, the kernels built) the C++
    kernel does it in one pass (one op, ``dcvit::slot_matrices``, instead of a dozen on tiny
    tensors).
    """
    if cpp:
        return _slots_op(w.to(dtype).contiguous(), None if dd is None else dd.to(dtype).contiguous(),
                         list(identity_slots))
    w1, w2 = w.split(w.shape[-2] // 2, dim=-2)
    return slot_matrices(rms_normalize(w1), w2, dd, identity_slots, dtype)


def stage_matrices(slots: Optional[Tensor], q_slot: Optional[int], k_slot: Optional[int],
                   static: Optional[Tensor], num_heads: int, dtype: torch.dtype,
                   device: torch.device) -> Tuple[Tensor, Optional[Tensor]]:
    """One stage's ``(mq, mk)`` (see `ComposeMatrices`) from `slot_matrices` and the stage's
    (query, key) slots of `ComposeSlots` (None: absent; the query slot already holds the
    identity)."""
    if slots is not None and q_slot is not None:
        mq = slots[:, :, q_slot]                                             # (B, T, H, H)
    else:
        mq = torch.eye(num_heads, dtype=dtype, device=device).view(1, 1, num_heads, num_heads)
    if static is not None:
        mq = mq + static.to(dtype)
    mk = slots[:, :, k_slot] if slots is not None and k_slot is not None else None  # (B, S, H, H)
    return mq, mk


def mix(a: Tensor, mq: Tensor, mk: Optional[Tensor]) -> Tensor:
    """One Compose stage with its merged matrices, on a query-major map: the one PyTorch
    formulation of the eager ``compile`` core and of the export core (`dcvit.export_core`).

    ``out[..., t, h, s] = sum_g a[..., t, g, s] (mq[..., t, g, h] + mk[..., s, g, h])``, with
    a (..., T, H, S) (leading axes: the batch, or none for one sample), mq (..., T|1, H, H),
    mk (..., S, H, H) or None. Two batched MatMuls: the query side ``mq[t]^T @ a[t]`` (one
    H×H matrix per query, on (H, S) blocks) and the key side ``a[:, :, s] @ mk[s]`` (per key,
    on (T, H) blocks of the map moved to (..., S, T, H)). The key side's layout changes are
    transposes of two axes of a 3-D view, which ONNX Runtime runs fast (a general
    permutation there is several times slower).
    """
    *lead, T, H, S = a.shape
    out = mq.transpose(-1, -2) @ a                                           # (..., T, H, S)
    if mk is not None:
        per_key = a.reshape(*lead, T * H, S).transpose(-1, -2).reshape(*lead, S, T, H)
        per_key = per_key @ mk                                               # (..., S, T, H)
        out = out + per_key.reshape(*lead, S, T * H).transpose(-1, -2).reshape(*lead, T, H, S)
    return out


def attention_with_matrices(q: Tensor, k: Tensor, v: Optional[Tensor], mask: Optional[Tensor],
                            mats: ComposeMatrices, scale: float = 1.0) -> Tensor:
    """Scores, both Compose stages (`dcvit.matrices.mix`), softmax and p v on query-major maps
    (..., T, H, S), so that softmax runs on the last axis: q, k, v (..., H, N, D) (leading
    axes: the batch, or none for one sample), the matrices of `ComposeMatrices` with the same
    leading axes, an additive mask broadcastable to (B, H, T, S) -> (..., H, T, D), or the
    composed weights (..., H, T, S) when ``v`` is None."""
    a = ((q * scale) @ k.transpose(-2, -1)).transpose(-3, -2)                # (..., T, H, S)
    for mq, mk, softmax in ((mats.pre_q, mats.pre_k, True), (mats.post_q, mats.post_k, False)):
        if mq is not None:
            a = mix(a, mq.to(a.dtype), None if mk is None else mk.to(a.dtype))
        if softmax:
            if mask is not None:
                m = mask.to(a.dtype)
                while m.dim() < 4:
                    m = m.unsqueeze(0)
                a = a + m.transpose(1, 2)                                    # (B|1, T, H|1, S)
            a = a.softmax(dim=-1)
    a = a.transpose(-3, -2)                                                  # (..., H, T, S)
    return a if v is None else a.to(v.dtype) @ v
