"""big_vision's mixup (``utils.get_mixup``): one ratio per batch, each image mixed with its neighbour.

For a batch (x, y): draw a ~ Beta(p, p), take a = max(a, 1 - a), and return
``a·x + (1 - a)·roll(x, 1)`` with the labels (one-hot, optionally smoothed) mixed alike.
``p`` is the Beta parameter (the ``mixup=dict(p=0.2)`` of the authors' configs), not a
probability: every batch is mixed. Each process mixes its own share of the global batch
with its own ratio (big_vision rolls within each device's share too).
"""
import torch
from torch import Tensor

__all__ = ["RollMixup"]


class RollMixup:
    """Callable ``(x (B, ...), y (B,) int) -> (mixed x, soft targets (B, num_classes))``."""

    def __init__(self, p: float, num_classes: int, label_smoothing: float = 0.0) -> None:
        if not p > 0:
            raise ValueError(f"RollMixup: the Beta parameter p must be > 0, got {p!r}")
        self.p = float(p)
        self.num_classes = num_classes
        self.label_smoothing = label_smoothing

    def ratio(self) -> float:
        """a = max(a, 1 - a), a ~ Beta(p, p), from torch's global RNG (saved in checkpoints)."""
        p = torch.tensor(self.p, dtype=torch.float64)
        a = float(torch.distributions.Beta(p, p).sample())
        return max(a, 1.0 - a)

    def __call__(self, x: Tensor, y: Tensor) -> tuple:
        a = self.ratio()
        off = self.label_smoothing / self.num_classes
        target = torch.full((y.shape[0], self.num_classes), off, device=y.device, dtype=torch.float32)
        target.scatter_(1, y.long().view(-1, 1), 1.0 - self.label_smoothing + off)
        x = a * x + (1.0 - a) * x.roll(1, dims=0)
        target = a * target + (1.0 - a) * target.roll(1, dims=0)
        return x, target
