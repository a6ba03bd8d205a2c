"""Step timers shared by ``dcvit-bench`` and ``dcvit-report`` (method: docs/spec.md §5).

A figure is a median over timed steps after untimed warm-up steps; a comparison times two
steps alternately (A, B, then B, A, ...) in one process, so both see the same machine load.
CUDA work is synchronised before each clock reading.
"""
import statistics
import time
from typing import Any, Callable, Dict, List

import torch

__all__ = ["sync", "time_steps", "time_pair"]


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> List[float]:
    """Seconds of each of ``steps`` calls of ``step``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def time_pair(step_a: Callable[[], None], step_b: Callable[[], None], device: torch.device,
              warmup: int, steps: int) -> Dict[str, Any]:
    """Time A and B alternately (AB, BA, AB, ...), after ``warmup`` untimed steps of each.

    Returns median milliseconds (``dcvit_ms`` for A, ``vit_ms`` for B), the ratio of the
    medians ``ratio`` = B / A (A's throughput relative to B's) and every step's time.
    """
    for _ in range(warmup):
        step_a()
        step_b()
    sync(device)
    times: Dict[str, List[float]] = {"a": [], "b": []}
    for i in range(steps):
        order = (("a", step_a), ("b", step_b)) if i % 2 == 0 else (("b", step_b), ("a", step_a))
        for key, fn in order:
            start = time.perf_counter()
            fn()
            sync(device)
            times[key].append(time.perf_counter() - start)
    med_a, med_b = statistics.median(times["a"]), statistics.median(times["b"])
    pair = [b / a for a, b in zip(times["a"], times["b"])]
    return {"dcvit_ms": med_a * 1e3, "vit_ms": med_b * 1e3, "ratio": med_b / med_a,
            "ratio_pairwise_median": statistics.median(pair),
            "dcvit_times_ms": [t * 1e3 for t in times["a"]], "vit_times_ms": [t * 1e3 for t in times["b"]]}
