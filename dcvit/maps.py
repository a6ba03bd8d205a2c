"""Looking inside DCMHA: attention scores and weights before and after Compose."""
from typing import Dict, List

import torch
from torch import Tensor, nn

from .fused import attention_impl

__all__ = ["attention_maps"]


@torch.no_grad()
def attention_maps(model: nn.Module, images: Tensor) -> List[Dict[str, object]]:
    """Run ``model`` on ``images`` and return the attention maps of every DCMHA layer.

    One dict per DCMHA layer, in forward order::

        {"name": "blocks.3.attn",
         "scores_before", "scores_after":   (B, H, N, N) pre-softmax scores  (if pre-compose)
         "weights_before", "weights_after": (B, H, N, N) softmax weights     (if post-compose)}

    The maps are read with forward hooks on the layers' ``pre_compose``/``post_compose``
    submodules, so the layers run their ``reference`` attention core (the fast cores never
    materialise these maps); the model runs in eval mode and is left in the mode it was in.
    """
    from .conversion import converted_layers   # DCMHA layers, dcvit's own or converted ones
    layers = [(name, model.get_submodule(name)) for name in converted_layers(model)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no DCMHA layer to read attention maps from")
    records: List[Dict[str, object]] = [{"name": name} for name, _ in layers]
    handles = []

    def recorder(record: Dict[str, object], kind: str):
        def hook(module: nn.Module, args, output: Tensor) -> None:
            record[kind + "_before"] = args[0].detach().float().cpu()
            record[kind + "_after"] = output.detach().float().cpu()
        return hook

    was_training = model.training
    try:
        for record, (_, layer) in zip(records, layers):
            if layer.core.pre_compose is not None:
                handles.append(layer.core.pre_compose.register_forward_hook(recorder(record, "scores")))
            if layer.core.post_compose is not None:
                handles.append(layer.core.post_compose.register_forward_hook(recorder(record, "weights")))
        model.eval()
        with attention_impl("reference"):
            model(images)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return records
