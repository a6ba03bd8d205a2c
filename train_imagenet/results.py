"""What a run reports: the ``eval.json`` objects (`dcvit.schema.EvalResult`) of the model and
of its EMA weights, per epoch in ``eval_epochs`` and at the end."""
import os
import sys
from typing import Any, Dict, Optional, Tuple

import torch

from dcvit.io import write_json
from dcvit.schema import EvalResult

from .config import Config
from .data import DataPipe
from .distributed import DistInfo
from .engine import evaluate
from .finetune import arch_entry

__all__ = ["eval_result", "evaluate_both", "report_skipped", "write_epoch_results", "write_results"]


def eval_result(cfg: Config, metrics: Dict[str, float], checkpoint: str, ema: bool,
            epoch: Optional[int] = None) -> Dict[str, Any]:
    """The ``eval.json`` object (`dcvit.schema.EvalResult`, read by ``dcvit-report``); ``epoch``
    for the evaluations of ``eval_epochs`` (``eval-eNNNN.json``)."""
    return EvalResult(model=cfg.model, top1=metrics["top1"], top5=metrics["top5"],
                      num_samples=metrics["num_samples"], loss=metrics["loss"],
                      model_kwargs=dict(cfg.model_kwargs), img_size=cfg.data.img_size,
                      num_classes=cfg.data.num_classes, checkpoint=checkpoint, ema=ema,
                      val=cfg.data.val, convert=arch_entry(cfg), epoch=epoch,
                      corrupt_skipped=metrics.get("corrupt_skipped", 0)).to_dict()


def evaluate_both(cfg: Config, model: torch.nn.Module, ema: Any, val: DataPipe,
                   device: torch.device) -> Tuple[Dict[str, float], Optional[Dict[str, float]]]:
    """Metrics of the model and, when EMA is on, of its EMA weights."""
    metrics = evaluate(model, val, cfg.data.num_classes, device, cfg.amp)
    report_skipped(cfg, metrics)
    if ema is None:
        return metrics, None
    return metrics, evaluate(ema.module, val, cfg.data.num_classes, device, cfg.amp)


def report_skipped(cfg: Config, metrics: Dict[str, float]) -> None:
    """The log line for corrupt validation samples (left out of the metrics, counted in
    eval.json's ``corrupt_skipped``), on rank 0."""
    if metrics.get("corrupt_skipped") and int(os.environ.get("RANK", "0")) == 0:
        print(f"[train_imagenet] evaluation: skipped {metrics['corrupt_skipped']} corrupt samples "
              f"of data.val={cfg.data.val!r}: the metrics cover the other {metrics['num_samples']} "
              f"(data.on_corrupt=fail refuses them instead)", file=sys.stderr, flush=True)


def write_epoch_results(cfg: Config, info: DistInfo, epochs_done: int, metrics: Dict[str, float],
                         ema_metrics: Optional[Dict[str, float]], path: str) -> None:
    """eval-eNNNN.json (and its EMA twin) for an epoch in `eval_epochs` (e.g. the paper's
    epoch-90 numbers)."""
    if not info.is_main or epochs_done not in cfg.eval_epochs:
        return
    write_json(os.path.join(cfg.output_dir, f"eval-e{epochs_done:04d}.json"),
               eval_result(cfg, metrics, path, False, epochs_done))
    if ema_metrics is not None:
        write_json(os.path.join(cfg.output_dir, f"eval_ema-e{epochs_done:04d}.json"),
                   eval_result(cfg, ema_metrics, path, True, epochs_done))


def write_results(cfg: Config, info: DistInfo, metrics: Dict[str, float],
                  ema_metrics: Optional[Dict[str, float]], path: str) -> None:
    """eval.json (and eval_ema.json) of the weights in `path`, on rank 0."""
    if not info.is_main:
        return
    write_json(os.path.join(cfg.output_dir, "eval.json"), eval_result(cfg, metrics, path, False))
    if ema_metrics is not None:
        write_json(os.path.join(cfg.output_dir, "eval_ema.json"),
                   eval_result(cfg, ema_metrics, path, True))
