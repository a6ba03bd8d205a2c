"""Throughput of a model, alone or against its baseline (docs/spec.md §5), on the model's device.

Both use `dcvit.bench.timing`, the timer of ``dcvit-bench``: eval forwards on one fixed random
batch, the median of ``steps`` timed forwards after ``warmup`` untimed ones; a pair is timed
alternately in one process.
"""
import statistics
from typing import Dict, Optional, Sequence

import torch
from torch import nn

from ..bench.timing import time_pair, time_steps

__all__ = ["measure_throughput", "measure_pair", "device_of"]


def device_of(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter or buffer (CPU for a model with neither)."""
    tensor = next(model.parameters(), None)
    if tensor is None:
        tensor = next(model.buffers(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


@torch.inference_mode()
def measure_throughput(model: nn.Module, input_shape: Sequence[int], batch_size: int = 8,
                       steps: int = 5, warmup: int = 2) -> float:
    """Images per second of ``model`` in eval mode: median of ``steps`` timed forwards."""
    was_training = model.training
    model.eval()
    device = device_of(model)
    x = torch.randn(batch_size, *input_shape[1:], device=device)
    try:
        times = time_steps(lambda: model(x), device, warmup, steps)
    finally:
        model.train(was_training)
    return batch_size / statistics.median(times)


@torch.inference_mode()
def measure_pair(model: nn.Module, baseline: nn.Module, input_shape: Sequence[int], batch_size: int = 8,
                 steps: int = 5, warmup: int = 2, device: Optional[torch.device] = None) -> Dict[str, float]:
    """``model`` against ``baseline``: eval forwards timed alternately (`dcvit.bench.timing.time_pair`),
    same batch, threads and device (default: ``model``'s).

    Returns ``img_s`` and ``baseline_img_s`` (from the median step times) and ``ratio`` =
    baseline time / model time (the model's relative throughput).
    """
    device = device_of(model) if device is None else torch.device(device)
    modes = model.training, baseline.training
    model.eval()
    baseline.eval()
    x = torch.randn(batch_size, *input_shape[1:], device=device)
    try:
        r = time_pair(lambda: model(x), lambda: baseline(x), device, warmup, steps)
    finally:
        model.train(modes[0])
        baseline.train(modes[1])
    return {"img_s": batch_size / (r["dcvit_ms"] / 1e3), "baseline_img_s": batch_size / (r["vit_ms"] / 1e3),
            "ratio": r["ratio"]}
