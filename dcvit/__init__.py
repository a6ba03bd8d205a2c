"""DCViT: Dynamically Composable Multi-Head Attention for vision transformers.

``import dcvit`` registers the DCViT models with timm::

    import dcvit, timm
    model = timm.create_model("dcvit_small")          # 22,631,272 parameters

Importing the package (or any ``dcvit.X``) imports timm, registers the model families' entry
points and defines `compose`, nothing more: the attention layer, its fast cores and kernels
load when a model is first built or a public name below is first used. So ``dcvit.io`` and
``dcvit.schema`` (the files the trainer writes) cost no model code.
"""
import importlib
from typing import TYPE_CHECKING, Any, List

from . import bigvision as _bigvision  # noqa: F401  (registers *_patch16_bv_224 with timm)
from . import models as _models  # noqa: F401  (registers dcvit_* with timm)
from .bigvision import BV_DCMHA_OPTIONS, BigVisionViT
from .compose import compose  # the maths (torch only); binds dcvit.compose to the function, not the module
from .models import DCVIT_MODELS, checkpoint_filter_fn

__version__ = "0.1.0"

# Public name -> the module that defines it, imported on first use.
_LAZY = {
    "DCMHA": "attention", "DynamicWeights": "attention", "Compose": "attention",
    "DCMHA_OPTIONS": "attention", "dcmha_layer": "attention",
    "attention_maps": "maps",
    "convert": "conversion",
    "save_weights": "weights", "load_weights": "weights", "read_state_dict": "weights",
    "model_args": "hub", "save_pretrained": "hub",
}

__all__ = [
    "compose", "convert", "DCMHA", "DynamicWeights", "Compose", "DCMHA_OPTIONS", "dcmha_layer",
    "DCVIT_MODELS", "checkpoint_filter_fn", "BigVisionViT", "BV_DCMHA_OPTIONS", "attention_maps",
    "save_weights", "load_weights", "read_state_dict", "model_args", "save_pretrained",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    else:  # a submodule not imported yet: dcvit.fused.IMPLS after a bare `import dcvit`
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:
    from .attention import DCMHA, DCMHA_OPTIONS, Compose, DynamicWeights, dcmha_layer
    from .conversion import convert
    from .maps import attention_maps
    from .weights import load_weights, read_state_dict, save_weights
