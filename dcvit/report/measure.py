"""The report's rows: each model counted (`dcvit.accounting`) against its baseline, with the
accuracy of its results file and, on request, its measured throughput.

A row is a flat dict (the columns of ``report.json``); each part of it is built by one small
function below, so a new column is one more function and one more line in
`param_efficiency_report`.
"""
import platform
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import timm
import torch

from ..accounting import Accounting, account, analytic_macs, input_shape_of, module_table
from ..schema import EvalResult
from .efficiency import efficiency_rows
from .model_spec import ModelSpec, check_model_name
from .quoted import QUOTED
from .results import results_spec
from .speed import measure_pair, measure_throughput

__all__ = ["Report", "param_efficiency_report"]

# Keys of an evaluation file copied into its row.
RESULT_COLUMNS = ("top1", "top5", "num_samples", "dataset", "val", "ema", "epoch")


@dataclass
class Report:
    rows: List[Dict[str, Any]]
    quoted: List[Dict[str, Any]]
    modules: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)  # spec -> table
    meta: Dict[str, Any] = field(default_factory=dict)
    points: List[Dict[str, Any]] = field(default_factory=list)      # top-1 vs size, by group
    efficiency: List[Dict[str, Any]] = field(default_factory=list)  # `efficiency.efficiency_rows`


def _pct(value: int, base: int) -> float:
    return round(100.0 * (value / base - 1.0), 3)


def accounting_columns(spec: ModelSpec, acc: Accounting, base_spec: ModelSpec, base: Accounting) -> Dict[str, Any]:
    """Parameters and MACs of ``spec`` and how much more they are than its baseline's."""
    return {
        "model": spec.name, "model_kwargs": spec.kwargs_dict, "convert": spec.convert_dict,
        "family": spec.family,
        "input_size": list(acc.input_shape[1:]), "params": acc.params, "macs": acc.macs,
        "gmacs": round(acc.gmacs, 4), "baseline": base_spec.name,
        "baseline_params": base.params, "baseline_macs": base.macs,
        "extra_params_pct": _pct(acc.params, base.params),
        "extra_macs_pct": _pct(acc.macs, base.macs),
        "skipped_ops": acc.skipped_ops,
    }


def throughput_columns(speed: Dict[str, float]) -> Dict[str, Any]:
    """img/s, and against the baseline when the model was timed beside one."""
    cols = {"throughput_img_s": round(speed["img_s"], 2)}
    if "ratio" in speed:
        cols["baseline_throughput_img_s"] = round(speed["baseline_img_s"], 2)
        cols["throughput_ratio"] = round(speed["ratio"], 4)
    return cols


def result_columns(path: str, result: EvalResult) -> Dict[str, Any]:
    """Accuracy (and what it was measured on) from one evaluation file."""
    cols = {k: getattr(result, k) for k in RESULT_COLUMNS if getattr(result, k) is not None}
    cols["results"] = path
    return cols


def report_meta(throughput: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """How the figures were measured: convention, versions and, if timed, the timing setup."""
    meta: Dict[str, Any] = {
        "convention": "fvcore: one multiply-add = one FLOP (MACs); matrix products and "
                      "LayerNorm (5/element) counted, element-wise ops not (listed in skipped_ops)",
        "batch_size": 1,
        "versions": {"torch": torch.__version__, "timm": timm.__version__, "python": platform.python_version()},
    }
    if throughput is not None:
        meta["throughput"] = throughput
    return meta


def throughput_meta(batch_size: int, steps: int, warmup: int, device: torch.device) -> Dict[str, Any]:
    processor = platform.processor() or platform.machine()
    if device.type == "cuda":
        processor = torch.cuda.get_device_name(device)
    return {"batch_size": batch_size, "steps": steps, "warmup": warmup, "statistic": "median",
            "method": "eval forwards; a model and its baseline timed alternately "
                      "in one process (docs/spec.md §5), throughput_ratio = baseline time / "
                      "model time; a model that is its own baseline timed alone",
            "device": str(device), "threads": torch.get_num_threads(), "machine": platform.machine(),
            "processor": processor}


def param_efficiency_report(models: Sequence[ModelSpec], results: Sequence[Tuple[str, EvalResult]] = (),
                            base_kwargs: Optional[Dict[str, Any]] = None, throughput: bool = False,
                            throughput_batch: int = 8, detail: bool = False,
                            log: Callable[[str], Any] = print, *, throughput_steps: int = 5,
                            throughput_warmup: int = 2, device: str = "cpu") -> Report:
    """Account every model (and its baseline), attach accuracy and throughput.

    One row per model in ``models`` without results, and one per results file (path, result).
    Each distinct configuration is built and counted once (on CPU); with ``throughput``,
    models are timed on ``device``, ``throughput_steps`` timed forwards of batch
    ``throughput_batch`` after ``throughput_warmup`` untimed ones.
    """
    entries: List[Tuple[ModelSpec, Optional[str], Optional[EvalResult]]] = []
    result_specs = [(results_spec(result, base_kwargs or {}), path, result) for path, result in results]
    covered = {spec for spec, _, _ in result_specs}
    entries += [(spec, None, None) for spec in models if spec not in covered]
    entries += result_specs
    for spec, _, _ in entries:
        check_model_name(spec.name)

    dev = torch.device(device)
    cache: Dict[ModelSpec, Accounting] = {}
    speed: Dict[Tuple[ModelSpec, ModelSpec], Dict[str, float]] = {}
    tables: Dict[str, List[Dict[str, Any]]] = {}

    def counted(spec: ModelSpec) -> Accounting:
        if spec not in cache:
            log(f"[report] counting {spec}")
            cache[spec] = account(spec.build())
        return cache[spec]

    def timed(spec: ModelSpec, base_spec: ModelSpec) -> Dict[str, float]:
        if (spec, base_spec) not in speed:
            model, batch = spec.build().to(dev), throughput_batch
            shape, how = input_shape_of(model), dict(steps=throughput_steps, warmup=throughput_warmup)
            if base_spec == spec:
                log(f"[report] timing {spec} (batch {batch}, {dev})")
                speed[spec, base_spec] = {"img_s": measure_throughput(model, shape, batch, **how)}
            else:
                log(f"[report] timing {spec} and {base_spec} alternately (batch {batch}, {dev})")
                speed[spec, base_spec] = measure_pair(model, base_spec.build().to(dev), shape, batch, **how)
        return speed[spec, base_spec]

    rows = []
    for spec, path, result in entries:
        base_spec = spec.baseline()
        row = accounting_columns(spec, counted(spec), base_spec, counted(base_spec))
        if throughput:
            row.update(throughput_columns(timed(spec, base_spec)))
        if result is not None:
            row.update(result_columns(path, result))
        if detail:
            tables.setdefault(str(spec), module_table(counted(spec)))
        rows.append(row)
    timing = throughput_meta(throughput_batch, throughput_steps, throughput_warmup, dev) if throughput else None
    points = measured_points(rows) + quoted_points(QUOTED, log)
    return Report(rows=rows, quoted=[dict(q, kind="quoted") for q in QUOTED], modules=tables,
                  meta=report_meta(timing), points=points, efficiency=efficiency_rows(points))


def _size(name: str, log: Callable[[str], Any], cache: Dict[str, Tuple[int, int]] = {}) -> Tuple[int, int]:
    """Parameters and MACs (`analytic_macs`, equal to fvcore's count) of a default model."""
    if name not in cache:
        log(f"[report] sizing {name} (quoted)")
        model = ModelSpec.of(name).build()
        cache[name] = (sum(p.numel() for p in model.parameters()), analytic_macs(model)["total"])
    return cache[name]


def quoted_points(quoted: Sequence[Dict[str, Any]], log: Callable[[str], Any]) -> List[Dict[str, Any]]:
    """The quoted rows of groups (source, recipe, epoch) that hold a DCViT, with their sizes."""
    def group(q: Dict[str, Any]) -> Tuple[str, ...]:
        return ("quoted", q["recipe"], f"epoch {q['at_epoch']} of {q['epochs']}")
    with_dc = {group(q) for q in quoted if ModelSpec.of(q["model"]).family == "dcvit"}
    points = []
    for q in quoted:
        if group(q) not in with_dc:
            continue
        spec = ModelSpec.of(q["model"])
        params, macs = _size(q["model"], log)
        base_params, base_macs = _size(spec.baseline().name, log)
        points.append(dict(label=q["label"], family=spec.family, group=group(q), top1=q["top1"],
                           params=params, macs=macs, baseline_params=base_params, baseline_macs=base_macs))
    return points


def measured_points(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows with a top-1, grouped by dataset (else val path) and epoch (eval-eNNNN.json) or final."""
    points = []
    for r in rows:
        if "top1" not in r:
            continue
        epoch = f"epoch {r['epoch']}" if r.get("epoch") is not None else "final"
        points.append(dict(label=f"{r['model']}" + (" (EMA)" if r.get("ema") else ""), family=r["family"],
                           group=("measured", str(r.get("dataset") or r.get("val") or "eval.json"), epoch),
                           top1=r["top1"], params=r["params"], macs=r["macs"],
                           baseline_params=r["baseline_params"], baseline_macs=r["baseline_macs"]))
    return points
