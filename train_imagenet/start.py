"""Where training starts: on from a run's checkpoint (``resume``: model, optimizer, schedule,
scaler, position and RNG states, its architecture checked) or from weights (``checkpoint=``:
a checkpoint of this package, a ``.safetensors`` or a ``.pth`` state dict)."""
import os
import zipfile
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from .checkpoint import CheckpointError, check_arch, load_checkpoint, load_model_weights
from .config import Config
from .distributed import DistInfo, log_main
from .finetune import arch_entry
from .recipe import Recipe

__all__ = ["Start", "arch_of", "load_start_weights", "start_training"]


@dataclass
class Start:
    """The position training continues from (all zero for a fresh run)."""
    epoch: int = 0
    batch: int = 0                               # the next batch of `epoch` to run
    update: int = 0
    rng_state: Optional[Dict[str, Any]] = None   # this rank's RNG states at that point
    resumed_from: str = ""
    state: Optional[Dict[str, Any]] = None       # the checkpoint's content


def arch_of(cfg: Config) -> Dict[str, Any]:
    arch = {"model": cfg.model, "model_kwargs": dict(cfg.model_kwargs),
            "num_classes": cfg.data.num_classes}
    if cfg.convert.enabled:
        arch["convert"] = arch_entry(cfg)
    return arch


def load_start_weights(model: torch.nn.Module, path: str, cfg: Config) -> Optional[Dict[str, Any]]:
    """Loads `checkpoint=PATH` into `model`; returns the checkpoint dict when PATH is one this
    package saved (its architecture is checked, its EMA weights kept), else None.

    Any other file is weights only, read by `dcvit.load_weights`: ``.safetensors`` or ``.pth``
    (``weights_only=True``), a plain ViT state dict adapted to a DCViT (the DCMHA tensors keep
    their initialisation); a checkpoint of another size is a CheckpointError.
    """
    import dcvit
    from timm.models.vision_transformer import VisionTransformer
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint={path!r} does not exist")
    if not path.endswith(".safetensors") and zipfile.is_zipfile(path):  # a torch.save file
        state = load_checkpoint(path)
        if isinstance(state.get("model"), dict) and "arch" in state:
            check_arch(state, arch_of(cfg), path)
            load_model_weights(model, state["model"], path)
            return state
        if not isinstance(model, VisionTransformer):  # dcvit's ViT/DCViT adapter does not apply
            load_model_weights(model, state.get("model", state), path)
            return None
    try:
        dcvit.load_weights(model, path)
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint={path!r} does not fit model={cfg.model!r} with "
                              f"model_kwargs={dict(cfg.model_kwargs)}: {e}") from e
    return None


def start_training(cfg: Config, model: torch.nn.Module, recipe: Recipe, info: DistInfo,
                   path: str, state: Optional[Dict[str, Any]]) -> Start:
    """Loads `path` (resume; `state` is its content when rank 0 already read it) into the
    model and the recipe, or `checkpoint=` weights into the model; returns the position."""
    if path:
        state = state or load_checkpoint(path)
        missing = [k for k in ("model", "optimizer", "scheduler", "epoch", "batch", "update")
                   if k not in state]
        if missing:
            raise CheckpointError(f"resume={path!r} is not a training checkpoint (no "
                                  f"{', '.join(missing)}); to start from its weights set "
                                  f"checkpoint={path} instead")
        check_arch(state, arch_of(cfg), path)
        load_model_weights(model, state["model"], path)
        recipe.optimizer.load_state_dict(state["optimizer"])
        recipe.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            recipe.scaler.load_state_dict(state["scaler"])
        rngs = state.get("rng") or []
        start = Start(state["epoch"], state["batch"], state["update"],
                      rngs[info.rank] if len(rngs) == info.world_size else None, path, state)
        if len(rngs) != info.world_size:
            log_main(info, f"checkpoint has RNG states of {len(rngs)} ranks, this run has "
                           f"{info.world_size}: continuing with fresh RNG streams")
        log_main(info, f"resumed from {path} at epoch {start.epoch}, batch {start.batch}, "
                       f"update {start.update}")
        if cfg.checkpoint and cfg.resume == "auto":
            log_main(info, f"checkpoint={cfg.checkpoint} is not loaded: resume=auto continues "
                           f"this run from its own checkpoint (checkpoint= only starts a fresh run)")
        return start
    if cfg.checkpoint:  # start from weights: a checkpoint's model, a .safetensors, a ViT .pth
        load_start_weights(model, cfg.checkpoint, cfg)
    return Start()
