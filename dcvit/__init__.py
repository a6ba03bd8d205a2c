"""DCViT: Dynamically Composable Multi-Head Attention for vision transformers.

``import dcvit`` registers the DCViT models with timm::

    import dcvit, timm
    model = timm.create_model("dcvit_small")          # 22,631,272 parameters

The public names are those of the README's table (`__all__`). Importing the package (or any
``dcvit.X``) imports timm, registers the model families' entry points and defines `compose`,
nothing more: the attention layer, its fast cores and kernels load when a model is first
built or a public name below is first used. So ``dcvit.io`` and ``dcvit.schema`` (the files
the trainer writes) cost no model code. Other names live in their modules (``import
dcvit.core``, ``dcvit.models.DCVIT_MODELS``, ...).
"""
import importlib
from typing import TYPE_CHECKING, Any, List

from . import bigvision as _bigvision  # noqa: F401  (registers *_patch16_bv_224 with timm)
from . import models as _models  # noqa: F401  (registers dcvit_* with timm)
from .functional import compose  # the maths (torch only)

__version__ = "0.1.0"

# Public name -> the module that defines it, imported on first use.
_LAZY = {
    "DCMHA": "attention", "DCMHAOptions": "attention",
    "convert": "conversion",
    "load_weights": "weights", "save_weights": "weights",
    "model_args": "hub", "save_pretrained": "hub",
    "attention_maps": "maps",
    "attention_impl": "fused",
}

__all__ = ["compose", "DCMHA", "DCMHAOptions", "convert", "load_weights", "save_weights",
           "model_args", "save_pretrained", "attention_maps", "attention_impl"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (a submodule is reached after "
                         f"`import {__name__}.{name}`; the public names are {__all__})")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:
    from .attention import DCMHA, DCMHAOptions
    from .conversion import convert
    from .fused import attention_impl
    from .hub import model_args
    from .maps import attention_maps
    from .weights import load_weights, save_weights
