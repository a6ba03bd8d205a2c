"""DCViT: timm's VisionTransformer with DCMHA as its attention layer (docs/spec.md §2).

A DCViT is built as timm's ``VisionTransformer`` (or ``model_cls``) and then converted by
`dcvit.conversion` with the paper's initialisation: the same path as ``dcvit.convert``.

``import dcvit`` registers these names with timm's registry::

    dcvit_tiny_patch16_224   (dcvit_tiny)     192 dim, 12 blocks,  3 heads
    dcvit_small_patch16_224  (dcvit_small)    384 dim, 12 blocks,  6 heads
    dcvit_medium_patch16_224 (dcvit_medium)   512 dim, 12 blocks,  8 heads
    dcvit_base_patch16_224   (dcvit_base)     768 dim, 12 blocks, 12 heads

and the ViT-M/16 baseline ``vit_medium_patch16_224`` where timm lacks it. Every DCMHA option
of docs/spec.md §1.3 and ``dcmha_layers`` (indices of the blocks that use DCMHA; default all) are
keyword arguments of ``timm.create_model``.
"""
import functools
import inspect
import sys
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Type

import torch
from torch import nn
from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models import vision_transformer as timm_vit
from timm.models.vision_transformer import VisionTransformer

from .cli import did_you_mean

__all__ = ["SIZES", "DCVIT_MODELS", "checkpoint_filter_fn", "create_vit_family", "register_entry_point"]


def _cfg(**kwargs: Any) -> Dict[str, Any]:
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None,
        "crop_pct": 0.875, "interpolation": "bicubic", "fixed_input_size": True,
        "mean": IMAGENET_INCEPTION_MEAN, "std": IMAGENET_INCEPTION_STD,
        "first_conv": "patch_embed.proj", "classifier": "head", "license": "apache-2.0",
        **kwargs,
    }


# The model sizes of both families (this one and the authors' `dcvit.bigvision`): one row
# each, its hyper-parameters and the name the paper gives it. Adding a size is one row here;
# both families then register it (`_register_sizes` here and in `dcvit.bigvision`). User
# kwargs override.
SIZES: Dict[str, Tuple[Dict[str, Any], str]] = {
    "tiny": (dict(patch_size=16, embed_dim=192, depth=12, num_heads=3), "Ti/16"),
    "small": (dict(patch_size=16, embed_dim=384, depth=12, num_heads=6), "S/16"),
    "medium": (dict(patch_size=16, embed_dim=512, depth=12, num_heads=8), "M/16"),
    "base": (dict(patch_size=16, embed_dim=768, depth=12, num_heads=12), "B/16"),
}

# This family's names and hyper-parameters, from `SIZES`.
DCVIT_MODELS: Dict[str, Dict[str, Any]] = {f"dcvit_{size}_patch16_224": args for size, (args, _) in SIZES.items()}

# No weights are published yet: the cfgs carry preprocessing, and `pretrained_cfg_overlay=
# dict(file=...)` loads a local .safetensors/.pth file.
default_cfgs = generate_default_cfgs({**{name: _cfg() for name in DCVIT_MODELS},
                                      "vit_medium_patch16_224": _cfg()})

# The keyword arguments timm's builder consumes itself (features, pretrained handling).
_BUILDER_KWARGS = set(inspect.signature(build_model_with_cfg).parameters) | {
    "features_only", "feature_cls", "out_indices", "output_fmt", "flatten_sequential",
    "feature_cfg", "pretrained_strict",
}
_VIT_KWARGS = set(inspect.signature(VisionTransformer.__init__).parameters) - {"self", "attn_layer"}


def _check_kwargs(variant: str, kwargs: Dict[str, Any], dc: bool = True,
                  extra: Iterable[str] = ()) -> None:
    from .attention import DCMHA_OPTIONS  # the attention stack loads with the first model built
    dcmha = set(DCMHA_OPTIONS) | {"dcmha_layers"} if dc else set()
    known = _VIT_KWARGS | _BUILDER_KWARGS | dcmha | set(extra)
    for key in kwargs:
        if key not in known:
            where = (f"DCMHA options: {sorted(dcmha)}" if dc else
                     "a baseline has no DCMHA options; use the dcvit_* model")
            raise TypeError(f"{variant}: unknown option {key!r}{did_you_mean(key, known)} ({where})")


def _dcvit(variant: str, dcmha_layers: Optional[Iterable[int]] = None,
           model_cls: Type[VisionTransformer] = VisionTransformer, **kwargs: Any) -> VisionTransformer:
    """``model_cls(**kwargs)`` converted to DCMHA with the paper's initialisation
    (`dcvit.convert`), in the blocks ``dcmha_layers`` (default all)."""
    from .attention import DCMHA_OPTIONS, DCMHAOptions, check_heads
    from .conversion import convert_layers
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in DCMHA_OPTIONS}
    if not options.get("qk_norm_bias", True) and not kwargs.get("qk_norm"):
        options.pop("qk_norm_bias")                      # no q/k norm: nothing to drop a bias from
    options = DCMHAOptions.of(variant, **options)        # checked before the model is built
    check_heads(kwargs.get("embed_dim", 768), kwargs.get("num_heads", 12))
    model = model_cls(**kwargs)
    convert_layers(model, dcmha_layers, "paper", options, variant, "dcmha_layers")
    return model


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: nn.Module, source: str = "checkpoint",
                         **kwargs: Any) -> Dict[str, torch.Tensor]:
    """Adapt a state dict to ``model``: the one adapter every loader runs (timm's ``filter_fn``).

    For a ``VisionTransformer``, timm's ViT conversions run first (pos-embed resizing,
    unwrapping ``model``/``state_dict`` keys). Then `dcvit.conversion.fit_state_dict`: the
    DCMHA tensors a plain model's checkpoint lacks keep their initialisation (docs/spec.md
    §1.2) and are listed in a log message. A tensor whose shape does not fit, or a missing
    tensor that is not DCMHA's, raises ``ValueError``.
    """
    from .conversion import fit_state_dict
    if isinstance(model, VisionTransformer):
        # timm's filter drops ``pre_logits.*`` (old ViT checkpoints); the big_vision body has one.
        pre_logits = {k: v for k, v in state_dict.items() if k.startswith("pre_logits.")} \
            if isinstance(getattr(model, "pre_logits", None), nn.Module) else {}
        state_dict = {**timm_vit.checkpoint_filter_fn(state_dict, model, **kwargs), **pre_logits}
    own = model.state_dict()
    for key, value in state_dict.items():
        if key in own and tuple(value.shape) != tuple(own[key].shape):
            raise ValueError(
                f"checkpoint tensor {key!r} has shape {tuple(value.shape)} but the model expects "
                f"{tuple(own[key].shape)}: the checkpoint is for a model of another size "
                f"(model has {_sizes(model)})")
    state_dict = fit_state_dict(model, state_dict, source)
    missing = [k for k in own if k not in state_dict]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. "
                         f"{missing[:5]}: it is not a checkpoint of this architecture")
    return state_dict


def _sizes(model: nn.Module) -> str:
    blocks = getattr(model, "blocks", None)
    return (f"embed_dim={getattr(model, 'embed_dim', '?')}, depth={len(blocks)}" if blocks is not None
            else type(model).__name__)


def create_vit_family(variant: str, pretrained: bool = False,
                      model_cls: Type[VisionTransformer] = VisionTransformer, dc: bool = True,
                      **kwargs: Any) -> VisionTransformer:
    """Build ``variant`` (a DCViT with DCMHA when ``dc``, else a plain ViT) through timm's builder."""
    extra = set(inspect.signature(model_cls.__init__).parameters) - {"self", "kwargs"}
    _check_kwargs(variant, kwargs, dc, extra)
    out_indices = kwargs.pop("out_indices", 3)
    if dc:
        def build(**kw: Any) -> VisionTransformer:
            return _dcvit(variant, model_cls=model_cls, **kw)
    else:
        build = model_cls
    return build_model_with_cfg(
        build,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs,
    )


def _create_dcvit(variant: str, args: Dict[str, Any], pretrained: bool = False,
                  **kwargs: Any) -> VisionTransformer:
    return create_vit_family(variant, pretrained, **{**args, **kwargs})


def register_entry_point(module: str, name: str, doc: str, build: Callable[..., nn.Module]) -> None:
    """Registers ``name`` with timm as a function of ``module`` (as ``@register_model`` would a
    ``def``): ``build(pretrained, **kwargs)`` makes the model."""
    def entry_point(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        return build(pretrained, **kwargs)
    entry_point.__name__ = entry_point.__qualname__ = name
    entry_point.__module__, entry_point.__doc__ = module, doc
    setattr(sys.modules[module], name, register_model(entry_point))


def _register_sizes() -> None:
    """``dcvit_<size>_patch16_224`` and its alias ``dcvit_<size>`` for every row of `SIZES`."""
    for size, (args, paper) in SIZES.items():
        name = f"dcvit_{size}_patch16_224"
        build = functools.partial(_create_dcvit, name, args)
        register_entry_point(__name__, name, f"DCViT-{paper}: ViT-{paper} with DCMHA.", build)
        register_entry_point(__name__, f"dcvit_{size}", f"Alias of {name}.", build)


_register_sizes()


if "vit_medium_patch16_224" not in timm_vit.__dict__:
    @register_model
    def vit_medium_patch16_224(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
        """ViT-M/16, the paper's baseline between ViT-S and ViT-B (timm has only gap variants)."""
        return timm_vit._create_vision_transformer(
            "vit_medium_patch16_224", pretrained, **{**SIZES["medium"][0], **kwargs})
