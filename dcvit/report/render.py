"""A `Report` as text and files: ``report.md`` (sections), ``.csv``, ``.json`` and ``.png``.

The Markdown is a list of sections (`MARKDOWN_SECTIONS`), each a function of the report
returning its lines (empty when it has nothing to show); a new section is one function
and one entry in that list.
"""
import csv
import io
import json
from pathlib import Path
from typing import Any, Callable, Dict, List

from ..io import atomic_write
from .efficiency import group_text
from .measure import Report
from .plot import report_png

__all__ = ["CSV_COLUMNS", "MARKDOWN_SECTIONS", "report_csv", "report_markdown", "report_json",
           "write_report"]


def _fmt(value: Any, spec: str = "") -> str:
    return "" if value is None else format(value, spec)


def _kwargs_text(kwargs: Dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in kwargs.items())


def _model_text(row: Dict[str, Any]) -> str:
    """The model's name; a converted one as ``name`` + DCMHA (dcvit.convert) and its options."""
    if row.get("convert") is None:
        return f"`{row['model']}`"
    return f"`{row['model']}` + DCMHA ({_kwargs_text(row['convert']) or 'default options'})"


def _skipped_text(ops: Dict[str, int]) -> str:
    return ", ".join(f"{k.replace('aten::', '')}×{v}" for k, v in ops.items()) or "none"


# ---------------------------------------------------------------------------------- CSV
CSV_COLUMNS = ["model", "model_kwargs", "convert", "family", "input_size", "params", "macs", "gmacs", "baseline",
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
        flat["convert"] = "" if row.get("convert") is None else _kwargs_text(row["convert"]) or "default"
        flat["input_size"] = "x".join(str(v) for v in row["input_size"])
        flat["skipped_ops"] = _skipped_text(row["skipped_ops"])
        writer.writerow(flat)
    return buf.getvalue()


# ---------------------------------------------------------------------------------- JSON
def report_json(report: Report, command: str) -> str:
    payload = {"command": command, **report.meta, "rows": report.rows, "quoted": report.quoted,
               "efficiency": [dict(e, group=list(e["group"])) for e in report.efficiency]}
    if report.modules:
        payload["modules"] = report.modules
    return json.dumps(payload, indent=2) + "\n"


# ---------------------------------------------------------------------------------- Markdown
def measured_section(report: Report) -> List[str]:
    lines = ["## Measured here", "",
             "MACs in fvcore's convention (one multiply-add = one FLOP; matrix products and "
             "LayerNorms), batch 1. Extra % against the baseline ViT with the same options (a "
             "model converted to DCMHA: against the original).", ""]
    has_acc = any("top1" in r for r in report.rows)
    has_speed = any("throughput_img_s" in r for r in report.rows)
    head = ["model", "options", "input", "params", "extra params", "GMACs", "extra MACs"]
    head += ["top-1", "top-5", "samples"] if has_acc else []
    head += ["img/s", "img/s vs baseline"] if has_speed else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report.rows:
        cells = [_model_text(r), _kwargs_text(r["model_kwargs"]), "x".join(map(str, r["input_size"])),
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
                      f"{t['threads']} threads on this machine ({t['processor']}, {t['device']}). A model and "
                      "its baseline are timed alternately in one process (docs/spec.md §5); \"vs baseline\" "
                      "is baseline time / model time. A model that is its own baseline is timed alone; "
                      "absolute img/s depend on the machine and its load."]
    sources = [r for r in report.rows if r.get("results")]
    if sources:
        lines += ["", "Accuracy from: " + ", ".join(f"`{r['results']}`" for r in sources) + "."]
    return lines


def skipped_section(report: Report) -> List[str]:
    lines = ["### Ops fvcore skipped (not counted in MACs)", "",
             "| model | options | skipped ops (occurrences) |", "|---|---|---|"]
    return lines + [f"| {_model_text(r)} | {_kwargs_text(r['model_kwargs'])} | {_skipped_text(r['skipped_ops'])} |"
                    for r in report.rows]


def quoted_section(report: Report) -> List[str]:
    lines = ["## Quoted from the papers (ImageNet-1k, not measured here)", "",
             "| model | recipe | epoch | params (quoted) | top-1 (quoted) | source |", "|---|---|---|---|---|---|"]
    return lines + [f"| {q['label']} (`{q['model']}`) | {q['recipe']} | {q['at_epoch']} of {q['epochs']} | "
                    f"{q['params_quoted']} | {q['top1']:.1f} | {q['source']} |" for q in report.quoted]


def efficiency_section(report: Report) -> List[str]:
    if not report.efficiency:
        return []
    lines = ["## Efficiency multiplier", "",
             "The params and MACs a plain ViT would need for each DCViT's top-1: the baselines of "
             "the same group (source, recipe, epoch) interpolated linearly in log(params) and "
             "log(MACs); as a multiple of the DCViT's own size and of its baseline's. Outside "
             "the baselines' top-1 range: ≥ (or ≤) the size of the end baseline, with a "
             "log-linear extrapolation of the two end baselines where there are two.", "",
             "| model | group | top-1 | baselines | params needed × model | × its baseline | "
             "MACs needed × model | × its baseline |", "|---|---|---|---|---|---|---|---|"]
    return lines + [f"| {e['label']} | {group_text(e['group'])} | {e['top1']:.1f} | {', '.join(e['baselines'])} | "
                    f"{e['params_x']} | {e['params_x_baseline']} | {e['macs_x']} | {e['macs_x_baseline']} |"
                    for e in report.efficiency]


def modules_section(report: Report) -> List[str]:
    lines: List[str] = []
    for name, table in report.modules.items():
        lines += ([""] if lines else []) + [f"## Per module: `{name}`", "",
                                             "| module | params | MACs | % MACs |", "|---|---|---|---|"]
        lines += [f"| {t['module']} | {t['params']:,} | {t['macs']:,} | {t['macs_pct']:.2f} |" for t in table]
    return lines


MARKDOWN_SECTIONS: List[Callable[[Report], List[str]]] = [
    measured_section, skipped_section, quoted_section, efficiency_section, modules_section]


def report_markdown(report: Report, command: str) -> str:
    lines = ["# DCViT parameter-efficiency report", "",
             f"Command: `{command}`  ",
             f"Versions: {', '.join(f'{k} {v}' for k, v in report.meta['versions'].items())}"]
    for section in MARKDOWN_SECTIONS:
        body = section(report)
        if body:
            lines += [""] + body
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- files
def write_report(report: Report, out: str, command: str = "dcvit-report") -> Dict[str, Path]:
    """Write report.md/.csv/.json/.png under ``out`` (created), each atomically."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "report.md": report_markdown(report, command).encode(),
        "report.csv": report_csv(report).encode(),
        "report.json": report_json(report, command).encode(),
        "report.png": report_png(report),
    }
    paths = {}
    for name, data in files.items():
        paths[name] = out_dir / name
        atomic_write(paths[name], lambda tmp, data=data: Path(tmp).write_bytes(data))
    return paths
