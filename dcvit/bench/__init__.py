"""Measurement: everything that times DCViT, kept apart from the model code.

* `benchmark` — ``dcvit-bench`` (``python -m dcvit.bench``): DCViT against its ViT baseline,
  side by side (eager, compiled, one layer, peak memory, the chosen attention core);
* `export` — ``dcvit-bench --onnx`` / ``--aoti``: the exported models in ONNX Runtime and
  AOTInductor;
* `core` — ``python -m dcvit.bench.core``: DCMHA's attention core alone, robust to a busy machine;
* `timing` — the one step timer all of them (and ``dcvit-report``) use.

The model code (`dcvit.attention`, `dcvit.core`, `dcvit.models`, ...) never imports this
package; it imports the model code. Measurement tools that need the trainer
(``scripts/loop_overhead.py``, ``scripts/bench_pipeline.py``) stay in ``scripts/``, since a
library subpackage cannot import ``train_imagenet``.
"""
from .benchmark import TARGETS, main, run

__all__ = ["main", "run", "TARGETS"]
