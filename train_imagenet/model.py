"""The model a config describes: ``timm.create_model`` with its kwargs, checked against the data."""
from typing import List, Tuple

import timm
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
import torch

import dcvit  # noqa: F401  (registers dcvit_* with timm)
from dcvit.cli import did_you_mean

from .config import Config, ConfigError
from .finetune import apply_conversion, pretrained_kwargs

__all__ = ["build_model", "input_norm"]


def build_model(cfg: Config, pretrained: bool = True) -> torch.nn.Module:
    """timm.create_model with the config's kwargs and ``data.num_classes``, checked against
    ``data.img_size``; a bad name or option is a ConfigError naming the fix. With
    ``pretrained`` it loads ``cfg.pretrained`` (if set) and converts to DCMHA
    (``cfg.convert.enabled``) in that order."""
    kwargs = dict(cfg.model_kwargs)
    if kwargs.pop("num_classes", cfg.data.num_classes) != cfg.data.num_classes:
        raise ConfigError(f"model_kwargs.num_classes={cfg.model_kwargs['num_classes']} differs "
                          f"from data.num_classes={cfg.data.num_classes}; drop it from model_kwargs")
    if not timm.is_model(cfg.model):
        raise ConfigError(f"model={cfg.model!r} is not a timm model"
                          f"{did_you_mean(cfg.model, timm.list_models())}")
    load = pretrained_kwargs(cfg) if pretrained and cfg.pretrained else {}
    try:
        model = timm.create_model(cfg.model, num_classes=cfg.data.num_classes,
                                  drop_path_rate=cfg.drop_path, **kwargs, **load)
    except TypeError as e:
        raise ConfigError(f"model={cfg.model!r} rejects model_kwargs={cfg.model_kwargs}: {e}") from e
    except (RuntimeError, NotImplementedError, ValueError) as e:
        if not load and isinstance(e, ValueError):  # e.g. a DCMHA option out of range
            raise ConfigError(f"model={cfg.model!r} rejects model_kwargs={cfg.model_kwargs}: {e}") from e
        if not load:
            raise
        raise ConfigError(f"pretrained={cfg.pretrained!r} does not load into model={cfg.model!r} with "
                          f"model_kwargs={cfg.model_kwargs}: {e}") from e
    if load:
        getattr(model, "pretrained_cfg", {}).pop("state_dict", None)   # hold no second copy
    embed = getattr(model, "patch_embed", None)
    size = getattr(embed, "img_size", None)
    if size is not None and tuple(size) != (cfg.data.img_size, cfg.data.img_size) \
            and not getattr(embed, "dynamic_img_size", False):
        raise ConfigError(f"model {cfg.model!r} is built for {tuple(size)} images but "
                          f"data.img_size={cfg.data.img_size}; set model_kwargs.img_size="
                          f"{cfg.data.img_size} (or data.img_size={size[0]})")
    patch = getattr(embed, "patch_size", None)
    if patch is not None and any(cfg.data.img_size % p for p in patch) \
            and not getattr(embed, "dynamic_img_pad", False):
        p = patch[0]
        lower, upper = cfg.data.img_size // p * p, -(-cfg.data.img_size // p) * p
        raise ConfigError(f"data.img_size={cfg.data.img_size} is not a multiple of the patch size "
                          f"{p}: the patch embedding would drop the image's last "
                          f"{cfg.data.img_size % p} rows and columns; set data.img_size and "
                          f"model_kwargs.img_size to {lower or upper} or {upper}")
    if cfg.convert.enabled:
        apply_conversion(model, cfg)
    return model


def input_norm(cfg: Config, model: torch.nn.Module) -> Tuple[List[float], List[float]]:
    """(mean, std) of the input normalisation: ``data.mean``/``data.std`` where set, else the
    model's pretrained config (timm's ImageNet values when it has none). The config itself is
    left as given."""
    pcfg = getattr(model, "pretrained_cfg", {}) or {}
    mean = cfg.data.mean or pcfg.get("mean", IMAGENET_DEFAULT_MEAN)
    std = cfg.data.std or pcfg.get("std", IMAGENET_DEFAULT_STD)
    return list(mean), list(std)
