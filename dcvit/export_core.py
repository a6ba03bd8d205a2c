"""DCMHA's attention core for exported programs: a graph made for inference engines.

Under ``torch.export`` (and so the ONNX exporter and AOTInductor) `dcvit.fused.select_impl`
picks the ``"export"`` core, `export_core`. It computes what the reference core computes
(docs/spec.md §1.1-1.3), from standard ops only, arranged for engines that run one op at a
time (ONNX Runtime): no ``Einsum``, batched ``MatMul`` for every product, and few passes over
the (B, H, N, N) maps.

* The dynamic weights and every slot's Compose matrix are the core's own
  (`DynamicWeights`, `dcvit.matrices.slot_matrices`), built from GEMMs and small ops on
  (B, N, G, H, H); nothing here derives them again.
* The maps are kept query-major, (B, T, H, S), so that the softmax runs on the last axis,
  and a Compose stage is two batched ``MatMul`` and one ``Add``
  (`dcvit.matrices.attention_with_matrices` and `mix`: the eager ``compile`` core
  runs the same function).
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
from torch import Tensor, nn

from .matrices import ComposeMatrices, attention_with_matrices

__all__ = ["export_core"]


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
    rounding. The matrices are the core's own (`DCMHACore.matrices`); this function only
    arranges `dcvit.matrices.attention_with_matrices` over them, batched or one sample at a time."""
    mats = core.matrices(x, q, "export")
    if mask is not None or not torch.onnx.is_in_onnx_export() or not _onnx_exports_scan():
        return attention_with_matrices(q, k, v, mask, mats, core.scale)
    from torch._higher_order_ops.scan import scan
    B = q.shape[0]
    # scan takes tensors with the batch axis first: a stage's shared (1, 1, H, H) matrix
    # (no query-wise dynamic weights) is expanded to every sample
    present = [i for i, m in enumerate(mats) if m is not None]
    batched = [mats[i].expand(B, *mats[i].shape[1:]) for i in present]

    def sample(carry: Tensor, xs: List[Tensor]) -> Tuple[Tensor, Tensor]:
        one: List[Optional[Tensor]] = [None] * 4
        for i, m in zip(present, xs[3:]):
            one[i] = m
        # scan needs a carry (an unused scalar), returned as a new tensor: no output may alias an input
        return carry.clone(), attention_with_matrices(xs[0], xs[1], xs[2], None, ComposeMatrices(*one),
                                                      core.scale)

    _, out = scan(sample, q.new_zeros(()), [q, k, v] + batched)
    return out
