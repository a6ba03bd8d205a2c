"""Collect what scripts/gpu_check.sh left in its folder into gpu_check.json and a table.

    python scripts/gpu_check_report.py gpu_check/

Reads steps.tsv (one line per step: name, pass/fail/timeout, seconds, limit, log),
environment.json, bench_*.json (dcvit-bench), run_*/log.jsonl (train_imagenet) and
loop_overhead.json, and kernel_times.json (`scripts/kernel_report.py --estimate --measure`:
each Triton kernel's and SDPA's time at the models' layer shapes, measured next to the
roofline estimate, and the estimated training-step ratio next to the measured one). Figures are read against the performance targets (`dcvit.benchmark.TARGETS`:
throughput ≥ 0.90× ViT, peak memory ≤ 1.20×); for each model and eager/compile the fastest
training core is named, which is the figure the CUDA default is chosen from
(docs/performance.md). Exit status 1 when a step failed or timed out.
"""
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from dcvit.benchmark import TARGETS


def _load(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _met(kind: str, ratio: float) -> bool:
    op, bound = TARGETS[kind]
    return ratio >= bound if op == ">=" else ratio <= bound


def _steps(out: Path) -> List[Dict[str, Any]]:
    rows = []
    for line in (out / "steps.tsv").read_text().splitlines():
        name, status, seconds, limit, log = line.split("\t")
        rows.append({"step": name, "status": status, "seconds": int(seconds), "limit_s": int(limit),
                     "log": log})
    return rows


def _figures(out: Path) -> List[Dict[str, Any]]:
    """One row per (model, core, figure key) from every bench_*.json."""
    rows = []
    for path in sorted(out.glob("bench_*.json")):
        data = _load(path)
        if not data:
            continue
        for key, fig in data.get("figures", {}).items():
            kind, dtype, backend, batch = key.split("/")
            rows.append({"model": data["model"], "baseline": data["baseline"], "core": data.get("impl", "auto"),
                         "kind": kind, "dtype": dtype, "backend": backend, "batch": batch,
                         "ratio": fig["ratio"], "met": _met(kind, fig["ratio"]),
                         "dcvit": fig.get("dcvit_ms", fig.get("dcvit_bytes")),
                         "vit": fig.get("vit_ms", fig.get("vit_bytes")),
                         "unit": "bytes" if kind == "memory" else "ms", "file": path.name})
    return rows


def _fastest(figures: List[Dict[str, Any]]) -> Dict[str, str]:
    """Per model and backend: the core with the highest training-step ratio."""
    best: Dict[str, Dict[str, Any]] = {}
    for f in figures:
        if f["kind"] != "train":
            continue
        key = f"{f['model']}/{f['backend']}"
        if key not in best or f["ratio"] > best[key]["ratio"]:
            best[key] = f
    return {k: f"{f['core']} ({f['ratio']:.3f}x ViT)" for k, f in best.items()}


def _suggestion(figures: List[Dict[str, Any]], device: str) -> Dict[str, Dict[str, str]]:
    """The `dcvit.fused.CUDA_MEASURED` entry these figures support: per eager/compile, the
    core with the fastest DCViT-S/16 training step (any model when S/16 was not run)."""
    train = [f for f in figures if f["kind"] == "train"]
    small = [f for f in train if f["model"].startswith("dcvit_small")] or train
    cores: Dict[str, str] = {}
    for backend in ("eager", "compile"):
        rows = [f for f in small if f["backend"] == backend]
        if rows:
            cores[backend] = max(rows, key=lambda f: f["ratio"])["core"]
    return {device: cores} if cores else {}


def _kernel_times(out: Path, figures: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Estimated against measured: per model, each timed core (ms) and the training-step
    ratio (the eager Triton core's bf16 figure of that model, when it was run)."""
    data = _load(out / "kernel_times.json") or {}
    rows = []
    for label, model in data.get("models", {}).items():
        measured = data.get("measured", {}).get(label, {})
        for name in ("forward", "backward", "sdpa_forward", "sdpa_backward"):
            est = measured.get(name, {}).get("estimate")
            if est is None:
                k = model["kernels"]
                est = {"forward": k["fwd"]["estimate"], "backward": k["bwd_q"]["estimate"] + k["bwd_k"]["estimate"],
                       "sdpa_forward": model["sdpa"]["forward"]["estimate"],
                       "sdpa_backward": model["sdpa"]["backward"]["estimate"]}[name]
            rows.append({"model": label, "what": name + " ms", "estimate": est,
                         "measured": measured.get(name, {}).get("measured")})
        train = [f["ratio"] for f in figures if f["kind"] == "train" and f["core"] == "triton"
                 and f["backend"] == "eager" and f["model"] == model["dcvit"]]
        rows.append({"model": label, "what": "training ratio", "estimate": model["train_ratio"],
                     "measured": train[0] if train else None})
    return rows


def _training_runs(out: Path) -> Dict[str, Any]:
    runs = {}
    for run in sorted(out.glob("run_*")):
        lines = (run / "log.jsonl").read_text().splitlines() if (run / "log.jsonl").exists() else []
        records = [json.loads(line) for line in lines if line.strip()]
        runs[run.name] = {"epochs": len(records), "last": records[-1] if records else None,
                          "eval": _load(run / "eval.json")}
    return runs


def report(out: Path) -> Dict[str, Any]:
    steps, figures = _steps(out), _figures(out)
    env = _load(out / "environment.json") or {}
    result = {"environment": env, "steps": steps, "figures": figures,
              "fastest_training_core": _fastest(figures),
              "suggested_cuda_measured": _suggestion(figures, env.get("device", "?")),
              "training_runs": _training_runs(out),
              "loop_overhead": _load(out / "loop_overhead.json"), "targets": TARGETS,
              "kernel_times": _kernel_times(out, figures),
              "passed": all(s["status"] == "pass" for s in steps)}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    print(f"\ngpu_check on {env.get('device', '?')} (torch {env.get('torch', '?')}, "
          f"triton {env.get('triton', '?')}; automatic core: {env.get('auto_core', '?')})")
    print(f"\n{'step':<34}{'status':<9}{'seconds':>8}{'limit':>7}")
    for s in steps:
        print(f"{s['step']:<34}{s['status']:<9}{s['seconds']:>8}{s['limit_s']:>7}")
    if figures:
        print(f"\n{'model':<26}{'core':<9}{'figure':<28}{'DCViT':>11}{'ViT':>11}{'ratio':>7}{'target':>8}  met")
        for f in figures:
            op, bound = TARGETS[f["kind"]]
            fmt = (lambda v: f"{v / 2**20:.0f} MiB") if f["unit"] == "bytes" else (lambda v: f"{v:.1f} ms")
            print(f"{f['model']:<26}{f['core']:<9}{f['kind'] + '/' + f['dtype'] + '/' + f['backend']:<28}"
                  f"{fmt(f['dcvit']):>11}{fmt(f['vit']):>11}{f['ratio']:>7.3f}{op + str(bound):>8}  "
                  f"{'yes' if f['met'] else 'no'}")
        print("\nfastest training core: " + ", ".join(f"{k}: {v}" for k, v in result["fastest_training_core"].items()))
        print(f"dcvit.fused.CUDA_MEASURED entry these figures support: {result['suggested_cuda_measured']}")
    if result["kernel_times"]:
        print(f"\n{'model':<7}{'Triton core vs SDPA':<22}{'estimate':>10}{'measured':>10}")
        for r in result["kernel_times"]:
            meas = "-" if r["measured"] is None else f"{r['measured']:.3f}"
            print(f"{r['model']:<7}{r['what']:<22}{r['estimate']:>10.3f}{meas:>10}")
    lo = result["loop_overhead"]
    if lo:
        print(f"training loop vs bare loop: {lo['loop_ms_per_step']:.2f} vs {lo['bare_ms_per_step']:.2f} "
              f"ms/step ({100 * lo['overhead']:+.1f} %)")
    for name, run in result["training_runs"].items():
        last = run["last"] or {}
        print(f"{name}: {run['epochs']} epochs, last train_loss {last.get('train_loss', '?')}, "
              f"img/s {last.get('img_per_s', '?')}, peak {last.get('peak_mem_mb', '?')} MB")
    print(f"\n{'PASS' if result['passed'] else 'FAIL'}: wrote {out / 'gpu_check.json'}")
    return result


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/gpu_check_report.py DIR (the folder gpu_check.sh wrote)")
    sys.exit(0 if report(Path(sys.argv[1]))["passed"] else 1)
