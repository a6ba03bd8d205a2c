"""Run logs on rank 0: per-epoch JSON lines (`log.jsonl`), a CSV summary (`summary.csv`) and
optional TensorBoard scalars. Result files (`eval.json`) are written with `dcvit.io.write_json`."""
import csv
import json
import os
from typing import Any, Dict, Optional

__all__ = ["RunLog"]

CSV_FIELDS = ["epoch", "train_loss", "lr", "top1", "top5", "val_loss", "ema_top1", "ema_top5",
              "img_per_s", "epoch_time_s", "peak_mem_mb", "corrupt_skipped"]


class RunLog:
    """Appends one record per epoch; a no-op object on ranks other than 0."""

    def __init__(self, run_dir: str, enabled: bool = True, tensorboard: bool = False):
        self.run_dir, self.enabled = run_dir, enabled
        self.tb: Optional[Any] = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("tensorboard=true needs the tensorboard package: "
                                  "pip install 'dcvit[tensorboard]' (or set tensorboard=false)") from e
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"))

    def epoch(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(os.path.join(self.run_dir, "log.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        path = os.path.join(self.run_dir, "summary.csv")
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
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
        path = os.path.join(self.run_dir, "log.jsonl")
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
