"""``dcvit-report``: the parameter-efficiency table of ViT and DCViT, measured here.

::

    dcvit-report --models vit_small_patch16_224 dcvit_small_patch16_224 --out DIR
    dcvit-report --results runs/*/eval.json --throughput --detail --out DIR

writes ``DIR/report.md``, ``report.csv``, ``report.json`` and ``report.png``. Each model is
counted with `dcvit.accounting` (fvcore MACs, exact handles) and compared with its baseline
(``dcvit_X`` against ``vit_X`` built with the same non-DCMHA options). Accuracy comes from
the evaluation files the trainer writes (``eval.json``: ``model``, ``top1``, ``top5``,
``num_samples`` and optionally ``model_kwargs``/``img_size``/``num_classes``); the report
never imports the trainer. The paper's ImageNet numbers are listed apart, as quoted.
"""
import argparse
import csv
import difflib
import io
import json
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import timm
import torch
from torch import nn

from .accounting import Accounting, account, input_shape_of, module_table
from .attention import DCMHA_OPTIONS
from .benchmark import time_pair
from .cli import parse_kwargs
from .io import atomic_write
from .models import DCVIT_MODELS

__all__ = ["ModelSpec", "param_efficiency_report", "write_report", "read_results",
           "measure_throughput", "measure_pair", "DEFAULT_MODELS", "QUOTED", "main"]

SIZES = ("tiny", "small", "medium", "base")
DEFAULT_MODELS = [f"{family}_{size}_patch16_224" for size in SIZES for family in ("vit", "dcvit")]

# Published ImageNet-1k top-1 (SPEC §4). Quoted, never measured here.
_PAPER = "DCFormer paper (Xiao et al., ICML 2024, arXiv 2405.08553)"
_DEIT = "DeiT paper (Touvron et al., ICML 2021)"
QUOTED: List[Dict[str, Any]] = [
    dict(model="vit_small_patch16_224", label="ViT-S/16", recipe="DeiT", epochs=300,
         params_quoted="22M", top1=79.8, source=_PAPER),
    dict(model="dcvit_small_patch16_224", label="DCViT-S/16", recipe="DeiT", epochs=300,
         params_quoted="1.03x", top1=80.1, source=_PAPER),
    dict(model="vit_medium_patch16_224", label="ViT-M/16", recipe="90-epoch", epochs=90,
         params_quoted="1.72x", top1=67.1, source=_PAPER),
    dict(model="dcvit_small_patch16_224", label="DCViT-S/16", recipe="90-epoch", epochs=90,
         params_quoted="1.03x", top1=68.0, source=_PAPER),
    dict(model="vit_tiny_patch16_224", label="DeiT-Ti", recipe="DeiT", epochs=300,
         params_quoted="5M", top1=72.2, source=_DEIT),
    dict(model="vit_base_patch16_224", label="DeiT-B", recipe="DeiT", epochs=300,
         params_quoted="86M", top1=81.8, source=_DEIT),
]

_ALIASES = {name.split("_patch")[0]: name for name in DCVIT_MODELS}   # dcvit_small -> ..._224
_MODEL_ONLY = set(DCMHA_OPTIONS) | {"dcmha_layers"}                   # not given to the baseline
_RESULT_KWARGS = ("img_size", "num_classes")


class ReportError(ValueError):
    """A bad model name, option or results file; the message names it and the fix."""


@dataclass(frozen=True)
class ModelSpec:
    """A timm model name and the keyword arguments it was built with."""

    name: str
    kwargs: Tuple[Tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, name: str, kwargs: Optional[Dict[str, Any]] = None) -> "ModelSpec":
        def freeze(value: Any) -> Any:  # lists (dcmha_layers=[0, 1]) become hashable tuples
            return tuple(freeze(v) for v in value) if isinstance(value, (list, tuple)) else value
        return cls(name, tuple(sorted((k, freeze(v)) for k, v in (kwargs or {}).items())))

    @property
    def kwargs_dict(self) -> Dict[str, Any]:
        return dict(self.kwargs)

    @property
    def family(self) -> str:
        return "dcvit" if self.name.startswith("dcvit") else "vit" if self.name.startswith("vit") else "other"

    def baseline(self) -> "ModelSpec":
        """The plain ViT a DCViT is compared with; any other model is its own baseline."""
        if self.family != "dcvit":
            return self
        canonical = _ALIASES.get(self.name, self.name)
        kwargs = {k: v for k, v in self.kwargs if k not in _MODEL_ONLY}
        return ModelSpec.of("vit" + canonical[len("dcvit"):], kwargs)

    def build(self) -> nn.Module:
        check_model_name(self.name)
        try:
            return timm.create_model(self.name, **self.kwargs_dict)
        except (TypeError, ValueError, AssertionError) as e:
            raise ReportError(f"cannot build {self.name} with model kwargs {self.kwargs_dict}: {e}") from e

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs)
        return f"{self.name}({args})" if args else self.name


def check_model_name(name: str) -> None:
    """Raise `ReportError` listing close matches if timm does not know ``name``."""
    if timm.is_model(name):
        return
    known = timm.list_models()
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
    stem = re.split(r"[_\d]", name, maxsplit=1)[0] or name
    close += [m for m in timm.list_models(f"*{stem}*") if m not in close][:max(0, 8 - len(close))]
    hint = f"; close matches: {', '.join(close)}" if close else ""
    raise ReportError(f"unknown model {name!r}{hint} (list them with timm.list_models('*{stem}*'))")


def parse_model_kwargs(items: Sequence[str]) -> Dict[str, Any]:
    """``["img_size=32", "class_token=false"]`` -> a dict of values (`dcvit.cli.parse_kwargs`)."""
    try:
        return parse_kwargs(items)
    except ValueError as e:
        raise ReportError(str(e)) from e


def read_results(path: str) -> Dict[str, Any]:
    """Read one evaluation file (``eval.json`` of the trainer) and check its keys."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ReportError(f"cannot read results file {path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReportError(f"results file {path} is not valid JSON ({e}); expected the eval.json "
                          "the trainer writes") from e
    if not isinstance(data, dict):
        raise ReportError(f"results file {path} holds a {type(data).__name__}, expected an object "
                          '{"model": ..., "top1": ..., "top5": ..., "num_samples": ...}')
    missing = [k for k in ("model", "top1") if k not in data]
    if missing:
        raise ReportError(f"results file {path} lacks {missing}; it has keys {sorted(data)}")
    for key in ("top1", "top5"):
        value = data.get(key)
        if value is not None and not (isinstance(value, (int, float)) and 0 <= value <= 100):
            raise ReportError(f"results file {path}: {key}={value!r} is not a percentage in [0, 100]")
    if not isinstance(data.get("model_kwargs", {}), dict):
        raise ReportError(f"results file {path}: model_kwargs must be an object, "
                          f"got {data['model_kwargs']!r}")
    return data


def results_spec(data: Dict[str, Any], base_kwargs: Dict[str, Any]) -> ModelSpec:
    """The model configuration a results file describes, on top of the CLI's kwargs."""
    kwargs = dict(base_kwargs)
    kwargs.update({k: data[k] for k in _RESULT_KWARGS if data.get(k) is not None})
    kwargs.update(data.get("model_kwargs") or {})
    return ModelSpec.of(data["model"], kwargs)


@torch.inference_mode()
def measure_throughput(model: nn.Module, input_shape: Sequence[int], batch_size: int = 8,
                       steps: int = 5, warmup: int = 2) -> float:
    """Images per second of ``model`` in eval mode: median of ``steps`` timed forwards."""
    was_training = model.training
    model.eval()
    x = torch.randn(batch_size, *input_shape[1:])
    try:
        for _ in range(warmup):
            model(x)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - start)
    finally:
        model.train(was_training)
    return batch_size / statistics.median(times)


@torch.inference_mode()
def measure_pair(model: nn.Module, baseline: nn.Module, input_shape: Sequence[int], batch_size: int = 8,
                 steps: int = 5, warmup: int = 2) -> Dict[str, float]:
    """``model`` against ``baseline`` as SPEC §5 asks: eval forwards timed alternately
    (`dcvit.benchmark.time_pair`), same batch and threads.

    Returns ``img_s`` and ``baseline_img_s`` (from the median step times) and ``ratio`` =
    baseline time / model time (the model's relative throughput).
    """
    modes = model.training, baseline.training
    model.eval()
    baseline.eval()
    x = torch.randn(batch_size, *input_shape[1:])
    try:
        r = time_pair(lambda: model(x), lambda: baseline(x), torch.device("cpu"), warmup, steps)
    finally:
        model.train(modes[0])
        baseline.train(modes[1])
    return {"img_s": batch_size / (r["dcvit_ms"] / 1e3), "baseline_img_s": batch_size / (r["vit_ms"] / 1e3),
            "ratio": r["ratio"]}


@dataclass
class Report:
    rows: List[Dict[str, Any]]
    quoted: List[Dict[str, Any]]
    modules: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)  # spec -> table
    meta: Dict[str, Any] = field(default_factory=dict)


def _pct(value: int, base: int) -> float:
    return round(100.0 * (value / base - 1.0), 3)


def param_efficiency_report(models: Sequence[ModelSpec], results: Sequence[Tuple[str, Dict[str, Any]]] = (),
                            base_kwargs: Optional[Dict[str, Any]] = None, throughput: bool = False,
                            throughput_batch: int = 8, detail: bool = False,
                            log=print) -> Report:
    """Account every model (and its baseline), attach accuracy and throughput.

    One row per model in ``models`` without results, and one per results file (path, data).
    Each distinct configuration is built and counted once.
    """
    entries: List[Tuple[ModelSpec, Optional[str], Optional[Dict[str, Any]]]] = []
    result_specs = [(results_spec(data, base_kwargs or {}), path, data) for path, data in results]
    covered = {spec for spec, _, _ in result_specs}
    entries += [(spec, None, None) for spec in models if spec not in covered]
    entries += result_specs
    for spec, _, _ in entries:
        check_model_name(spec.name)

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
            model, batch = spec.build(), throughput_batch
            if base_spec == spec:
                log(f"[report] timing {spec} (batch {batch})")
                speed[spec, base_spec] = {"img_s": measure_throughput(model, input_shape_of(model), batch)}
            else:
                log(f"[report] timing {spec} and {base_spec} alternately (batch {batch})")
                speed[spec, base_spec] = measure_pair(model, base_spec.build(), input_shape_of(model), batch)
        return speed[spec, base_spec]

    rows = []
    for spec, path, data in entries:
        acc = counted(spec)
        base_spec = spec.baseline()
        base = counted(base_spec)
        row: Dict[str, Any] = {
            "model": spec.name, "model_kwargs": spec.kwargs_dict, "family": spec.family,
            "input_size": list(acc.input_shape[1:]), "params": acc.params, "macs": acc.macs,
            "gmacs": round(acc.gmacs, 4), "baseline": base_spec.name,
            "extra_params_pct": _pct(acc.params, base.params),
            "extra_macs_pct": _pct(acc.macs, base.macs),
            "skipped_ops": acc.skipped_ops,
        }
        if throughput:
            t = timed(spec, base_spec)
            row["throughput_img_s"] = round(t["img_s"], 2)
            if "ratio" in t:
                row["baseline_throughput_img_s"] = round(t["baseline_img_s"], 2)
                row["throughput_ratio"] = round(t["ratio"], 4)
        if data is not None:
            row.update({k: data[k] for k in ("top1", "top5", "num_samples", "dataset", "ema")
                        if data.get(k) is not None})
            row["results"] = path
        if detail:
            tables.setdefault(str(spec), module_table(acc))
        rows.append(row)
    meta = {
        "convention": "fvcore: one multiply-add = one FLOP (MACs); matrix products and "
                      "LayerNorm (5/element) counted, element-wise ops not (listed in skipped_ops)",
        "batch_size": 1,
        "versions": {"torch": torch.__version__, "timm": timm.__version__, "python": platform.python_version()},
    }
    if throughput:
        meta["throughput"] = {"batch_size": throughput_batch, "steps": 5, "statistic": "median",
                              "method": "eval forwards; a model and its baseline timed alternately "
                                        "in one process (SPEC §5), throughput_ratio = baseline time / "
                                        "model time; a model that is its own baseline timed alone",
                              "threads": torch.get_num_threads(), "machine": platform.machine(),
                              "processor": platform.processor() or platform.machine()}
    return Report(rows=rows, quoted=[dict(q, kind="quoted") for q in QUOTED], modules=tables, meta=meta)


# ---------------------------------------------------------------------------------- writing
def _fmt(value: Any, spec: str = "") -> str:
    return "" if value is None else format(value, spec)


def _kwargs_text(kwargs: Dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in kwargs.items())


def _skipped_text(ops: Dict[str, int]) -> str:
    return ", ".join(f"{k.replace('aten::', '')}×{v}" for k, v in ops.items()) or "none"


CSV_COLUMNS = ["model", "model_kwargs", "family", "input_size", "params", "macs", "gmacs", "baseline",
               "extra_params_pct", "extra_macs_pct", "top1", "top5", "num_samples",
               "throughput_img_s", "baseline_throughput_img_s", "throughput_ratio", "skipped_ops",
               "results"]


def report_csv(report: Report) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in report.rows:
        flat = dict(row)
        flat["model_kwargs"] = _kwargs_text(row["model_kwargs"])
        flat["input_size"] = "x".join(str(v) for v in row["input_size"])
        flat["skipped_ops"] = _skipped_text(row["skipped_ops"])
        writer.writerow(flat)
    return buf.getvalue()


def report_markdown(report: Report, command: str) -> str:
    lines = ["# DCViT parameter-efficiency report", "",
             f"Command: `{command}`  ",
             f"Versions: {', '.join(f'{k} {v}' for k, v in report.meta['versions'].items())}", "",
             "## Measured here", "",
             "MACs in fvcore's convention (one multiply-add = one FLOP; matrix products and "
             "LayerNorms), batch 1. Extra % against the baseline ViT with the same options.", ""]
    has_acc = any("top1" in r for r in report.rows)
    has_speed = any("throughput_img_s" in r for r in report.rows)
    head = ["model", "options", "input", "params", "extra params", "GMACs", "extra MACs"]
    head += ["top-1", "top-5", "samples"] if has_acc else []
    head += ["img/s", "img/s vs baseline"] if has_speed else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report.rows:
        cells = [f"`{r['model']}`", _kwargs_text(r["model_kwargs"]), "x".join(map(str, r["input_size"])),
                 f"{r['params']:,}", f"{r['extra_params_pct']:+.2f} %", f"{r['gmacs']:.3f}",
                 f"{r['extra_macs_pct']:+.2f} %"]
        if has_acc:
            cells += [_fmt(r.get("top1"), ".2f"), _fmt(r.get("top5"), ".2f"), _fmt(r.get("num_samples"))]
        if has_speed:
            cells += [_fmt(r.get("throughput_img_s"), ".1f"), _fmt(r.get("throughput_ratio"), ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    if has_speed:
        t = report.meta["throughput"]
        lines += ["", f"img/s: eval mode, batch {t['batch_size']}, median of {t['steps']} forwards, "
                      f"{t['threads']} threads on this machine ({t['processor']}). A model and its baseline "
                      "are timed alternately in one process (SPEC §5); \"vs baseline\" is baseline time / "
                      "model time. A model that is its own baseline is timed alone; absolute img/s "
                      "depend on the machine and its load."]
    sources = [r for r in report.rows if r.get("results")]
    if sources:
        lines += ["", "Accuracy from: " + ", ".join(f"`{r['results']}`" for r in sources) + "."]
    lines += ["", "### Ops fvcore skipped (not counted in MACs)", "",
              "| model | options | skipped ops (occurrences) |", "|---|---|---|"]
    lines += [f"| `{r['model']}` | {_kwargs_text(r['model_kwargs'])} | {_skipped_text(r['skipped_ops'])} |"
              for r in report.rows]
    lines += ["", "## Quoted from the papers (ImageNet-1k, not measured here)", "",
              "| model | recipe | epochs | params (quoted) | top-1 (quoted) | source |", "|---|---|---|---|---|---|"]
    lines += [f"| {q['label']} (`{q['model']}`) | {q['recipe']} | {q['epochs']} | {q['params_quoted']} | "
              f"{q['top1']:.1f} | {q['source']} |" for q in report.quoted]
    for name, table in report.modules.items():
        lines += ["", f"## Per module: `{name}`", "", "| module | params | MACs | % MACs |", "|---|---|---|---|"]
        lines += [f"| {t['module']} | {t['params']:,} | {t['macs']:,} | {t['macs_pct']:.2f} |" for t in table]
    return "\n".join(lines) + "\n"


def _short(name: str) -> str:
    m = re.search(r"(tiny|small|medium|base|large)", name)
    return {"tiny": "Ti", "small": "S", "medium": "M", "base": "B", "large": "L"}[m.group(1)] if m else name


def report_png(report: Report) -> bytes:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.rows
    with_acc = [r for r in rows if "top1" in r]
    styles = {"vit": ("tab:blue", "o", "ViT"), "dcvit": ("tab:red", "s", "DCViT"), "other": ("tab:gray", "^", "other")}
    axes_spec = ([("params", 1e6, "parameters (M)"), ("macs", 1e9, "GMACs")] if with_acc
                 else [("params", 1e6, "parameters (M)")])
    fig, axes = plt.subplots(1, len(axes_spec), figsize=(6 * len(axes_spec), 4.5), squeeze=False)
    for ax, (key, scale, label) in zip(axes[0], axes_spec):
        for family, (color, marker, name) in styles.items():
            pts = sorted(((r[key] / scale, r["top1"] if with_acc else r["gmacs"], _short(r["model"]))
                          for r in (with_acc or rows) if r["family"] == family))
            if not pts:
                continue
            xs, ys, names = zip(*pts)
            ax.plot(xs, ys, marker=marker, color=color, label=name)
            for x, y, n in pts:
                ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel("top-1 (%)" if with_acc else "GMACs")
        ax.grid(alpha=0.3)
        ax.legend()
    datasets = sorted({str(r["dataset"]) for r in with_acc if r.get("dataset")})
    on = f" on {', '.join(datasets)}" if datasets else ""
    fig.suptitle(f"measured top-1{on} vs size" if with_acc else "parameters vs GMACs (fvcore, batch 1)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()


def write_report(report: Report, out: str, command: str = "dcvit-report") -> Dict[str, Path]:
    """Write report.md/.csv/.json/.png under ``out`` (created), each atomically."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"command": command, **report.meta, "rows": report.rows, "quoted": report.quoted}
    if report.modules:
        payload["modules"] = report.modules
    files = {
        "report.md": report_markdown(report, command).encode(),
        "report.csv": report_csv(report).encode(),
        "report.json": (json.dumps(payload, indent=2) + "\n").encode(),
        "report.png": report_png(report),
    }
    paths = {}
    for name, data in files.items():
        paths[name] = out_dir / name
        atomic_write(paths[name], lambda tmp, data=data: Path(tmp).write_bytes(data))
    return paths


# ---------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dcvit-report", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", metavar="NAME",
                   help="timm model names (default: ViT and DCViT at Ti/S/M/B, unless --results is given)")
    p.add_argument("--results", nargs="+", default=[], metavar="FILE",
                   help="evaluation files (eval.json) to add measured accuracy; their model_kwargs/"
                        "img_size/num_classes set the configuration that is counted")
    p.add_argument("--out", default="report", metavar="DIR", help="output directory (default: ./report)")
    p.add_argument("--img-size", type=int, help="input resolution of every model (default: the model's)")
    p.add_argument("--model-kwargs", nargs="+", default=[], metavar="KEY=VALUE",
                   help="extra timm.create_model kwargs for every model, e.g. patch_size=4 num_classes=10")
    p.add_argument("--throughput", action="store_true", help="add measured img/s on this machine")
    p.add_argument("--throughput-batch", type=int, default=8, metavar="N", help="batch size for --throughput")
    p.add_argument("--detail", action="store_true", help="add the per-module table of every model")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        base_kwargs = parse_model_kwargs(args.model_kwargs)
        if args.img_size is not None:
            base_kwargs["img_size"] = args.img_size
        results = [(path, read_results(path)) for path in args.results]
        names = args.models if args.models is not None else ([] if results else DEFAULT_MODELS)
        models = [ModelSpec.of(name, base_kwargs) for name in names]
        report = param_efficiency_report(models, results, base_kwargs, args.throughput,
                                         args.throughput_batch, args.detail,
                                         log=lambda m: print(m, file=sys.stderr))
    except ReportError as e:
        parser.exit(2, f"dcvit-report: error: {e}\n")
    command = "dcvit-report " + " ".join(sys.argv[1:] if argv is None else argv)
    paths = write_report(report, args.out, command)
    for r in report.rows:
        print(f"{str(ModelSpec.of(r['model'], r['model_kwargs'])):50s} params {r['params']:>12,} "
              f"({r['extra_params_pct']:+.2f} %)  MACs {r['macs']:>15,} ({r['extra_macs_pct']:+.2f} %)"
              + (f"  top-1 {r['top1']:.2f}" if "top1" in r else ""))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
