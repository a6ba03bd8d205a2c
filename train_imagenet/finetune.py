"""Fine-tuning a pretrained model with DCMHA: pretrained weights, conversion, parameter groups.

The order in `run`: build ``model`` (with ``pretrained=FILE`` read by timm's own loader) ->
``dcvit.convert`` it (``convert.enabled``) -> load ``checkpoint``/``resume`` -> train. A
checkpoint records the conversion in its ``arch``, so evaluating or resuming a converted run
converts the model again without the user restating the options (`conversion_to_apply`).
"""
import logging
import os
from typing import Any, Dict, List, Optional

import torch

from .checkpoint import CheckpointError
from .config import Config, ConfigError

__all__ = ["arch_entry", "conversion_to_apply", "apply_conversion", "pretrained_kwargs",
           "param_group_fn", "saved_arch"]

_logger = logging.getLogger(__name__)


def arch_entry(cfg: Config) -> Optional[Dict[str, Any]]:
    """What a checkpoint's ``arch`` records of the conversion (None: not converted)."""
    if not cfg.convert.enabled:
        return None
    return {"layers": cfg.convert.layers, "options": dict(cfg.convert.options)}


def saved_arch(path: str) -> Optional[Dict[str, Any]]:
    """The ``arch`` of a checkpoint this package saved (tensors memory-mapped, not read);
    None for any other file (its errors are reported where it is loaded)."""
    if not path or path.endswith(".safetensors") or not os.path.isfile(path):
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    arch = state.get("arch") if isinstance(state, dict) else None
    return arch if isinstance(arch, dict) else None


def conversion_to_apply(cfg: Config, checkpoint: Optional[str], log) -> None:
    """Sets ``cfg.convert`` from the checkpoint that this run loads, when it was converted.

    A converted checkpoint into a run without ``convert.enabled``: the run converts with the
    checkpoint's layers/options (logged). With other options: CheckpointError. A checkpoint
    of the unconverted model into a converted run is fine (see `dcvit.conversion.fit_state_dict`).
    """
    arch = saved_arch(checkpoint) if checkpoint else None
    saved = arch.get("convert") if arch else None
    if not saved:
        return
    if not cfg.convert.enabled:
        cfg.convert.enabled = True
        cfg.convert.layers = saved.get("layers")
        cfg.convert.options = dict(saved.get("options") or {})
        log(f"{checkpoint} is of a model converted to DCMHA: converting with layers="
            f"{cfg.convert.layers} options={cfg.convert.options}")
        return
    mine = arch_entry(cfg)
    if mine != saved:
        raise CheckpointError(f"checkpoint {checkpoint!r} was converted with {saved}, this run converts with "
                              f"{mine}; drop the convert.* settings (the checkpoint's are used) or set the same")


def apply_conversion(model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    """``dcvit.convert`` with the config's settings; a bad option is a ConfigError."""
    import dcvit
    c = cfg.convert
    try:
        return dcvit.convert(model, layers=c.layers, init=c.init, **c.options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"convert.* with model={cfg.model!r}: {e}") from e


def pretrained_kwargs(cfg: Config) -> Dict[str, Any]:
    """``timm.create_model`` kwargs that load ``cfg.pretrained`` through timm's own loader
    (the model's checkpoint filter: position-embedding resizing, key conversions, ...).

    ``.npz``/``.npy`` go to the model's ``load_pretrained`` (big_vision files for timm's ViTs).
    Other files are read once here: a classifier that fits ``data.num_classes`` is kept, one
    that does not is left at its initialisation (logged). A plain ViT's file loads into a
    ``dcvit_*`` model as ``checkpoint=`` does (the DCMHA tensors keep their initialisation,
    `dcvit.models.checkpoint_filter_fn`); a file with DCMHA tensors loads into a model that
    has them, and is a ConfigError for a plain one (it loads after conversion: ``checkpoint=``).
    """
    import timm
    from timm.models import load_state_dict
    from dcvit.conversion import is_dcmha_key
    path = cfg.pretrained
    if not os.path.isfile(path):
        raise ConfigError(f"pretrained={path!r} does not exist (a local .safetensors, .pth or .npz file)")
    if path.lower().endswith((".npz", ".npy")):
        return {"pretrained": True, "pretrained_cfg_overlay": {"file": path, "custom_load": True}}
    try:
        state = load_state_dict(path)
    except Exception as e:
        raise ConfigError(f"pretrained={path!r} cannot be read ({type(e).__name__}: {e})") from e
    dc = [k for k in state if is_dcmha_key(k)]
    if dc and not _has_dcmha(cfg, dc[0]):
        raise ConfigError(f"pretrained={path!r} is a model converted to DCMHA ({len(dc)} DCMHA tensors, e.g. "
                          f"{dc[0]!r}); pretrained= is read before conversion: load it with "
                          f"checkpoint={path} and convert.enabled=true with the options it was converted with")
    overlay: Dict[str, Any] = {"state_dict": state}
    classifier = _classifier(cfg)
    for name in ([classifier] if isinstance(classifier, str) else classifier or []):
        weight = state.get(f"{name}.weight")
        if weight is not None:
            overlay["num_classes"] = int(weight.shape[0])
            if weight.shape[0] != cfg.data.num_classes:
                _logger.warning("pretrained=%s has a %d-class %s; data.num_classes=%d: it starts from "
                                "its initialisation", path, weight.shape[0], name, cfg.data.num_classes)
    return {"pretrained": True, "pretrained_cfg_overlay": overlay}


def _classifier(cfg: Config) -> Any:
    """The classifier's module name(s) in the pretrained cfg of ``cfg.model``; for a name with
    no cfg of its own (``dcvit_tiny``, an alias of ``dcvit_tiny_patch16_224``), the cfg its
    builder resolves (read from `_meta_model`)."""
    import timm
    from timm.models import get_pretrained_cfg
    if not timm.is_model(cfg.model):
        return None                   # build_model names the bad model
    pcfg = get_pretrained_cfg(cfg.model, allow_unregistered=True)
    if pcfg is not None:
        return pcfg.classifier
    model = _meta_model(cfg)
    return (getattr(model, "pretrained_cfg", None) or {}).get("classifier") if model is not None else None


def _has_dcmha(cfg: Config, key: str) -> bool:
    """Whether ``cfg.model`` itself has the DCMHA tensor ``key`` (a ``dcvit_*`` model)."""
    model = _meta_model(cfg)
    return model is not None and key in model.state_dict()


def _meta_model(cfg: Config) -> Optional[torch.nn.Module]:
    """``cfg.model`` built on the meta device (no memory, no initialisation); None if it does
    not build (build_model reports why)."""
    import timm
    kwargs = {k: v for k, v in cfg.model_kwargs.items() if k != "num_classes"}
    try:
        with torch.device("meta"):
            return timm.create_model(cfg.model, num_classes=cfg.data.num_classes, **kwargs)
    except Exception:
        return None


def param_group_fn(cfg: Config, weight_decay: float):
    """A ``param_group_fn`` for ``timm.optim.create_optimizer_v2``: timm's weight-decay groups
    for the pretrained parameters and one group for the DCMHA parameters, with
    ``lr_scale=convert.lr_mult`` (timm's schedulers multiply the group's lr by it) and
    ``convert.weight_decay`` (null: ``optim.weight_decay``)."""
    from timm.optim import param_groups_weight_decay
    from dcvit.conversion import dcmha_parameters

    def groups(model: torch.nn.Module) -> List[Dict[str, Any]]:
        no_wd = getattr(model, "no_weight_decay", lambda: set())()
        new = [p for _, p in dcmha_parameters(model) if p.requires_grad]
        ids = {id(p) for p in new}
        out = []
        for g in param_groups_weight_decay(model, weight_decay, no_weight_decay_list=no_wd):
            kept = [p for p in g["params"] if id(p) not in ids]
            if kept:
                out.append({**g, "params": kept})
        wd = weight_decay if cfg.convert.weight_decay is None else cfg.convert.weight_decay
        if new:
            out.append({"params": new, "weight_decay": wd, "lr_scale": cfg.convert.lr_mult})
        return out
    return groups
