"""DCViT: Dynamically Composable Multi-Head Attention for vision transformers.

``import dcvit`` registers the DCViT models with timm::

    import dcvit, timm
    model = timm.create_model("dcvit_small")          # 22,631,272 parameters
"""
from .attention import DCMHA, DCMHA_OPTIONS, Compose, DynamicWeights, dcmha_layer
from .compose import compose
from .conversion import convert
from .maps import attention_maps
from .models import DCVIT_MODELS, checkpoint_filter_fn
from .bigvision import BV_DCMHA_OPTIONS, BigVisionViT
from .weights import load_weights, read_state_dict, save_weights

__version__ = "0.1.0"

__all__ = [
    "compose", "convert", "DCMHA", "DynamicWeights", "Compose", "DCMHA_OPTIONS", "dcmha_layer",
    "DCVIT_MODELS", "checkpoint_filter_fn", "BigVisionViT", "BV_DCMHA_OPTIONS", "attention_maps",
    "save_weights", "load_weights", "read_state_dict",
]
