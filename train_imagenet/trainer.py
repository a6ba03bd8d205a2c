"""The runs after their checks, shaped like big_vision's loop: the recipe and the start
position (`start.start_training` decides it), then updates counted from there, each epoch
derived from the update count, with its checkpoints (mid-epoch, and per epoch before the
epoch is evaluated), the logs and the results. `Run` holds what the loop's steps share;
``--eval-only``: the results of one checkpoint.

No record is lost across a restart: a mid-epoch checkpoint carries the epoch's running sums,
and an epoch's checkpoint carries the epoch's train record, which a run resumed from it
evaluates (when due) and logs if the interrupted run did not get to. A stop signal
(`preemption`) ends the run after the update in progress with a checkpoint: mid-epoch, or the
epoch's own (its evaluation then left to the resumed run)."""
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .checkpoint import (RESUME, CheckpointError, capture_rng, load_latest, load_model_weights,
                         refused_writes, save_checkpoint)
from .config import Config, config_to_dict, save_config
from .data import DataPipe
from .distributed import DistInfo, all_gather_object, broadcast_object, log_main, waiting_for
from .engine import (EpochState, EpochTotals, Loop, NonFiniteLoss, evaluate, peak_memory_mb,
                     train_one_epoch)
from .logs import RunLog
from .preemption import Preempted, agreed
from .recipe import Recipe, build_recipe
from .results import evaluate_both, report_skipped, write_epoch_results, write_results
from .start import Start, arch_of, load_start_weights, position_of, start_training

__all__ = ["train", "evaluate_checkpoint", "write_config", "on_main", "Run"]

Results = Tuple[Dict[str, float], Optional[Dict[str, float]]]   # metrics, the EMA's metrics
RECORDS_KEPT = "the checkpoints are intact, and resume=auto writes the records that are missing"
EVAL_KEPT, EVAL_AGAIN = "the checkpoint is unchanged", "run the same --eval-only command again"


def write_config(cfg: Config, info: DistInfo) -> None:
    """The resolved config, written once every check has passed (a refused command leaves
    the run directory's config as it was); a write the file system refuses is exit 2."""
    path = os.path.join(cfg.output_dir, "eval_config.yaml" if cfg.eval_only else "config.yaml")
    on_main(info, f"write of {os.path.basename(path)}", lambda: save_config(cfg, path),
            cfg.output_dir, eval_only=cfg.eval_only)


def train(cfg: Config, model: torch.nn.Module, train_data: DataPipe, val: DataPipe,
          info: DistInfo, path: str, state: Optional[Dict[str, Any]]) -> int:
    """Trains from scratch, from `checkpoint=` weights, or on from `path` (`resume`), whose
    content `state` rank 0 may already have loaded."""
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    recipe = build_recipe(cfg, model, train_data.batches_per_epoch, info.world_size)
    position = position_of(cfg, train_data.num_samples, info.world_size)
    start = start_training(cfg, model, recipe, info, path, state, position,
                           train_data.batches_per_epoch // cfg.accum_steps)
    write_config(cfg, info)
    run = Run(cfg, info, model, _ema(cfg, model, start), recipe, train_data, val,
              RunLog(cfg.output_dir, info.is_main, cfg.tensorboard), position, start.resumed_from)
    loop = run.loop()
    log_main(info, f"{cfg.model}: {sum(p.numel() for p in model.parameters()):,} params, "
                   f"{train_data.num_samples} train / {val.num_samples} val samples, "
                   f"{train_data.batches_per_epoch} batches/epoch/rank, global batch "
                   f"{recipe.global_batch}, lr {recipe.lr:.3g}")
    results: Optional[Results] = None        # the latest evaluation
    if start.unlogged is not None:
        log_main(info, f"epoch {start.unlogged['epoch']} was saved but not logged (the run "
                       f"stopped before): evaluating and logging it now")
        results = run.finish_epoch(dict(start.unlogged))
    epoch_state = EpochState(start.epoch, start.update, start.batch,
                             start.totals or EpochTotals(), start.rng_state)
    while epoch_state.epoch < cfg.epochs:
        record = run.train_epoch(loop, epoch_state)
        results = run.end_epoch(record, epoch_state.update) or results
        epoch_state = EpochState(*start.position_at(epoch_state.update))   # the next epoch
    if results is None and start.resumed_from:
        # resumed from the final checkpoint, its record logged but eval.json not written
        waiting_for(f"the final evaluation of {start.resumed_from}")
        results = evaluate_both(cfg, model, run.ema, val, info.device)
        log_main(info, f"final evaluation of {start.resumed_from}: top1 {results[0]['top1']:.2f}")
    run.runlog.close()
    if results is not None:
        on_main(info, "results", lambda: write_results(cfg, info, *results, run.last_path),
                cfg.output_dir)
    return 0


def on_main(info: DistInfo, what: str, write: Callable[[], Any], records_in: str = "",
            eval_only: bool = False) -> Any:
    """`write()` on rank 0 (`what` it writes), its result broadcast; a write refused there (a
    CheckpointError: a full disk, an unwritable output_dir) is raised on every rank. With
    `records_in` (the run directory) `write` writes the run's records (config.yaml,
    log.jsonl, summary.csv, eval*.json), and a refused write of one is such an error too
    (`refused_writes`), whose record the resumed run writes; `eval_only`: the records of
    ``--eval-only``, which the same command run again writes."""
    result: Any = None
    if info.is_main:
        try:
            if records_in:
                kept, then = (EVAL_KEPT, EVAL_AGAIN) if eval_only else (RECORDS_KEPT, RESUME)
                with refused_writes(records_in, records_in, kept, then):
                    result = write()
            else:
                result = write()
        except CheckpointError as e:
            result = e
    if info.enabled:
        waiting_for(f"rank 0's {what}")
        result = broadcast_object(result)
    if isinstance(result, Exception):
        raise result
    return result


def _ema(cfg: Config, model: torch.nn.Module, start: Start) -> Optional[Any]:
    """timm's ModelEmaV3 of `model`, made after loading so that it starts from the loaded
    weights, with the EMA weights of the checkpoint resumed from; None without EMA."""
    from timm.utils import ModelEmaV3
    if not cfg.ema.enabled:
        return None
    ema = ModelEmaV3(model, decay=cfg.ema.decay, use_warmup=cfg.ema.warmup)
    if start.resumed_from and start.state.get("ema") is not None:
        load_model_weights(ema.module, start.state["ema"], start.resumed_from, what="EMA")
    return ema


@dataclass
class Run:
    """What the steps of one training run share: the config, the model and its EMA, the
    recipe, the data, the log, what the checkpoints' position depends on, and the newest
    checkpoints (`last_path`; `saved`: the newest mid-epoch one and its update)."""
    cfg: Config
    info: DistInfo
    model: torch.nn.Module
    ema: Optional[Any]
    recipe: Recipe
    train_data: DataPipe
    val: DataPipe
    runlog: RunLog
    position: Dict[str, Any]
    last_path: str = ""
    saved: Tuple[int, str] = (-1, "")

    def loop(self) -> Loop:
        """The loop's parts, the model compiled and wrapped in DDP (timm's order)."""
        cfg, info, recipe = self.cfg, self.info, self.recipe
        model: torch.nn.Module = torch.compile(self.model) if cfg.compile else self.model
        if info.enabled:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
        return Loop(model, recipe.optimizer, recipe.scheduler, recipe.loss_fn, info.device,
                    recipe.mixup, self.ema, recipe.scaler, cfg.accum_steps, cfg.optim.clip_grad,
                    cfg.optim.clip_mode, cfg.amp, cfg.log_every, cfg.save_every_steps,
                    progress=info.is_main and sys.stderr.isatty(),
                    step_lines=info.is_main and not sys.stderr.isatty(),
                    world_size=info.world_size)

    def save(self, epoch: int, batch: int, update: int, totals: Optional[EpochTotals] = None,
             record: Optional[Dict[str, Any]] = None) -> str:
        """Rank 0 writes the checkpoint; a refused write (a full disk) is raised on every rank."""
        cfg, info, recipe = self.cfg, self.info, self.recipe
        waiting_for(f"the RNG states for the checkpoint of epoch {epoch}, update {update}")
        gathered = all_gather_object((capture_rng(), totals.skipped if totals else 0))

        def write() -> str:
            return save_checkpoint({
                "model": self.model.state_dict(),
                "ema": self.ema.module.state_dict() if self.ema else None,
                "optimizer": recipe.optimizer.state_dict(),
                "scheduler": recipe.scheduler.state_dict(),
                "scaler": recipe.scaler.state_dict() if recipe.scaler else None,
                "epoch": epoch, "batch": batch,
                "update": update, "rng": [g[0] for g in gathered], "arch": arch_of(cfg),
                "config": config_to_dict(cfg), "position": self.position,
                "totals": totals.to_saved([g[1] for g in gathered]) if totals else None,
                "record": record,
            }, cfg.output_dir, cfg.keep_checkpoints)
        return on_main(info, f"save of the checkpoint of epoch {epoch}, update {update}", write)

    def on_update(self, state: EpochState) -> None:
        """The mid-epoch checkpoints (the epoch's last update is saved with its record)."""
        every = self.cfg.save_every_steps
        if every and state.update % every == 0 and state.batch < self.train_data.batches_per_epoch:
            self.saved = (state.update, self.save(state.epoch, state.batch, state.update,
                                                  state.totals))

    def train_epoch(self, loop: Loop, state: EpochState) -> Dict[str, Any]:
        """Trains the rest of `state`'s epoch (advancing `state`); returns its record. A stop signal mid-epoch saves there (unless a checkpoint was just
        saved there) and raises `Preempted`; a NaN/inf names the last good checkpoint."""
        try:
            stats = train_one_epoch(loop, self.train_data, state, self.on_update)
        except Preempted as p:
            p.path = self.saved[1] if self.saved[0] == p.update else \
                self.save(p.epoch, p.batch, p.update, p.totals)
            raise
        except NonFiniteLoss as e:
            if not self.info.is_main:
                raise NonFiniteLoss(f"{e}. Rank 0 names the last good checkpoint") from e
            good = load_latest(self.cfg.output_dir, set_aside=False)[0]
            raise NonFiniteLoss(f"{e}. The last good checkpoint is "
                                f"{good or 'none (none was saved yet)'}") from e
        record: Dict[str, Any] = {"epoch": state.epoch, **stats}
        waiting_for(f"the corrupt-sample counts of epoch {state.epoch}")
        record["corrupt_skipped"] = sum(all_gather_object(record["corrupt_skipped"]))
        if record["corrupt_skipped"]:
            log_main(self.info, f"epoch {state.epoch}: skipped {record['corrupt_skipped']} "
                                f"corrupt samples")
        return record

    def end_epoch(self, record: Dict[str, Any], update: int) -> Optional[Results]:
        """Saves the epoch just trained with its record, before evaluating it (a stop during
        evaluation loses nothing), then evaluates it when due and logs it. A stop signal after
        the save skips the evaluation (the resumed run does it); one during the evaluation
        stops the run after it."""
        epoch = record["epoch"]
        self.last_path = self.save(epoch + 1, 0, update, record=record) or self.last_path
        if agreed(epoch, update):      # its record is in the checkpoint: the resume logs it
            raise Preempted(epoch + 1, 0, update, path=self.last_path)
        results = self.finish_epoch(record)
        if epoch + 1 < self.cfg.epochs and agreed(epoch, update):
            raise Preempted(epoch + 1, 0, update, path=self.last_path)
        return results

    def finish_epoch(self, record: Dict[str, Any]) -> Optional[Results]:
        """Evaluates the epoch just trained when due (returns the metrics and the EMA's, else
        None) and logs its record; `last_path` holds the evaluated weights."""
        cfg, info = self.cfg, self.info
        done, evaluated = record["epoch"] + 1, None
        if done % cfg.eval_every == 0 or done == cfg.epochs or done in cfg.eval_epochs:
            waiting_for(f"the evaluation after epoch {record['epoch']}")
            evaluated = evaluate_both(cfg, self.model, self.ema, self.val, info.device)
            metrics, ema_metrics = evaluated
            record.update(top1=metrics["top1"], top5=metrics["top5"], val_loss=metrics["loss"])
            if ema_metrics is not None:
                record.update(ema_top1=ema_metrics["top1"], ema_top5=ema_metrics["top5"])
        record["peak_mem_mb"] = peak_memory_mb(info.device)

        def write() -> None:
            if evaluated is not None:
                write_epoch_results(cfg, info, done, *evaluated, self.last_path)
            self.runlog.epoch(record)
        on_main(info, f"log of epoch {record['epoch']}", write, cfg.output_dir)
        log_main(info, " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in record.items()))
        return evaluated


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
    on_main(info, "results", lambda: write_results(cfg, info, metrics, ema_metrics, path),
            cfg.output_dir, eval_only=True)
    return 0
