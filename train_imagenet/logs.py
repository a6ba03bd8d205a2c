"""Run logs on rank 0: per-epoch JSON lines (`log.jsonl`), a CSV summary (`summary.csv`) and
optional TensorBoard scalars. Result files (`eval.json`) are written with `dcvit.io.write_json`.

A line cut short at the end of either file (a kill or a full disk mid-append) is removed
before a run appends its first record, so that record starts a line of its own (and
summary.csv, left empty, gets its header again); the checkpoint of its epoch holds the
record, which the resumed run writes again (`start.start_training`). A write that fails
raises its OSError naming the file (the trainer reports it: `checkpoint.refused_writes`)."""
import csv
import json
import logging
import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

__all__ = ["RunLog", "LOG_NAME"]

LOG_NAME, SUMMARY_NAME = "log.jsonl", "summary.csv"
_logger = logging.getLogger(__name__)

CSV_FIELDS = ["epoch", "train_loss", "lr", "top1", "top5", "val_loss", "ema_top1", "ema_top5",
              "img_per_s", "epoch_time_s", "peak_mem_mb", "corrupt_skipped"]


class RunLog:
    """Appends one record per epoch; a no-op object on ranks other than 0."""

    def __init__(self, run_dir: str, enabled: bool = True, tensorboard: bool = False):
        self.run_dir, self.enabled = run_dir, enabled
        self.tb: Optional[Any] = None
        self.checked = False            # the ends of the files checked for a line cut short
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("tensorboard=true needs the tensorboard package: "
                                  "pip install 'dcvit[tensorboard]' (or set tensorboard=false)") from e
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"))

    def _drop_cut_line(self, path: str) -> None:
        """Truncates `path` after its last newline, with a warning, when a line was cut short
        there."""
        try:
            with _naming(path), open(path, "rb+") as f:
                data = f.read()
                whole = data.rfind(b"\n") + 1
                if whole == len(data):
                    return
                f.truncate(whole)
        except FileNotFoundError:
            return
        _logger.warning("%s ended in a line cut short (%d bytes, a run killed while writing it): "
                        "removed; its record is written again once its epoch is done",
                        path, len(data) - whole)

    def epoch(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        log, summary = (os.path.join(self.run_dir, name) for name in (LOG_NAME, SUMMARY_NAME))
        if not self.checked:
            self._drop_cut_line(log)
            self._drop_cut_line(summary)
            self.checked = True
        with _naming(log), open(log, "a") as f:
            f.write(json.dumps(record) + "\n")
        new = not os.path.exists(summary) or os.path.getsize(summary) == 0  # (a cut header removed)
        with _naming(summary), open(summary, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow({k: record.get(k, "") for k in CSV_FIELDS})
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "epoch":
                    self.tb.add_scalar(k, v, record["epoch"])
            self.tb.flush()

    def has_epoch(self, epoch: int) -> bool:
        """Whether log.jsonl holds the record of `epoch` (a run stopped between an epoch's
        checkpoint and its record did not write it)."""
        path = os.path.join(self.run_dir, LOG_NAME)
        if not os.path.exists(path):
            return False
        with open(path) as f:
            for line in f:
                try:
                    if json.loads(line).get("epoch") == epoch:
                        return True
                except ValueError:      # a line cut short by a kill
                    continue
        return False

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


@contextmanager
def _naming(path: str) -> Iterator[None]:
    """An OSError inside names `path` (a failed write or close does not name its file)."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = path
        raise
