"""The runs after their checks. Training: the recipe, the start position, the epoch loop with
its checkpoints (mid-epoch and per epoch, each written before the epoch is evaluated), the
logs and the results. ``--eval-only``: the results of one checkpoint.

No record is lost across a restart: a mid-epoch checkpoint carries the epoch's running sums,
and an epoch's checkpoint carries the epoch's train record, which a run resumed from it
evaluates (when due) and logs if the interrupted run did not get to. A stop signal
(`preemption`) ends the run after the update in progress with a checkpoint: mid-epoch, or the
epoch's own (its evaluation then left to the resumed run)."""
import os
import sys
from typing import Any, Dict, Optional, Tuple

import torch

from .checkpoint import (CheckpointError, capture_rng, load_latest, load_model_weights,
                         save_checkpoint, seed_all)
from .config import Config, config_to_dict, save_config
from .data import DataPipe
from .distributed import DistInfo, all_gather_object, broadcast_object, log_main, waiting_for
from .engine import (EpochTotals, NonFiniteLoss, StepOptions, evaluate, peak_memory_mb,
                     train_one_epoch)
from .logs import RunLog
from .preemption import Preempted, agreed
from .recipe import build_recipe
from .results import evaluate_both, report_skipped, write_epoch_results, write_results
from .start import arch_of, load_start_weights, position_of, start_training

__all__ = ["train", "evaluate_checkpoint", "write_config"]

Results = Tuple[Dict[str, float], Optional[Dict[str, float]]]   # metrics, the EMA's metrics


def write_config(cfg: Config, info: DistInfo) -> None:
    """The resolved config, written once every check has passed (a refused command leaves
    the run directory's config as it was)."""
    if info.is_main:
        save_config(cfg, os.path.join(cfg.output_dir, "eval_config.yaml" if cfg.eval_only
                                      else "config.yaml"))


def train(cfg: Config, model: torch.nn.Module, train_data: DataPipe, val: DataPipe,
          info: DistInfo, path: str, state: Optional[Dict[str, Any]]) -> int:
    """Trains from scratch, from `checkpoint=` weights, or on from `path` (`resume`), whose
    content `state` rank 0 may already have loaded."""
    from timm.utils import ModelEmaV3

    device, run_dir = info.device, cfg.output_dir
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    recipe = build_recipe(cfg, model, train_data.batches_per_epoch, info.world_size)
    position = position_of(cfg, train_data.num_samples, info.world_size)
    start = start_training(cfg, model, recipe, info, path, state, position,
                           train_data.batches_per_epoch // cfg.accum_steps)
    ema = None  # made after loading, so it starts from the loaded weights
    if cfg.ema.enabled:
        ema = ModelEmaV3(model, decay=cfg.ema.decay, use_warmup=cfg.ema.warmup)
        if start.resumed_from and start.state.get("ema") is not None:
            load_model_weights(ema.module, start.state["ema"], start.resumed_from, what="EMA")
    if start.rng_state is None:
        seed_all(cfg.seed * 1000 + info.rank + 1 + start.epoch)
    recipe.scheduler.step_update(start.update)

    train_model: torch.nn.Module = model  # timm's order: compile the model, then wrap it in DDP
    if cfg.compile:
        train_model = torch.compile(model)
    if info.enabled:
        train_model = torch.nn.parallel.DistributedDataParallel(
            train_model, device_ids=[info.local_rank] if device.type == "cuda" else None)

    def save(epoch_: int, batch_: int, update_: int, totals: Optional[EpochTotals] = None,
             record: Optional[Dict[str, Any]] = None) -> str:
        """Rank 0 writes the checkpoint; a refused write (a full disk) is raised on every rank."""
        waiting_for(f"the RNG states for the checkpoint of epoch {epoch_}, update {update_}")
        gathered = all_gather_object((capture_rng(), totals.skipped if totals else 0))
        result: Any = ""
        if info.is_main:
            try:
                result = save_checkpoint({
                    "model": model.state_dict(), "ema": ema.module.state_dict() if ema else None,
                    "optimizer": recipe.optimizer.state_dict(),
                    "scheduler": recipe.scheduler.state_dict(),
                    "scaler": recipe.scaler.state_dict() if recipe.scaler else None,
                    "epoch": epoch_, "batch": batch_,
                    "update": update_, "rng": [g[0] for g in gathered], "arch": arch_of(cfg),
                    "config": config_to_dict(cfg), "position": position,
                    "totals": totals.to_saved([g[1] for g in gathered]) if totals else None,
                    "record": record,
                }, run_dir, cfg.keep_checkpoints)
            except CheckpointError as e:
                result = e
        if info.enabled:
            waiting_for(f"rank 0's save of the checkpoint of epoch {epoch_}, update {update_}")
            result = broadcast_object(result)
        if isinstance(result, Exception):
            raise result
        return result

    saved = {"update": -1, "path": ""}       # the newest mid-epoch checkpoint

    def on_update(epoch_: int, batch_done: int, update_: int, totals: EpochTotals) -> None:
        """The mid-epoch checkpoints (the epoch's last update is saved with its record)."""
        if cfg.save_every_steps and update_ % cfg.save_every_steps == 0 \
                and batch_done < train_data.batches_per_epoch:
            saved.update(update=update_, path=save(epoch_, batch_done, update_, totals))

    write_config(cfg, info)
    runlog = RunLog(run_dir, info.is_main, cfg.tensorboard)
    opts = StepOptions(accum_steps=cfg.accum_steps, clip_grad=cfg.optim.clip_grad,
                       clip_mode=cfg.optim.clip_mode, amp=cfg.amp,
                       progress=info.is_main and sys.stderr.isatty(),
                       step_lines=info.is_main and not sys.stderr.isatty(), log_every=cfg.log_every,
                       save_every=cfg.save_every_steps)
    log_main(info, f"{cfg.model}: {sum(p.numel() for p in model.parameters()):,} params, "
                   f"{train_data.num_samples} train / {val.num_samples} val samples, "
                   f"{train_data.batches_per_epoch} batches/epoch/rank, global batch "
                   f"{recipe.global_batch}, lr {recipe.lr:.3g}")
    results: Optional[Results] = None        # the latest evaluation
    epoch, start_batch, update, rng_state = start.epoch, start.batch, start.update, start.rng_state
    totals = start.totals
    last_path = start.resumed_from

    def finish_epoch(record: Dict[str, Any], checkpoint: str) -> Optional[Results]:
        """Evaluates the epoch just trained when due (returns the metrics and the EMA's, else
        None) and logs its record; `checkpoint` holds the evaluated weights."""
        done, evaluated = record["epoch"] + 1, None
        if done % cfg.eval_every == 0 or done == cfg.epochs or done in cfg.eval_epochs:
            waiting_for(f"the evaluation after epoch {record['epoch']}")
            evaluated = evaluate_both(cfg, model, ema, val, device)
            metrics, ema_metrics = evaluated
            record.update(top1=metrics["top1"], top5=metrics["top5"], val_loss=metrics["loss"])
            if ema_metrics is not None:
                record.update(ema_top1=ema_metrics["top1"], ema_top5=ema_metrics["top5"])
            write_epoch_results(cfg, info, done, metrics, ema_metrics, checkpoint)
        record["peak_mem_mb"] = peak_memory_mb(device)
        runlog.epoch(record)
        log_main(info, " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in record.items()))
        return evaluated

    pending = start.state.get("record") if start.state and start_batch == 0 else None
    if pending is not None and pending.get("epoch") == epoch - 1:
        waiting_for("rank 0's reading of log.jsonl")   # the epoch was saved; was it logged?
        if not broadcast_object(runlog.has_epoch(pending["epoch"]) if info.is_main else None):
            log_main(info, f"epoch {pending['epoch']} was saved but not logged (the run stopped "
                           f"before): evaluating and logging it now")
            results = finish_epoch(dict(pending), last_path)
    for epoch in range(epoch, cfg.epochs):
        try:
            stats = train_one_epoch(
                train_model, train_data, epoch, optimizer=recipe.optimizer,
                scheduler=recipe.scheduler, loss_fn=recipe.loss_fn, device=device, opts=opts,
                update=update, start_batch=start_batch, rng_state=rng_state, mixup=recipe.mixup,
                ema=ema, scaler=recipe.scaler, totals=totals, on_update=on_update)
        except Preempted as p:   # mid-epoch: its checkpoint, unless one was just saved there
            p.path = saved["path"] if saved["update"] == p.update else \
                save(p.epoch, p.batch, p.update, p.totals)
            raise
        except NonFiniteLoss as e:
            if not info.is_main:
                raise NonFiniteLoss(f"{e}. Rank 0 names the last good checkpoint") from e
            good = load_latest(run_dir, set_aside=False)[0]
            raise NonFiniteLoss(f"{e}. The last good checkpoint is "
                                f"{good or 'none (none was saved yet)'}") from e
        update, start_batch, rng_state, totals = stats.pop("updates"), 0, None, None
        record: Dict[str, Any] = {"epoch": epoch, **stats}
        waiting_for(f"the corrupt-sample counts of epoch {epoch}")
        total_skipped = sum(all_gather_object(record["corrupt_skipped"]))
        record["corrupt_skipped"] = total_skipped
        if total_skipped:
            log_main(info, f"epoch {epoch}: skipped {total_skipped} corrupt samples")
        # saved before evaluating, with the record: a stop during evaluation loses nothing
        last_path = save(epoch + 1, 0, update, record=record) or last_path
        if agreed(epoch, update):      # its record is in the checkpoint: the resume logs it
            raise Preempted(epoch + 1, 0, update, path=last_path)
        results = finish_epoch(record, last_path) or results
        if epoch + 1 < cfg.epochs and agreed(epoch, update):   # a signal during evaluation
            raise Preempted(epoch + 1, 0, update, path=last_path)
    if results is None and start.resumed_from and epoch >= cfg.epochs:
        # resumed from the final checkpoint, its record logged but eval.json not written
        waiting_for(f"the final evaluation of {start.resumed_from}")
        results = evaluate_both(cfg, model, ema, val, device)
        log_main(info, f"final evaluation of {start.resumed_from}: top1 {results[0]['top1']:.2f}")
    runlog.close()
    if results is not None:
        write_results(cfg, info, *results, last_path)
    return 0


def evaluate_checkpoint(cfg: Config, model: torch.nn.Module, val: DataPipe, info: DistInfo,
                        path: Optional[str]) -> int:
    """``--eval-only``: eval.json of the weights in `path` (and eval_ema.json of its EMA)."""
    if not path:
        raise CheckpointError(f"eval_only needs checkpoint=PATH (no checkpoint in {cfg.output_dir!r})")
    state = load_start_weights(model, path, cfg) or {}
    write_config(cfg, info)
    waiting_for(f"the evaluation of {path}")
    metrics = evaluate(model, val, cfg.data.num_classes, info.device, cfg.amp)
    report_skipped(cfg, metrics)
    ema_metrics = None
    log_main(info, f"{path}: top1 {metrics['top1']:.2f} top5 {metrics['top5']:.2f} "
                   f"on {metrics['num_samples']} samples")
    if state.get("ema") is not None:
        load_model_weights(model, state["ema"], path, what="EMA")
        ema_metrics = evaluate(model, val, cfg.data.num_classes, info.device, cfg.amp)
        log_main(info, f"EMA: top1 {ema_metrics['top1']:.2f} top5 {ema_metrics['top5']:.2f}")
    write_results(cfg, info, metrics, ema_metrics, path)
    return 0
