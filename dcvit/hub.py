"""Sharing a DCViT through timm's Hugging Face Hub format (docs/deploying.md#sharing).

``timm.models.save_for_hf(model, DIR, model_args=...)`` / ``push_to_hf_hub`` write the weights
and a ``config.json`` whose ``model_args`` rebuild the model:
``timm.create_model("local-dir:DIR", pretrained=True)`` or ``"hf-hub:ORG/NAME"``.
`model_args` reads what a DCViT needs there from the model itself: its sizes, the DCMHA
options and which blocks have DCMHA (``dcmha_layers``). (timm >= 1.0.31 also records the
arguments a model was created with; older versions rely on these alone.)
"""
from typing import Any, Dict

from torch import nn

from .attention import DCMHA

__all__ = ["model_args"]


def model_args(model: nn.Module) -> Dict[str, Any]:
    """The keyword arguments of ``timm.create_model`` that rebuild ``model``'s architecture.

    The sizes (``img_size``, ``patch_size``, ``embed_dim``, ``depth``, ``num_heads``), the
    options of its DCMHA layers (they share one set) and ``dcmha_layers``, the indices of the
    blocks that have one. JSON-serialisable, for timm's
    ``save_for_hf(model, DIR, model_args=model_args(model))`` and ``push_to_hf_hub``.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(f"model_args expects a DCViT (a VisionTransformer with .blocks), "
                        f"got {type(model).__name__}")
    layers = {i: b.attn for i, b in enumerate(blocks) if isinstance(getattr(b, "attn", None), DCMHA)}
    options = [layer.options.as_dict() for layer in layers.values()]
    if any(o != options[0] for o in options[1:]):
        raise ValueError("the model's DCMHA layers have different options; timm's create_model "
                         "builds one set for all layers, so this model cannot be rebuilt from model_args")
    embed = model.patch_embed
    sizes = dict(img_size=list(embed.img_size) if embed.img_size is not None else None,
                 patch_size=list(embed.patch_size), embed_dim=model.embed_dim, depth=len(blocks),
                 num_heads=blocks[0].attn.num_heads)
    return {**sizes, **(options[0] if options else {}), "dcmha_layers": sorted(layers)}
