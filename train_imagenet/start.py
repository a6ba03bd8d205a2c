"""Where training starts: on from a run's checkpoint (``resume``: model, optimizer, scaler,
position and RNG states, its architecture checked) or from weights (``checkpoint=``: a
checkpoint of this package, a ``.safetensors`` or a ``.pth`` state dict).

A checkpoint's position (epoch, batch, update) means something only for the run that saved
it: the batch index counts batches of its data order (the train data, the batch size per
process, the accumulation and the world size) and the update count places it on its
schedule. Every checkpoint records them (`position_of`); a resume that changes them is
refused before anything is loaded, unless ``resume_at_epoch_boundary=true`` asks to continue
from the checkpoint's next epoch boundary with this run's data and schedule. They also record
the settings an epoch's order depends on (`data_order_of`: the seed, the loader workers, the
shuffle buffer, the repeats): changed, they are taken at an epoch boundary, and refused from
a mid-epoch checkpoint (the rest of its epoch would be read in another order) unless the run
continues from the next boundary. A checkpoint of another optimizer (``optim.opt``) is
refused: its state does not load into this run's.

The learning-rate schedule is always this config's, placed at the checkpoint's update (as
timm's train.py does): a resume with another ``epochs`` (or ``sched.*``, ``optim.lr``)
follows the new schedule from there and says so; one whose ``epochs`` end before the
checkpoint's position is refused.
"""
import os
import zipfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from .checkpoint import (CheckpointError, check_arch, load_checkpoint, load_error, load_latest,
                         load_model_weights, seed_all)
from .config import Config, config_to_dict
from .data import is_remote, resolve_source
from .distributed import DistInfo, broadcast_object, log_main, waiting_for
from .engine import EpochTotals
from .finetune import arch_entry
from .logs import RunLog
from .recipe import Recipe

__all__ = ["Start", "arch_of", "position_of", "load_start_weights", "start_training",
           "checkpoint_to_start"]


@dataclass
class Start:
    """Where training continues: after `update` optimizer updates (0 for a fresh run); the
    epoch and its next batch are derived from it (`position_at`). `unlogged` is the record of
    the epoch just before, when its checkpoint holds it but log.jsonl does not (the run
    stopped between the two)."""
    update: int = 0
    updates_per_epoch: int = 1
    accum_steps: int = 1
    rng_state: Optional[Dict[str, Any]] = None   # this rank's RNG states at that point
    resumed_from: str = ""
    state: Optional[Dict[str, Any]] = None       # the checkpoint's content
    totals: Optional[EpochTotals] = None         # the epoch's running sums up to `batch`
    unlogged: Optional[Dict[str, Any]] = None

    def position_at(self, update: int) -> Tuple[int, int, int]:
        """(epoch, update, the epoch's next batch) after `update` updates."""
        epoch = update // self.updates_per_epoch
        return epoch, update, (update - epoch * self.updates_per_epoch) * self.accum_steps

    @property
    def epoch(self) -> int:
        return self.position_at(self.update)[0]

    @property
    def batch(self) -> int:
        return self.position_at(self.update)[2]


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
            "global_batch": cfg.batch_size * cfg.accum_steps * world_size,
            "data_order": data_order_of(cfg, src.kind)}


# The settings an epoch's order depends on besides the position's (a streamed source deals
# its samples to (rank, worker) slots through shuffle buffers, stream.py; a folder's sampler
# draws from the seed), each with the value that means the same order as it (0 workers read
# as one, a buffer of 0 as one of 1).
_ORDER_SETTINGS = {"seed": lambda v: v, "data.num_workers": lambda v: max(v, 1),
                   "data.shuffle_buffer": lambda v: max(v, 1), "aug.repeated_aug": lambda v: v}


def data_order_of(cfg: Config, kind: str) -> Dict[str, Any]:
    """The settings the order of an epoch of `kind` of source depends on, by their keys."""
    now = {"seed": cfg.seed, "data.num_workers": cfg.data.num_workers,
           "data.shuffle_buffer": cfg.data.shuffle_buffer, "aug.repeated_aug": cfg.aug.repeated_aug}
    if kind == "folder":
        del now["data.num_workers"], now["data.shuffle_buffer"]
    return now


def _order_changes(saved: Dict[str, Any], now: Dict[str, Any]) -> List[Tuple[str, Any, Any]]:
    """(key, saved value, this run's) of the data order's settings that changed."""
    return [(key, saved[key], now[key]) for key, same in _ORDER_SETTINGS.items()
            if key in saved and key in now and same(saved[key]) != same(now[key])]


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


def _check_optimizer(state: Dict[str, Any], cfg: Config, path: str) -> None:
    """Refuses a checkpoint of another optimizer (``optim.opt``): its state (another's moments
    and settings) does not load into this run's, which would fail in the first step."""
    saved = ((state.get("config") or {}).get("optim") or {}).get("opt")
    if isinstance(saved, str) and saved.lower() != cfg.optim.opt.lower():
        raise CheckpointError(
            f"resume={path!r} was saved with optim.opt={saved!r}, this run has optim.opt="
            f"{cfg.optim.opt!r}: the optimizer state it holds ({saved}'s) does not load into "
            f"{cfg.optim.opt}; set optim.opt={saved} to continue the run, or start a new run "
            f"from its weights in another output_dir with checkpoint={path}")


def _order_at(state: Dict[str, Any], position: Dict[str, Any], path: str, info: DistInfo,
              at_boundary: bool) -> List[str]:
    """The changed settings of the data order (`data_order_of`) as changes of the position,
    in words, where they matter: a mid-epoch checkpoint's epoch would go on in another order
    (some of its samples trained twice, others never), which is refused unless the run
    continues from the next epoch boundary (`at_boundary`); at an epoch boundary the new
    settings deal the epochs to come, and the log says so. A checkpoint that does not record
    them (an older version's) is not checked."""
    saved = (state.get("position") or {}).get("data_order")
    epoch, batch = state["epoch"], state["batch"]
    if saved is None:
        if batch:
            log_main(info, f"{path} does not record the settings its data order depends on "
                           f"(saved by an older version): they are not checked, and the rest "
                           f"of epoch {epoch} is read in this version's order, which may differ "
                           f"(resume_at_epoch_boundary=true continues from the start of epoch "
                           f"{epoch + 1} instead)")
        return []
    found = _order_changes(saved, position["data_order"])
    said = [f"{key} {old} -> {new}" for key, old, new in found]
    if not found or not batch:
        if found:
            log_main(info, f"{'; '.join(said)} changed at an epoch boundary: epoch {epoch} and "
                           f"those after it are dealt with the new settings")
        return []
    if not at_boundary:
        raise CheckpointError(
            f"resume={path!r} stopped in epoch {epoch}, batch {batch}, and the order the rest "
            f"of that epoch is read in depends on settings this run changed ({'; '.join(said)}): "
            f"some of its samples would be trained twice and others never. Set "
            f"{' '.join(f'{key}={old}' for key, old, _ in found)} to finish the epoch (change "
            f"them at an epoch boundary), or set resume_at_epoch_boundary=true to continue from "
            f"the start of epoch {epoch + 1}")
    return said


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


def checkpoint_to_start(cfg: Config, info: DistInfo) -> Tuple[str, Optional[Dict[str, Any]]]:
    """The checkpoint this run starts from ('' for none) and its content when rank 0 has read
    it: `checkpoint=` for ``--eval-only`` (else the newest in output_dir), the newest that
    verifies for ``resume=auto`` (picked on rank 0, damaged newer ones set aside with a
    warning, and broadcast, so every rank loads the same file even if their views of the disk
    differ), or ``resume=PATH``."""
    if cfg.eval_only and cfg.checkpoint:
        return cfg.checkpoint, None
    if cfg.eval_only or cfg.resume == "auto":
        waiting_for("rank 0's choice of the checkpoint to resume from")
        path, state = load_latest(cfg.output_dir) if info.is_main else (None, None)
        return broadcast_object(path) or "", state
    return cfg.resume, None


def start_training(cfg: Config, model: torch.nn.Module, recipe: Recipe, info: DistInfo,
                   path: str, state: Optional[Dict[str, Any]], position: Dict[str, Any],
                   updates_per_epoch: int) -> Start:
    """Loads `path` (resume; `state` is its content when rank 0 already read it) into the
    model and the recipe, or `checkpoint=` weights into the model; seeds the RNGs of a run
    that does not continue its streams, places the schedule at the start's update and finds
    an epoch saved but not logged. Returns where training starts."""
    start = _load_start(cfg, model, recipe, info, path, state, position, updates_per_epoch)
    if start.rng_state is None:
        seed_all(cfg.seed * 1000 + info.rank + 1 + start.epoch)
    recipe.scheduler.step_update(start.update)
    pending = start.state.get("record") if start.state and start.batch == 0 else None
    if pending is not None and pending.get("epoch") == start.epoch - 1:
        waiting_for("rank 0's reading of log.jsonl")   # the epoch was saved; was it logged?
        logged = RunLog(cfg.output_dir, False).has_epoch(pending["epoch"]) if info.is_main else None
        if not broadcast_object(logged):
            start.unlogged = pending
    return start


def _load_start(cfg: Config, model: torch.nn.Module, recipe: Recipe, info: DistInfo,
                path: str, state: Optional[Dict[str, Any]], position: Dict[str, Any],
                updates_per_epoch: int) -> Start:
    """Loads `path` or the `checkpoint=` weights (see `start_training`).

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
        _check_optimizer(state, cfg, path)
        changes = _position_changes(state["position"], position) if "position" in state else []
        derived = Start(state["update"], updates_per_epoch, cfg.accum_steps)
        if not changes and (derived.epoch, derived.batch) != (state["epoch"], state["batch"]):
            changes.append(f"its update {state['update']} is epoch {derived.epoch}, batch "
                           f"{derived.batch} at {updates_per_epoch} updates per epoch, not epoch "
                           f"{state['epoch']}, batch {state['batch']} (an epoch of that run "
                           f"ended early)")
        changes += _order_at(state, position, path, info,
                             bool(changes) or cfg.resume_at_epoch_boundary)
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
            start = Start(epoch * updates_per_epoch, updates_per_epoch, cfg.accum_steps,
                          resumed_from=path, state=state)
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
        start = Start(state["update"], updates_per_epoch, cfg.accum_steps,
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
    return Start(0, updates_per_epoch, cfg.accum_steps)
