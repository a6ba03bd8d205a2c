"""Evaluation metrics: torchmetrics top-1/top-5 accuracy, loss, sample count and corrupt samples
skipped, synchronised
across ranks at `compute()` (each rank sees a disjoint share of the samples, never padded)."""
from typing import Dict

import torch
from torchmetrics import MeanMetric, MetricCollection, SumMetric
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["EvalMetrics"]


class EvalMetrics:
    """Accumulates logits/targets of the evaluation batches and the corrupt samples skipped
    (`skipped`); `compute()` gives {'top1', 'top5' (percent), 'loss', 'num_samples',
    'corrupt_skipped'} over all ranks."""

    def __init__(self, num_classes: int, device: torch.device):
        self.top5_k, self.device = min(5, num_classes), device
        self.metrics = MetricCollection({
            "top1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
            "top5": MulticlassAccuracy(num_classes, top_k=self.top5_k, average="micro"),
            "num_samples": SumMetric(),
            "corrupt_skipped": SumMetric(),
            "loss": MeanMetric(),
        }).to(device)

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        logits = logits.float()                                      # (B, num_classes)
        self.metrics["top1"].update(logits, target)
        self.metrics["top5"].update(logits, target)
        self.metrics["num_samples"].update(torch.tensor(float(target.numel()), device=logits.device))
        loss = torch.nn.functional.cross_entropy(logits, target, reduction="none")  # (B,)
        self.metrics["loss"].update(loss)

    @torch.no_grad()
    def skipped(self, n: int) -> None:
        self.metrics["corrupt_skipped"].update(torch.tensor(float(n), device=self.device))

    def compute(self) -> Dict[str, float]:
        out = {k: float(v) for k, v in self.metrics.compute().items()}
        out["top1"] *= 100.0
        out["top5"] *= 100.0
        out["num_samples"] = int(round(out["num_samples"]))
        out["corrupt_skipped"] = int(round(out["corrupt_skipped"]))
        return out
