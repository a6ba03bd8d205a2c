"""Published ImageNet-1k top-1 (docs/spec.md §4): quoted beside the measured rows, never measured here."""
from typing import Any, Dict, List

__all__ = ["QUOTED"]

_PAPER = "DCFormer paper (Xiao et al., ICML 2024, arXiv 2405.08553)"
_DEIT = "DeiT paper (Touvron et al., ICML 2021)"
# The paper's rows were measured on the authors' big_vision models (docs/spec.md §4.1), in
# 300-epoch runs; "epoch 90" is the checkpoint at epoch 90 of those runs (at_epoch).
_BV = "big_vision (authors' fork)"
QUOTED: List[Dict[str, Any]] = [
    dict(model="vit_small_patch16_bv_224", label="ViT-S/16", recipe=_BV, epochs=300, at_epoch=300,
         params_quoted="22M", top1=79.8, source=_PAPER),
    dict(model="dcvit_small_patch16_bv_224", label="DCViT-S/16", recipe=_BV, epochs=300, at_epoch=300,
         params_quoted="1.03x", top1=80.1, source=_PAPER),
    dict(model="vit_medium_patch16_bv_224", label="ViT-M/16", recipe=_BV, epochs=300, at_epoch=90,
         params_quoted="1.72x", top1=67.1, source=_PAPER),
    dict(model="dcvit_small_patch16_bv_224", label="DCViT-S/16", recipe=_BV, epochs=300, at_epoch=90,
         params_quoted="1.03x", top1=68.0, source=_PAPER),
    dict(model="vit_tiny_patch16_224", label="DeiT-Ti", recipe="DeiT", epochs=300, at_epoch=300,
         params_quoted="5M", top1=72.2, source=_DEIT),
    dict(model="vit_base_patch16_224", label="DeiT-B", recipe="DeiT", epochs=300, at_epoch=300,
         params_quoted="86M", top1=81.8, source=_DEIT),
]
