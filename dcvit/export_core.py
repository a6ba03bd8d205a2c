"""DCMHA's attention core for exported programs: a graph made for inference engines.

Under ``torch.export`` (and so the ONNX exporter and AOTInductor) `dcvit.fused.select_impl`
picks the ``"export"`` core, `export_core`. It computes what the reference core computes
(docs/spec.md §1.1-1.3), from standard ops only, arranged for engines that run one op at a
time (ONNX Runtime): no ``Einsum``, batched ``MatMul`` for every product, and few passes over
the (B, H, N, N) maps.

* The dynamic weights come from two GEMMs (the slots' second projection as one
  block-diagonal matrix), and every slot's Compose matrix (`dcvit.matrices`) from a few
  small ops on (B, N, G, H, H): ``Mq`` = identity + static + query-wise low-rank + gate,
  ``Mk`` = key-wise low-rank + gate. The identity joins the gate's diagonal, and each slot
  leaves as its own (B, N, H, H) tensor, so that a per-sample step below takes its slots
  without splitting them again.
* The maps are kept query-major, (B, T, H, S), so that the softmax runs on the last axis.
* A Compose stage is two batched ``MatMul``: the query side ``Mq[b,t]^T @ a[b,t]`` (one
  H×H matrix per query, on (H, S) blocks) and the key side ``a[b,:,:,s] @ Mk[b,s]`` (per
  key, on (T, H) blocks of the map moved to (B, S, T, H)), then one ``Add``. The key side's
  layout changes are transposes of two axes of a 3-D view (reshapes around them), which
  ONNX Runtime's transpose optimiser cannot merge with the neighbouring ones into a general
  permutation, several times slower.
* In an ONNX export, without a mask, the maps are made one sample at a time: a ``scan``
  over the batch (an ONNX ``Scan`` node) runs scores, both Compose stages, softmax and p v
  on one (H, N, N) map, which stays in cache (0.9 MB for ViT-S/16), where a batch of 16
  ViT-S maps (15 MB each) is moved through memory by every op; the dynamic weights' GEMMs
  stay batched. Other exports (AOTInductor, whose loop over a ``scan`` ran DCViT-S/16 ten
  times slower at batch 16) and masked layers (Swin's windows, causal attention) run the
  same ops on the whole batch, as does an ONNX exporter that cannot convert a ``scan``
  (torch releases before its converter).

Attention dropout in training needs the composed weights as the reference core makes them:
there `select_impl` picks the reference core.
"""
import functools
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .matrices import RMS_EPS, identity_diagonal

__all__ = ["export_core"]


def _slot_matrices(core: nn.Module, x: Tensor) -> Optional[List[Tensor]]:
    """Every dynamic slot's Compose matrix, one (B, N, H, H) tensor per slot, or None without
    dynamic slots: ``sum_r w1[..r, g] w2[..r, h] + diag(dd)``, plus the identity (on the
    diagonal with the gate) and the stage's static matrix on the query slots."""
    dw = core.dynamic_weights
    if dw is None:
        return None
    B, N, C = x.shape
    G, K, H, R = dw.num_slots, dw.hidden_dim, dw.num_heads, dw.rank
    eye = torch.eye(H, dtype=x.dtype, device=x.device)
    diag = identity_diagonal(core.slots.query_slots, G, x.dtype, x.device).unsqueeze(-1)   # (G, 1, 1)
    statics = {slot: stage.static for stage, slot in ((core.pre_compose, core.slots.pre_q),
                                                      (core.post_compose, core.slots.post_q))
               if stage is not None and slot is not None and stage.static is not None}
    gate_in: Optional[Tensor] = None
    m: Optional[Tensor] = None
    if dw.dw1 is not None and dw.qkw is not None:
        if dw.dd_w is not None:                                  # both input projections in one GEMM
            y = x @ torch.cat([dw.dw1.reshape(C, G * K), dw.dd_w], dim=1)
            hidden, gate_in = y[..., :G * K], y[..., G * K:]
        else:
            hidden = x @ dw.dw1.reshape(C, G * K)
        hidden = dw.drop(F.gelu(hidden, approximate=dw.approximate))            # (B, N, G*K)
        qkw = torch.block_diag(*dw.qkw.reshape(G, K, 2 * R * H).unbind(0))     # (G*K, G*2R*H)
        w = (hidden @ qkw).reshape(B, N, G, 2 * R, H)
        w1, w2 = w[..., :R, :], w[..., R:, :]
        # the RMS norm as ONNX Runtime's fusion into one SimplifiedLayerNormalization expects it:
        # a division by the root, then a scale (here a unit one)
        w1 = w1 / torch.sqrt(w1.pow(2).mean(dim=-1, keepdim=True) + RMS_EPS) * torch.ones_like(eye[0])
        m = w1.transpose(-1, -2) @ w2                                          # (B, N, G, H, H)
    if dw.dd_w is not None:
        if gate_in is None:
            gate_in = x @ dw.dd_w
        diag = dw.drop(torch.tanh(gate_in)).reshape(B, N, G, H, 1) + diag
    m = diag * eye if m is None else m + diag * eye                            # (B, N, G, H, H)
    if statics:                                                  # the query slots' static matrices
        m = m + torch.stack([statics[g].to(x.dtype) if g in statics else eye * 0 for g in range(G)])
    return list(m.unbind(-3))


def _compose(a: Tensor, mats: Optional[List[Tensor]], stage: Optional[nn.Module], q_slot: Optional[int],
             k_slot: Optional[int]) -> Tensor:
    """One Compose stage on the query-major map a (..., T, H, S) with the slot matrices, one
    (..., N, H, H) per slot (leading axes: the batch, or none for one sample)."""
    if stage is None:
        return a
    *lead, T, H, S = a.shape
    if mats is not None and q_slot is not None:
        out = mats[q_slot].transpose(-1, -2) @ a                                # (..., T, H, S)
    elif stage.static is not None:
        eye = torch.eye(H, dtype=a.dtype, device=a.device)
        out = (eye + stage.static.to(a.dtype)).transpose(0, 1) @ a
    else:
        out = a
    if mats is not None and k_slot is not None:                  # key-major (..., S, T, H) and back
        per_key = a.reshape(*lead, T * H, S).transpose(-1, -2).reshape(*lead, S, T, H)
        per_key = per_key @ mats[k_slot]
        out = out + per_key.reshape(*lead, S, T * H).transpose(-1, -2).reshape(*lead, T, H, S)
    return out


def _attention(core: nn.Module, q: Tensor, k: Tensor, v: Tensor, mats: Optional[List[Tensor]],
               mask: Optional[Tensor]) -> Tensor:
    """Scores, both Compose stages, softmax and p v on query-major maps: q, k, v (..., H, N, D),
    the slot matrices (..., N, H, H) and an additive mask broadcastable to (B, H, N, N)."""
    slots = core.slots
    a = ((q * core.scale) @ k.transpose(-2, -1)).transpose(-3, -2)           # (..., T, H, S)
    a = _compose(a, mats, core.pre_compose, slots.pre_q, slots.pre_k)
    if mask is not None:
        mask = mask.to(a.dtype)
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        a = a + mask.transpose(1, 2)
    a = a.softmax(dim=-1)
    a = _compose(a, mats, core.post_compose, slots.post_q, slots.post_k)
    return a.transpose(-3, -2) @ v                                              # (..., H, T, D)


@functools.cache
def _onnx_exports_scan() -> bool:
    """Whether torch's ONNX exporter converts a ``scan`` to ONNX ``Scan`` (its converter came
    in 2025; an exporter without it gets the batched graph)."""
    try:
        from torch.onnx._internal.exporter._torchlib.ops import hop
    except ImportError:
        return False
    return hasattr(hop, "higher_order_scan")


def export_core(core: nn.Module, q: Tensor, k: Tensor, v: Tensor, x: Tensor,
                mask: Optional[Tensor]) -> Tensor:
    """The attention core of a `dcvit.core.DCMHACore`: q, k, v (B, H, N, D), the layer input
    x (B, N, C) and an additive mask -> (B, H, N, D), equal to ``core.reference`` up to
    rounding."""
    mats = _slot_matrices(core, x.to(q.dtype))
    if mask is not None or not torch.onnx.is_in_onnx_export() or not _onnx_exports_scan():
        return _attention(core, q, k, v, mats, mask)
    from torch._higher_order_ops.scan import scan

    def sample(carry: Tensor, xs: List[Tensor]) -> Tuple[Tensor, Tensor]:
        # scan needs a carry (an unused scalar), returned as a new tensor: no output may alias an input
        return carry.clone(), _attention(core, xs[0], xs[1], xs[2], xs[3:] or None, None)

    _, out = scan(sample, q.new_zeros(()), [q, k, v] + (mats or []))
    return out
