"""Where training starts: on from a run's checkpoint (``resume``: model, optimizer, scaler,
position and RNG states, its architecture checked) or from weights (``checkpoint=``: a
checkpoint of this package, a ``.safetensors`` or a ``.pth`` state dict).

A checkpoint's position (epoch, batch, update) means something only for the run that saved
it: the batch index counts batches of its data order (the train data, the batch size per
process, the accumulation and the world size) and the update count places it on its
schedule. Every checkpoint records them (`position_of`); a resume that changes them is
refused before anything is loaded, unless ``resume_at_epoch_boundary=true`` asks to continue
from the checkpoint's next epoch boundary with this run's data and schedule.

The learning-rate schedule is always this config's, placed at the checkpoint's update (as
timm's train.py does): a resume with another ``epochs`` (or ``sched.*``, ``optim.lr``)
follows the new schedule from there and says so; one whose ``epochs`` end before the
checkpoint's position is refused.
"""
import os
import zipfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from .checkpoint import CheckpointError, check_arch, load_checkpoint, load_error, load_model_weights
from .config import Config, config_to_dict
from .data import is_remote, resolve_source
from .distributed import DistInfo, log_main
from .engine import EpochTotals
from .finetune import arch_entry
from .recipe import Recipe

__all__ = ["Start", "arch_of", "position_of", "load_start_weights", "start_training"]


@dataclass
class Start:
    """The position training continues from (all zero for a fresh run)."""
    epoch: int = 0
    batch: int = 0                               # the next batch of `epoch` to run
    update: int = 0
    rng_state: Optional[Dict[str, Any]] = None   # this rank's RNG states at that point
    resumed_from: str = ""
    state: Optional[Dict[str, Any]] = None       # the checkpoint's content
    totals: Optional[EpochTotals] = None         # the epoch's running sums up to `batch`


def arch_of(cfg: Config) -> Dict[str, Any]:
    arch = {"model": cfg.model, "model_kwargs": dict(cfg.model_kwargs),
            "num_classes": cfg.data.num_classes}
    if cfg.convert.enabled:
        arch["convert"] = arch_entry(cfg)
    return arch


def position_of(cfg: Config, num_samples: int, world_size: int) -> Dict[str, Any]:
    """What a checkpoint's batch index and update count depend on: the train data (its shard
    names and sizes, or an ImageFolder's root, and its sample count), the batch size per
    process, the accumulation and the world size."""
    src = resolve_source(cfg.data.train, "data.train")
    if src.kind == "wds":
        data: Dict[str, Any] = {"shards": [os.path.basename(s) for s in src.shards],
                                "bytes": [None if is_remote(s) else os.path.getsize(s)
                                          for s in src.shards]}
    else:
        data = {"folder": os.path.basename(os.path.normpath(src.root))}
    data["num_samples"] = num_samples
    return {"train_data": data, "batch_size": cfg.batch_size, "accum_steps": cfg.accum_steps,
            "world_size": world_size,
            "global_batch": cfg.batch_size * cfg.accum_steps * world_size}


def _describe_data(d: Dict[str, Any]) -> str:
    if "shards" in d:
        names = d["shards"]
        span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        return f"{len(names)} shards ({span}, {sum(b or 0 for b in d['bytes']):,} bytes), " \
               f"{d['num_samples']} samples"
    return f"ImageFolder {d.get('folder')!r}, {d['num_samples']} samples"


def _position_changes(saved: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """What differs between a checkpoint's position and this run's, in words."""
    changes = []
    a, b = saved.get("train_data"), now["train_data"]
    if a != b:
        if a and b and a.get("shards") == b.get("shards") and "bytes" in a and "bytes" in b:
            odd = [f"{n} {x} -> {y} bytes" for n, x, y in zip(a["shards"], a["bytes"], b["bytes"])
                   if x != y]
            rewritten = f"the shards were rewritten ({', '.join(odd[:3])}" \
                        f"{', ...' if len(odd) > 3 else ''}); " if odd else ""
            changes.append(f"data.train: {rewritten}{a['num_samples']} -> {b['num_samples']} samples")
        else:
            changes.append(f"data.train: {_describe_data(a) if a else '?'} -> {_describe_data(b)}")
    for key, name in (("batch_size", "batch_size (per process)"), ("accum_steps", "accum_steps"),
                      ("world_size", "world size (processes)")):
        if saved.get(key) != now[key]:
            changes.append(f"{name}: {saved.get(key)} -> {now[key]}")
    if saved.get("global_batch") != now["global_batch"]:
        changes.append(f"global batch {saved.get('global_batch')} -> {now['global_batch']}")
    return changes


def _schedule_changes(saved: Optional[Dict[str, Any]], cfg: Config) -> List[str]:
    """The settings of the learning-rate schedule and weight decay (``epochs``, ``optim.lr``,
    ``optim.lr_batch_size``, the weight decays, ``sched.*``) that differ from those of the
    checkpoint's config `saved`, in words."""
    if not saved:
        return []
    now = config_to_dict(cfg)
    pairs = [("epochs", saved.get("epochs"), now["epochs"])]
    pairs += [(f"optim.{k}", saved.get("optim", {}).get(k), now["optim"][k])
              for k in ("lr", "lr_batch_size", "weight_decay", "decoupled_weight_decay")]
    pairs += [(f"sched.{k}", v, now["sched"][k]) for k, v in saved.get("sched", {}).items()
              if k in now["sched"]]
    return [f"{key} {old!r} -> {new!r}" for key, old, new in pairs
            if old is not None and old != new]


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
    except Exception as e:
        if not _is_fit_error(e):
            raise load_error(path, e, "checkpoint=") from e
        raise CheckpointError(f"checkpoint={path!r} does not fit model={cfg.model!r} with "
                              f"model_kwargs={dict(cfg.model_kwargs)}: {e}") from e
    return None


def _is_fit_error(e: Exception) -> bool:
    """A file that was read but does not fit the model (dcvit raises ValueError/RuntimeError
    naming the tensors), as opposed to a file that cannot be read at all."""
    import pickle
    from safetensors import SafetensorError
    return isinstance(e, (ValueError, RuntimeError)) and not isinstance(
        e, (pickle.UnpicklingError, SafetensorError)) and "PytorchStreamReader" not in str(e)


def start_training(cfg: Config, model: torch.nn.Module, recipe: Recipe, info: DistInfo,
                   path: str, state: Optional[Dict[str, Any]], position: Dict[str, Any],
                   updates_per_epoch: int) -> Start:
    """Loads `path` (resume; `state` is its content when rank 0 already read it) into the
    model and the recipe, or `checkpoint=` weights into the model; returns the position.

    A checkpoint saved with another `position` (`position_of`) is refused, or with
    ``resume_at_epoch_boundary`` continued from its next epoch boundary: the update count is
    that epoch's on this run's schedule (`updates_per_epoch`), the RNG streams fresh."""
    if path:
        state = state or load_checkpoint(path)
        missing = [k for k in ("model", "optimizer", "epoch", "batch", "update")
                   if k not in state]
        if missing:
            raise CheckpointError(f"resume={path!r} is not a training checkpoint (no "
                                  f"{', '.join(missing)}); to start from its weights set "
                                  f"checkpoint={path} instead")
        check_arch(state, arch_of(cfg), path)
        changes = _position_changes(state["position"], position) if "position" in state else []
        if changes and not cfg.resume_at_epoch_boundary:
            raise CheckpointError(
                f"resume={path!r} is a checkpoint of another run: its position (epoch "
                f"{state['epoch']}, batch {state['batch']}, update {state['update']}) counts "
                f"batches and updates of other data or batches; changed: {'; '.join(changes)}. "
                f"Restore the run's settings to continue it, start a new run in another "
                f"output_dir, or set resume_at_epoch_boundary=true to continue from its weights "
                f"at the next epoch boundary with this run's data and schedule")
        if "position" not in state:
            log_main(info, f"{path} does not record its data and batch size (saved by an older "
                           f"version): they are not checked")
        epoch = state["epoch"] + (1 if changes and state["batch"] else 0)   # where it starts
        needed = epoch + (1 if state["batch"] else 0)   # a mid-epoch start needs that epoch
        if cfg.epochs < needed:
            where = (f"continues at the start of epoch {epoch}" if epoch != state["epoch"]
                     else f"is at epoch {epoch}, batch {state['batch']}")
            raise CheckpointError(
                f"resume={path!r} {where}: this run's epochs={cfg.epochs} leave nothing to train; "
                f"set epochs={needed} or more to continue it (or evaluate it with --eval-only "
                f"checkpoint={path})")
        load_model_weights(model, state["model"], path)
        decay = [group.get("weight_decay") for group in recipe.optimizer.param_groups]
        recipe.optimizer.load_state_dict(state["optimizer"])
        for group, wd in zip(recipe.optimizer.param_groups, decay):   # the config's, like the lr
            if wd is not None:
                group["weight_decay"] = wd
        if state.get("scaler") and recipe.scaler is not None:
            recipe.scaler.load_state_dict(state["scaler"])
        if changes:   # resume_at_epoch_boundary: this run's schedule, from the next boundary
            start = Start(epoch, 0, epoch * updates_per_epoch, None, path, state)
            log_main(info, f"resume_at_epoch_boundary=true: {path} was saved with other "
                           f"settings ({'; '.join(changes)}); continuing from the start of "
                           f"epoch {epoch} (update {start.update} of this run's schedule) with "
                           f"its weights and optimizer state and fresh RNG streams"
                           + (f"; the rest of epoch {state['epoch']} is skipped"
                              if state["batch"] else ""))
            return start
        schedule = _schedule_changes(state.get("config"), cfg)
        if schedule:
            saved_lr = recipe.optimizer.param_groups[0]["lr"]
            recipe.scheduler.step_update(state["update"])   # for the log (the trainer places it too)
            log_main(info, f"{path} was saved with another learning-rate schedule or weight decay "
                           f"({'; '.join(schedule)}): continuing on this config's schedule from "
                           f"update {state['update']}, where the learning rate is "
                           f"{recipe.optimizer.param_groups[0]['lr']:.3g} "
                           f"(it was {saved_lr:.3g} at the save)")
        rngs = state.get("rng") or []
        totals = state.get("totals")
        start = Start(state["epoch"], state["batch"], state["update"],
                      rngs[info.rank] if len(rngs) == info.world_size else None, path, state,
                      EpochTotals.from_saved(totals, info.rank) if totals else None)
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
