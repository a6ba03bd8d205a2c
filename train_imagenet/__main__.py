"""Train or evaluate an image classifier on ImageNet-style data, under torchrun or alone.

    python -m train_imagenet --config configs/quickstart.yaml [key=value ...]
    torchrun --nproc_per_node=8 -m train_imagenet --config configs/deit300_dcvit_small.yaml
    python -m train_imagenet --config ... --eval-only checkpoint=runs/x/ckpt-e0300-u00375300.pth

The wiring only: config -> model -> data -> engine -> checkpoints/logs. Every check that can
fail (optimizer/scheduler names, the output directory and its lock, data paths, shards and
labels of both splits, checkpoint checksum and architecture) runs before training starts,
and the run's config.yaml is written only once they all passed.
"""
import argparse
import difflib
import importlib.util
import os
import sys
import zipfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from dcvit.io import write_json
from dcvit.schema import EvalResult

from .checkpoint import (CheckpointError, capture_rng, check_arch, load_checkpoint, load_latest,
                         load_model_weights, save_checkpoint)
from .config import Config, ConfigError, config_to_dict, load_config, save_config
from .data import DataError, DataPipe, is_remote, build_data, count_samples, resolve_source
from .distributed import DistInfo, all_gather_object, broadcast_object, init_distributed, shutdown
from .engine import (LossScaler, NonFiniteLoss, StepOptions, evaluate, peak_memory_mb,
                     train_one_epoch)
from .finetune import arch_entry, conversion_to_apply, param_group_fn
from .logs import RunLog
from .mixup import RollMixup
from .model import build_model
from .run_lock import RunDirError, RunLock, prepare_run_dir

__all__ = ["main", "run"]

CRASH_EXIT_CODE = 17


def _log(info: DistInfo, msg: str) -> None:
    if info.is_main:
        print(f"[train_imagenet] {msg}", file=sys.stderr, flush=True)


def _seed_all(seed: int) -> None:
    import random
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _arch(cfg: Config) -> Dict[str, Any]:
    arch = {"model": cfg.model, "model_kwargs": dict(cfg.model_kwargs),
            "num_classes": cfg.data.num_classes}
    if cfg.convert.enabled:
        arch["convert"] = arch_entry(cfg)
    return arch


def _on_main(info: DistInfo, fn: Callable[[], Any], error: Callable[[Exception], Exception]) -> Any:
    """`fn()` on rank 0, its result broadcast to every rank; an exception there is broadcast
    too (a user error as itself, anything else through `error`), so every rank raises it
    instead of waiting forever in the next collective."""
    result: Any = None
    if info.is_main:
        try:
            result = fn()
        except (ConfigError, DataError, CheckpointError, RunDirError) as e:
            result = e
        except Exception as e:  # e.g. FileNotFoundError from ImageFolder: every rank must hear
            result = error(e)
    result = broadcast_object(result)
    if isinstance(result, Exception):
        raise result
    return result


def _counts(cfg: Config, split: str, info: DistInfo) -> Dict[str, int]:
    """Sample/class counts of a split, found (and its shards checked) once on rank 0 and
    shared with every rank."""
    def count() -> Dict[str, int]:
        given = getattr(cfg.data, f"{split}_samples")
        src = resolve_source(getattr(cfg.data, split), f"data.{split}")
        if given and src.kind == "wds" and any(is_remote(s) for s in src.shards):
            return {"num_samples": given, "num_classes": 0}   # remote: nothing to check
        result = count_samples(src, f"data.{split}", cfg.data.num_classes, cfg.output_dir)
        if given:
            result["num_samples"] = given
        return result
    return _on_main(info, count, lambda e: DataError(
        f"data.{split}={getattr(cfg.data, split)!r} cannot be read ({type(e).__name__}: {e})"))


def _latest_checkpoint(run_dir: str, info: DistInfo) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """The newest checkpoint in `run_dir` that verifies, picked on rank 0 (damaged newer ones
    are set aside with a warning) and broadcast, so every rank loads the same file even if
    their views of the disk differ; (path, its content) on rank 0, (path, None) elsewhere."""
    path, state = load_latest(run_dir) if info.is_main else (None, None)
    return broadcast_object(path), state


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
            check_arch(state, _arch(cfg), path)
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


def _result(cfg: Config, metrics: Dict[str, float], checkpoint: str, ema: bool,
            epoch: Optional[int] = None) -> Dict[str, Any]:
    """The ``eval.json`` object (`dcvit.schema.EvalResult`, read by ``dcvit-report``); ``epoch``
    for the evaluations of ``eval_epochs`` (``eval-eNNNN.json``)."""
    return EvalResult(model=cfg.model, top1=metrics["top1"], top5=metrics["top5"],
                      num_samples=metrics["num_samples"], loss=metrics["loss"],
                      model_kwargs=dict(cfg.model_kwargs), img_size=cfg.data.img_size,
                      num_classes=cfg.data.num_classes, checkpoint=checkpoint, ema=ema,
                      val=cfg.data.val, convert=arch_entry(cfg), epoch=epoch).to_dict()


def check_recipe(cfg: Config) -> None:
    """Fails on what only timm knows: an unknown optimizer or scheduler name (made on a dummy
    parameter, so before any data is read)."""
    from timm.optim import create_optimizer_v2, list_optimizers
    from timm.scheduler import create_scheduler_v2
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("tensorboard=true needs the tensorboard package: "
                          "pip install 'dcvit[tensorboard]' (or set tensorboard=false)")
    dummy = torch.nn.Linear(1, 1)
    try:
        optimizer = create_optimizer_v2(dummy, opt=cfg.optim.opt, lr=cfg.optim.lr)
    except (ValueError, ImportError) as e:
        close = difflib.get_close_matches(cfg.optim.opt.lower(), list_optimizers(), n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(f"optim.opt={cfg.optim.opt!r} is not a timm optimizer ({e}){hint}") from e
    try:
        create_scheduler_v2(optimizer, sched=cfg.sched.sched, num_epochs=cfg.epochs,
                            step_on_epochs=False, updates_per_epoch=1)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"sched.sched={cfg.sched.sched!r} is not a timm scheduler ({e}); use "
                          f"one of cosine, tanh, step, multistep, plateau, poly") from e


def run(cfg: Config) -> int:
    check_recipe(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible to this process "
                          "(torch.cuda.is_available() is False); use device=cpu or device=auto")
    info = init_distributed(cfg.device)
    device = info.device
    if cfg.amp == "fp16" and device.type != "cuda":
        raise ConfigError("amp=fp16 needs a CUDA device (it uses a GradScaler); use amp=bf16 on CPU")
    held: List[RunLock] = []                    # rank 0's lock stays in its process
    _on_main(info, lambda: held.append(prepare_run_dir(cfg.output_dir)), lambda e: RunDirError(
        f"output_dir={cfg.output_dir!r} cannot be used ({type(e).__name__}: {e})"))
    try:
        # The checkpoint this run loads (picked once; a damaged newest one is set aside) decides
        # whether it converts (a converted run's checkpoint converts again) and whether the
        # pretrained file is read (not when resuming/evaluating).
        if cfg.eval_only:
            start, state = (cfg.checkpoint, None) if cfg.checkpoint else \
                _latest_checkpoint(cfg.output_dir, info)
        elif cfg.resume == "auto":
            start, state = _latest_checkpoint(cfg.output_dir, info)
        else:
            start, state = cfg.resume, None
        resuming = cfg.eval_only or bool(start)
        conversion_to_apply(cfg, start or cfg.checkpoint, lambda msg: _log(info, msg))
        _seed_all(cfg.seed)  # the same initial weights on every rank and world size
        model = build_model(cfg, pretrained=not resuming)
        if cfg.data.mean is None or cfg.data.std is None:
            pcfg = getattr(model, "pretrained_cfg", {}) or {}
            cfg.data.mean = list(cfg.data.mean or pcfg.get("mean", (0.485, 0.456, 0.406)))
            cfg.data.std = list(cfg.data.std or pcfg.get("std", (0.229, 0.224, 0.225)))
        val = build_data(cfg, "val", info.rank, info.world_size, _counts(cfg, "val", info))
        train = None if cfg.eval_only else build_data(cfg, "train", info.rank, info.world_size,
                                                      _counts(cfg, "train", info))
        model.to(device)
        if cfg.eval_only:
            return _evaluate_checkpoint(cfg, model, val, info, start)
        return _train(cfg, model, train, val, info, start, state)
    finally:
        for lock in held:
            lock.release()


def _write_config(cfg: Config, info: DistInfo) -> None:
    """The resolved config, written once every check has passed (a refused command leaves
    the run directory's config as it was)."""
    if info.is_main:
        save_config(cfg, os.path.join(cfg.output_dir, "eval_config.yaml" if cfg.eval_only
                                      else "config.yaml"))


def _evaluate_checkpoint(cfg: Config, model: torch.nn.Module, val: DataPipe, info: DistInfo,
                         path: Optional[str]) -> int:
    if not path:
        raise CheckpointError(f"eval_only needs checkpoint=PATH (no checkpoint in {cfg.output_dir!r})")
    state = load_start_weights(model, path, cfg) or {}
    _write_config(cfg, info)
    metrics = evaluate(model, val, cfg.data.num_classes, info.device, cfg.amp)
    if info.is_main:
        write_json(os.path.join(cfg.output_dir, "eval.json"), _result(cfg, metrics, path, False))
    _log(info, f"{path}: top1 {metrics['top1']:.2f} top5 {metrics['top5']:.2f} "
               f"on {metrics['num_samples']} samples")
    if state.get("ema") is not None:
        load_model_weights(model, state["ema"], path, what="EMA")
        metrics = evaluate(model, val, cfg.data.num_classes, info.device, cfg.amp)
        if info.is_main:
            write_json(os.path.join(cfg.output_dir, "eval_ema.json"), _result(cfg, metrics, path, True))
        _log(info, f"EMA: top1 {metrics['top1']:.2f} top5 {metrics['top5']:.2f}")
    return 0


def _train(cfg: Config, model: torch.nn.Module, train: DataPipe, val: DataPipe,
           info: DistInfo, path: str, state: Optional[Dict[str, Any]]) -> int:
    """Trains from scratch, from `checkpoint=` weights, or on from `path` (`resume`), whose
    content `state` rank 0 may already have loaded."""
    from timm.data import Mixup
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    from timm.utils import ModelEmaV3

    device, run_dir = info.device, cfg.output_dir
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    global_batch = cfg.batch_size * cfg.accum_steps * info.world_size
    lr = cfg.optim.lr * (global_batch / cfg.optim.lr_batch_size if cfg.optim.lr_batch_size else 1.0)
    opt_kwargs: Dict[str, Any] = {}
    if cfg.optim.betas:
        opt_kwargs["betas"] = tuple(cfg.optim.betas)
    if cfg.optim.eps:
        opt_kwargs["eps"] = cfg.optim.eps
    weight_decay = cfg.optim.weight_decay
    if cfg.optim.decoupled_weight_decay is not None:   # AdamW decays by lr_t·wd: wd = wd_abs / lr
        weight_decay = cfg.optim.decoupled_weight_decay / lr
    if cfg.convert.enabled:  # the DCMHA parameters: their own lr multiplier and weight decay
        opt_kwargs["param_group_fn"] = param_group_fn(cfg, weight_decay)
    optimizer = create_optimizer_v2(model, opt=cfg.optim.opt, lr=lr, weight_decay=weight_decay,
                                    momentum=cfg.optim.momentum, **opt_kwargs)
    updates_per_epoch = train.batches_per_epoch // cfg.accum_steps
    warmup_epochs = cfg.sched.warmup_epochs
    if cfg.sched.warmup_steps is not None:             # timm counts warm-up in epochs
        warmup_epochs = cfg.sched.warmup_steps / max(updates_per_epoch, 1)
    scheduler, _ = create_scheduler_v2(optimizer, sched=cfg.sched.sched, num_epochs=cfg.epochs,
                                       warmup_epochs=warmup_epochs,
                                       warmup_prefix=cfg.sched.warmup_prefix,
                                       warmup_lr=cfg.sched.warmup_lr, min_lr=cfg.sched.min_lr,
                                       cooldown_epochs=cfg.sched.cooldown_epochs,
                                       step_on_epochs=False, updates_per_epoch=updates_per_epoch)
    scaler = LossScaler(enabled=cfg.amp == "fp16")     # disabled: a plain backward and step
    a = cfg.aug
    mixup = None
    if a.mixup > 0 or a.cutmix > 0:
        mixup = Mixup(mixup_alpha=a.mixup, cutmix_alpha=a.cutmix, prob=a.mixup_prob,
                      switch_prob=a.mixup_switch_prob, mode=a.mixup_mode,
                      label_smoothing=a.smoothing, num_classes=cfg.data.num_classes)
        loss_fn = SoftTargetCrossEntropy()
    elif a.bv_mixup > 0:
        mixup = RollMixup(a.bv_mixup, cfg.data.num_classes, a.smoothing)
        loss_fn = SoftTargetCrossEntropy()
    elif a.smoothing > 0:
        loss_fn = LabelSmoothingCrossEntropy(a.smoothing)
    else:
        loss_fn = torch.nn.CrossEntropyLoss()

    # resume (or start from weights) before anything trains
    epoch, start_batch, update, rng_state, resumed_from = 0, 0, 0, None, ""
    if path:
        state = state or load_checkpoint(path)
        missing = [k for k in ("model", "optimizer", "scheduler", "epoch", "batch", "update")
                   if k not in state]
        if missing:
            raise CheckpointError(f"resume={path!r} is not a training checkpoint (no "
                                  f"{', '.join(missing)}); to start from its weights set "
                                  f"checkpoint={path} instead")
        check_arch(state, _arch(cfg), path)
        load_model_weights(model, state["model"], path)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        epoch, start_batch, update = state["epoch"], state["batch"], state["update"]
        rngs = state.get("rng") or []
        if len(rngs) == info.world_size:
            rng_state = rngs[info.rank]
        else:
            _log(info, f"checkpoint has RNG states of {len(rngs)} ranks, this run has "
                       f"{info.world_size}: continuing with fresh RNG streams")
        resumed_from = path
        _log(info, f"resumed from {path} at epoch {epoch}, batch {start_batch}, update {update}")
        if cfg.checkpoint and cfg.resume == "auto":
            _log(info, f"checkpoint={cfg.checkpoint} is not loaded: resume=auto continues this "
                       f"run from its own checkpoint (checkpoint= only starts a fresh run)")
    elif cfg.checkpoint:  # start from weights: a checkpoint's model, a .safetensors, a ViT .pth
        load_start_weights(model, cfg.checkpoint, cfg)
    ema = None  # made after loading, so it starts from the loaded weights
    if cfg.ema.enabled:
        ema = ModelEmaV3(model, decay=cfg.ema.decay, use_warmup=cfg.ema.warmup)
        if resumed_from and state.get("ema") is not None:
            load_model_weights(ema.module, state["ema"], resumed_from, what="EMA")
    if rng_state is None:
        _seed_all(cfg.seed * 1000 + info.rank + 1 + epoch)
    scheduler.step_update(update)

    train_model: torch.nn.Module = model
    if info.enabled:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[info.local_rank] if device.type == "cuda" else None)
    if cfg.compile:
        train_model = torch.compile(train_model)

    def state_dict(epoch_: int, batch_: int, update_: int) -> Optional[Dict[str, Any]]:
        rngs = all_gather_object(capture_rng())  # collective: every rank calls it
        if not info.is_main:
            return None
        return {"model": model.state_dict(), "ema": ema.module.state_dict() if ema else None,
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() or None, "epoch": epoch_,
                "batch": batch_, "update": update_, "rng": rngs, "arch": _arch(cfg),
                "config": config_to_dict(cfg)}

    def save(epoch_: int, batch_: int, update_: int) -> str:
        state_ = state_dict(epoch_, batch_, update_)
        return save_checkpoint(state_, run_dir, cfg.keep_checkpoints) if state_ is not None else ""

    current_epoch = [epoch]

    def on_update(batch_done: int, update_: int) -> None:
        if cfg.save_every_steps and update_ % cfg.save_every_steps == 0 \
                and batch_done < train.batches_per_epoch:
            save(current_epoch[0], batch_done, update_)
        if cfg.debug.crash_at_step == update_ and not resumed_from:
            _log(info, f"debug.crash_at_step={update_}: exiting hard (simulated failure)")
            os._exit(CRASH_EXIT_CODE)

    _write_config(cfg, info)
    runlog = RunLog(run_dir, info.is_main, cfg.tensorboard)
    opts = StepOptions(accum_steps=cfg.accum_steps, clip_grad=cfg.optim.clip_grad,
                       clip_mode=cfg.optim.clip_mode, amp=cfg.amp, nan_at_update=cfg.debug.nan_at_step,
                       progress=info.is_main and sys.stderr.isatty(),
                       step_lines=info.is_main and not sys.stderr.isatty(), log_every=cfg.log_every,
                       save_every=cfg.save_every_steps)
    _log(info, f"{cfg.model}: {sum(p.numel() for p in model.parameters()):,} params, "
               f"{train.num_samples} train / {val.num_samples} val samples, "
               f"{train.batches_per_epoch} batches/epoch/rank, global batch {global_batch}, lr {lr:.3g}")
    metrics: Dict[str, float] = {}
    ema_metrics: Optional[Dict[str, float]] = None
    last_path = resumed_from
    if resumed_from and start_batch == 0 and epoch in cfg.eval_epochs and not os.path.exists(
            os.path.join(run_dir, f"eval-e{epoch:04d}.json")):  # its evaluation did not finish
        m, m_ema = _evaluate_both(cfg, model, ema, val, device)
        _write_epoch_results(cfg, info, epoch, m, m_ema, resumed_from)
    for epoch in range(epoch, cfg.epochs):
        current_epoch[0] = epoch
        try:
            stats = train_one_epoch(
                train_model, train, epoch, optimizer=optimizer, scheduler=scheduler,
                loss_fn=loss_fn, device=device, opts=opts, update=update, start_batch=start_batch,
                rng_state=rng_state, mixup=mixup, ema=ema, scaler=scaler, on_update=on_update)
        except NonFiniteLoss as e:
            if not info.is_main:
                raise NonFiniteLoss(f"{e}. Rank 0 names the last good checkpoint") from e
            good = load_latest(run_dir, set_aside=False)[0]
            raise NonFiniteLoss(f"{e}. The last good checkpoint is "
                                f"{good or 'none (none was saved yet)'}") from e
        update, start_batch, rng_state = stats.pop("updates"), 0, None
        record: Dict[str, Any] = {"epoch": epoch, **stats}
        total_skipped = sum(all_gather_object(record["corrupt_skipped"]))
        record["corrupt_skipped"] = total_skipped
        if total_skipped:
            _log(info, f"epoch {epoch}: skipped {total_skipped} corrupt samples")
        last_path = save(epoch + 1, 0, update) or last_path  # before evaluating: keep the epoch
        if (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs or epoch + 1 in cfg.eval_epochs:
            metrics, ema_metrics = _evaluate_both(cfg, model, ema, val, device)
            record.update(top1=metrics["top1"], top5=metrics["top5"], val_loss=metrics["loss"])
            if ema_metrics is not None:
                record.update(ema_top1=ema_metrics["top1"], ema_top5=ema_metrics["top5"])
            _write_epoch_results(cfg, info, epoch + 1, metrics, ema_metrics, last_path)
        record["peak_mem_mb"] = peak_memory_mb(device)
        runlog.epoch(record)
        _log(info, " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in record.items()))
    if not metrics and resumed_from and epoch >= cfg.epochs:
        # resumed from the final checkpoint (its evaluation did not finish): evaluate it now
        metrics, ema_metrics = _evaluate_both(cfg, model, ema, val, device)
        _log(info, f"final evaluation of {resumed_from}: top1 {metrics['top1']:.2f}")
    runlog.close()
    if info.is_main and metrics:
        write_json(os.path.join(run_dir, "eval.json"), _result(cfg, metrics, last_path, False))
        if ema_metrics is not None:
            write_json(os.path.join(run_dir, "eval_ema.json"), _result(cfg, ema_metrics, last_path, True))
    return 0


def _write_epoch_results(cfg: Config, info: DistInfo, epochs_done: int, metrics: Dict[str, float],
                         ema_metrics: Optional[Dict[str, float]], path: str) -> None:
    """eval-eNNNN.json (and its EMA twin) for an epoch in `eval_epochs` (e.g. the paper's
    epoch-90 numbers)."""
    if not info.is_main or epochs_done not in cfg.eval_epochs:
        return
    write_json(os.path.join(cfg.output_dir, f"eval-e{epochs_done:04d}.json"),
               _result(cfg, metrics, path, False, epochs_done))
    if ema_metrics is not None:
        write_json(os.path.join(cfg.output_dir, f"eval_ema-e{epochs_done:04d}.json"),
                   _result(cfg, ema_metrics, path, True, epochs_done))


def _evaluate_both(cfg: Config, model: torch.nn.Module, ema: Any, val: DataPipe,
                   device: torch.device) -> Tuple[Dict[str, float], Optional[Dict[str, float]]]:
    """Metrics of the model and, when EMA is on, of its EMA weights."""
    metrics = evaluate(model, val, cfg.data.num_classes, device, cfg.amp)
    if ema is None:
        return metrics, None
    return metrics, evaluate(ema.module, val, cfg.data.num_classes, device, cfg.amp)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train_imagenet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML recipe (configs/*.yaml)")
    p.add_argument("--eval-only", action="store_true", help="evaluate checkpoint=PATH and exit")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of a refused command (exit code 2/3) too")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=1e-3")
    return p.parse_intermixed_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Exit codes: 0 done, 2 bad config/data/checkpoint/output directory, 3 non-finite loss,
    each with a one-line message (and the traceback with --debug). Those errors are raised on
    every rank alike, so the process group is closed cleanly; any other exception propagates
    without closing it (closing could wait forever for a peer blocked in a collective), and
    torchrun then stops the remaining ranks."""
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides + (["eval_only=true"] if args.eval_only else []))
        code = run(cfg)
    except NonFiniteLoss as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        code = 3
    except (ConfigError, DataError, CheckpointError, RunDirError) as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        code = 2
    shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
