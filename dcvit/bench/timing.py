"""The step timer of every measurement: ``dcvit-bench`` (eager, compiled, ONNX Runtime,
AOTInductor), ``python -m dcvit.bench.core`` and ``dcvit-report`` (method: docs/spec.md §5).

A figure is a median over timed steps after untimed warm-up steps; a comparison times its
runs alternately (A, B, then B, A, ...) in one process, so all see the same machine load.
CUDA work is synchronised before each clock reading.
"""
import statistics
import time
from typing import Any, Callable, Dict, List

import torch

__all__ = ["sync", "time_steps", "time_alternately", "time_pair"]


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], None], device: torch.device, warmup: int, steps: int,
               clock: Callable[[], float] = time.perf_counter) -> List[float]:
    """Seconds of each of ``steps`` calls of ``step``, after ``warmup`` untimed calls, read on
    ``clock`` (wall time; ``time.process_time``, this process's CPU time, on a busy machine)."""
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(steps):
        start = clock()
        step()
        sync(device)
        times.append(clock() - start)
    return times


def time_alternately(runs: Dict[str, Callable[[], Any]], device: torch.device, warmup: int, steps: int,
                     settle_s: float = 0.0) -> Dict[str, List[float]]:
    """Seconds of each run, timed in turn (the order reversed every other round: AB, BA, ...),
    after ``warmup`` untimed rounds; each timed run after a ``settle_s`` pause (so that one
    ONNX Runtime session's spinning threads do not run into the next one's time)."""
    names = list(runs)
    for _ in range(warmup):
        for n in names:
            runs[n]()
    sync(device)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for i in range(steps):
        for n in (names if i % 2 == 0 else names[::-1]):
            if settle_s:
                time.sleep(settle_s)
            start = time.perf_counter()
            runs[n]()
            sync(device)
            times[n].append(time.perf_counter() - start)
    return times


def time_pair(step_a: Callable[[], None], step_b: Callable[[], None], device: torch.device,
              warmup: int, steps: int) -> Dict[str, Any]:
    """Time A and B alternately (`time_alternately`).

    Returns median milliseconds (``dcvit_ms`` for A, ``vit_ms`` for B), the ratio of the
    medians ``ratio`` = B / A (A's throughput relative to B's) and every step's time.
    """
    times = time_alternately({"a": step_a, "b": step_b}, device, warmup, steps)
    med_a, med_b = statistics.median(times["a"]), statistics.median(times["b"])
    pair = [b / a for a, b in zip(times["a"], times["b"])]
    return {"dcvit_ms": med_a * 1e3, "vit_ms": med_b * 1e3, "ratio": med_b / med_a,
            "ratio_pairwise_median": statistics.median(pair),
            "dcvit_times_ms": [t * 1e3 for t in times["a"]], "vit_times_ms": [t * 1e3 for t in times["b"]]}
