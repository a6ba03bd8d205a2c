"""Exported DCViT against its exported ViT baseline: ONNX Runtime (``dcvit-bench --onnx``) and
AOTInductor (``dcvit-bench --aoti``).

Both models are exported with ``torch.onnx.export`` (the default, ``torch.export``-based
exporter, with a dynamic batch dimension) into a temporary folder and run in ONNX Runtime's
CPU provider with ``--threads`` intra-op threads (default 2). At each batch size the two
sessions are timed alternately after warm-up, each run after a short pause (`SETTLE_S`); a
figure is the ratio of the median run times (ViT time / DCViT time), with the ratio of the
best runs next to it. With ``--onnx-before`` DCViT is also
exported with the paper's formulation (the ``reference`` core, ``Einsum`` nodes), the graph
exports had before `dcvit.export_core`, and timed against the same ViT session, so that one
run gives the before -> after table.

``--aoti`` exports both models with ``torch.export`` (dynamic batch) and compiles each into
an AOTInductor package (``torch._inductor.aoti_compile_and_package``, minutes per model on
a small CPU), then times the loaded packages the same way with ``--threads`` torch threads.
``--aoti-cpp`` adds DCViT exported with the C++ attention core kept as its custom op
(``attention_impl("cpp")``): that package runs only where dcvit is imported, since the op
is registered by dcvit.
"""
import contextlib
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Sequence

import torch

from .timing import time_alternately

__all__ = ["export_onnx", "onnx_ops", "bench_onnx", "bench_aoti"]


def export_onnx(model: torch.nn.Module, path: Path, img_size: int, formulation: str = "export") -> Path:
    """Export ``model`` (eval) to ONNX at ``path`` with a dynamic batch dimension.

    ``formulation`` "export": DCMHA layers emit `dcvit.export_core`'s graph (the default of
    any export); "reference": the paper's formulation (``attention_impl("reference")``).
    """
    from ..fused import attention_impl
    x = torch.randn(2, 3, img_size, img_size)
    ctx = attention_impl("reference") if formulation == "reference" else contextlib.nullcontext()
    with ctx, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (x,), str(path), input_names=["x"],
                          dynamic_shapes=({0: "batch"},), verbose=False)
    return path


def onnx_ops(path: Path) -> Dict[str, int]:
    """How many nodes of each op type the ONNX graph at ``path`` holds (functions included)."""
    import onnx
    proto = onnx.load(str(path), load_external_data=False)
    counts: Dict[str, int] = {}
    for graph_nodes in [proto.graph.node, *(f.node for f in proto.functions)]:
        for node in graph_nodes:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _session(path: Path, threads: int, spinning: bool):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


# Pause before each timed run. A session's idle worker threads spin for a while after a run;
# timed right after the other model's run, a model shares the cores with those spinning
# threads (on 2 cores ViT-S/16 at batch 1 measured 88 ms instead of 54 ms).
SETTLE_S = 0.05


def _timed(runs: Dict[str, Callable[[], Any]], warmup: int, steps: int) -> Dict[str, Dict[str, float]]:
    """Median and best milliseconds of each run (`dcvit.bench.timing.time_alternately`, each
    run after a `SETTLE_S` pause)."""
    times = time_alternately(runs, torch.device("cpu"), warmup, steps, settle_s=SETTLE_S)
    return {"median": {n: statistics.median(t) * 1e3 for n, t in times.items()},
            "best": {n: min(t) * 1e3 for n, t in times.items()}}


def _figure(timed: Dict[str, Dict[str, float]]) -> Dict[str, Any]:
    """A batch size's figure: every run's median and best ms, and ViT's time over each
    DCViT variant's (``ratio``: medians, ``ratio_best``: best runs; ``_<variant>`` suffixes
    for the variants after ``dcvit``)."""
    fig: Dict[str, Any] = {f"{k}_ms": v for k, v in timed["median"].items()}
    fig.update({f"{k}_best_ms": v for k, v in timed["best"].items()})
    for k in timed["median"]:
        if k.startswith("dcvit"):
            suffix = k[len("dcvit"):]
            fig["ratio" + suffix] = timed["median"]["vit"] / timed["median"][k]
            fig["ratio_best" + suffix] = timed["best"]["vit"] / timed["best"][k]
    return fig


def bench_onnx(model: str, baseline: str, img_size: int = 224, depth: int = 0,
               batches: Sequence[int] = (1, 16), threads: int = 2, steps: int = 9, warmup: int = 2,
               before: bool = False, spinning: bool = True) -> Dict[str, Any]:
    """Export ``model`` and ``baseline`` and time them side by side in ONNX Runtime.

    Returns ``{"exports": {name: {"export_s", "ops"}}, "figures": {"b1": {...}, ...}}`` where
    each figure holds the median ms of every session (``vit_ms``, ``dcvit_ms`` and, with
    ``before``, ``dcvit_reference_ms``), their best runs (``*_best_ms``) and the ratios
    ``ratio`` (= vit / dcvit), ``ratio_best`` and ``ratio_reference``.
    """
    try:
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"dcvit-bench --onnx needs onnxruntime and onnxscript: pip install 'dcvit[onnx]' ({e})")
    import numpy as np
    built = _build(model, baseline, img_size, depth)
    plan = [("vit", "vit", "export"), ("dcvit", "dcvit", "export")]
    if before:
        plan.append(("dcvit_reference", "dcvit", "reference"))
    out: Dict[str, Any] = {"exports": {}, "figures": {}}
    sessions = {}
    with tempfile.TemporaryDirectory(prefix="dcvit-onnx-") as tmp:
        for key, which, formulation in plan:
            path = Path(tmp) / f"{key}.onnx"
            start = time.perf_counter()
            export_onnx(built[which], path, img_size, formulation)
            out["exports"][key] = {"export_s": time.perf_counter() - start, "ops": onnx_ops(path)}
            sessions[key] = _session(path, threads, spinning)
            print(f"  exported {key:<16} in {out['exports'][key]['export_s']:5.1f} s: "
                  f"{sum(out['exports'][key]['ops'].values())} nodes, "
                  f"{out['exports'][key]['ops'].get('Einsum', 0)} Einsum", flush=True)
        for b in batches:
            x = np.random.default_rng(0).standard_normal((b, 3, img_size, img_size), dtype=np.float32)
            runs = {k: (lambda s=s: s.run(None, {"x": x})) for k, s in sessions.items()}
            fig = _figure(_timed(runs, warmup, steps))
            out["figures"][f"b{b}"] = fig
            line = (f"  batch {b:<3} ViT {fig['vit_ms']:8.1f} ms  DCViT {fig['dcvit_ms']:8.1f} ms  "
                    f"ratio {fig['ratio']:.3f} (best runs {fig['ratio_best']:.3f})")
            if before:
                line += f"  (reference: {fig['dcvit_reference_ms']:8.1f} ms, ratio {fig['ratio_reference']:.3f})"
            print(line, flush=True)
    out.update(threads=threads, steps=steps, warmup=warmup, img_size=img_size,
               onnxruntime=onnxruntime.__version__, spinning=spinning)
    return out


def _build(model: str, baseline: str, img_size: int, depth: int) -> Dict[str, torch.nn.Module]:
    import timm
    import dcvit  # noqa: F401  (registers the DCViT models)
    kwargs: Dict[str, Any] = dict(img_size=img_size)
    if depth:
        kwargs["depth"] = depth
    built = {}
    for key, name in (("vit", baseline), ("dcvit", model)):
        torch.manual_seed(0)
        built[key] = timm.create_model(name, **kwargs).eval()
    return built


def bench_aoti(model: str, baseline: str, img_size: int = 224, depth: int = 0,
               batches: Sequence[int] = (1, 16), threads: int = 2, steps: int = 9, warmup: int = 2,
               cpp: bool = False) -> Dict[str, Any]:
    """Compile ``model`` and ``baseline`` with AOTInductor and time the packages side by side.

    Returns ``{"compiles": {name: seconds}, "figures": {"b1": {...}, ...}}``, each figure
    with the median and best ms of every package, ``ratio`` (= vit / dcvit) and
    ``ratio_best``, and with ``cpp`` also ``dcvit_cpp_ms`` and ``ratio_cpp``.
    """
    from ..fused import attention_impl
    built = _build(model, baseline, img_size, depth)
    plan = [("vit", "vit", "auto"), ("dcvit", "dcvit", "auto")] + ([("dcvit_cpp", "dcvit", "cpp")] if cpp else [])
    torch.set_num_threads(threads)
    x = torch.randn(2, 3, img_size, img_size)
    batch = torch.export.Dim("batch", min=1, max=max(256, *batches))
    out: Dict[str, Any] = {"compiles": {}, "figures": {}}
    packages = {}
    with tempfile.TemporaryDirectory(prefix="dcvit-aoti-") as tmp:
        for key, which, core in plan:
            start = time.perf_counter()
            with attention_impl(core), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                program = torch.export.export(built[which], (x,), dynamic_shapes=({0: batch},))
                path = torch._inductor.aoti_compile_and_package(program, package_path=str(Path(tmp) / f"{key}.pt2"))
            packages[key] = torch._inductor.aoti_load_package(path)
            out["compiles"][key] = time.perf_counter() - start
            print(f"  compiled {key:<10} in {out['compiles'][key]:6.1f} s", flush=True)
        for b in batches:
            xb = torch.randn(b, 3, img_size, img_size, generator=torch.Generator().manual_seed(0))
            runs = {k: (lambda p=p: p(xb)) for k, p in packages.items()}
            with torch.no_grad():
                fig = _figure(_timed(runs, warmup, steps))
            line = (f"  batch {b:<3} ViT {fig['vit_ms']:8.1f} ms  DCViT {fig['dcvit_ms']:8.1f} ms  "
                    f"ratio {fig['ratio']:.3f} (best runs {fig['ratio_best']:.3f})")
            if cpp:
                line += f"  (C++ core kept: {fig['dcvit_cpp_ms']:8.1f} ms, ratio {fig['ratio_cpp']:.3f})"
            out["figures"][f"b{b}"] = fig
            print(line, flush=True)
    out.update(threads=threads, steps=steps, warmup=warmup, img_size=img_size)
    return out
