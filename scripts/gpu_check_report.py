"""Collect what scripts/gpu_check.sh left in its scratch folder into gpu_check.json and a table.

    python scripts/gpu_check_report.py SCRATCH [OUT]     # OUT/gpu_check.json (default: SCRATCH)

Reads steps.json (`gpu_check_plan.run`: the budget, the plan, and per step its status
pass/fail/timeout/skipped, planned and measured seconds, limit, log, and why it was skipped),
environment.json, kernels.json (`dcvit.bench.gpu_kernels`: the Triton core against the
reference), bench_*.json (dcvit-bench), run_*/log.jsonl (train_imagenet),
loop_overhead.json, and kernel_times.json (`python -m dcvit.bench.kernels --estimate --measure`:
each Triton kernel's and SDPA's time at the models' layer shapes, measured next to the
roofline estimate, and the estimated training-step ratio next to the measured one). Figures
are read against the performance targets (`dcvit.bench.TARGETS`: throughput ≥ 0.90×
ViT, peak memory ≤ 1.20×); for each model and eager/compile the fastest training core is
named, which is the figure the CUDA default is chosen from (docs/performance.md). Exit
status 1 when a step failed or timed out (a skipped step is no failure).
"""
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

# dcvit.bench's targets, written out so that the summary needs neither torch nor dcvit
# (tests/test_gpu_check_report.py checks that the two agree).
TARGETS = {"inference": (">=", 0.90), "train": (">=", 0.90), "memory": ("<=", 1.20)}


def _load(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _met(kind: str, ratio: float) -> bool:
    op, bound = TARGETS[kind]
    return ratio >= bound if op == ">=" else ratio <= bound


def _steps(out: Path) -> Dict[str, Any]:
    """steps.json: the budget, the plan and one record per step."""
    return _load(out / "steps.json") or {"steps": []}


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
                products = model.get("products") or {}
                pad = (model.get("padding") or {}).get("estimate", 0.0)
                est = {"forward": k["fwd"]["estimate"] + pad,            # the matrices padded once
                       "backward": k["bwd_q"]["estimate"] + k["bwd_k"]["estimate"] + products.get("estimate", 0.0),
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


def report(out: Path, dest: Optional[Path] = None, quiet: bool = False) -> Dict[str, Any]:
    """Read ``out`` (the scratch folder), write ``dest``/gpu_check.json whole; print a table."""
    meta, figures = _steps(out), _figures(out)
    steps = meta["steps"]
    env = _load(out / "environment.json") or {}
    result = {"passed": all(s["status"] in ("pass", "skipped") for s in steps),
              "budget_s": meta.get("budget_s"), "elapsed_s": meta.get("elapsed_s"),
              "dry_run": meta.get("dry_run"), "environment": env, "plan": meta.get("plan", []),
              "steps": steps, "skipped": [s["step"] for s in steps if s["status"] == "skipped"],
              "kernels": _load(out / "kernels.json"), "figures": figures,
              "fastest_training_core": _fastest(figures),
              "training_runs": _training_runs(out),
              "loop_overhead": _load(out / "loop_overhead.json"), "targets": TARGETS,
              "kernel_times": _kernel_times(out, figures)}
    dest = dest or out
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(dest / "gpu_check.json")
    if quiet:
        return result
    print(f"\ngpu_check on {env.get('device', '?')} (torch {env.get('torch', '?')}, "
          f"triton {env.get('triton', '?')}; automatic core: {env.get('auto_core', '?')}); "
          f"{result['elapsed_s']} s of a {result['budget_s']} s budget")
    print(f"\n{'step':<26}{'status':<9}{'planned':>8}{'seconds':>8}{'limit':>7}")
    for s in steps:
        print(f"{s['step']:<26}{s['status']:<9}{s['planned_s']:>8.0f}{s['seconds']:>8.0f}{s['limit_s']:>7.0f}"
              + (f"  {s['reason']}" if s.get("reason") else ""))
    for label, k in ((result["kernels"] or {}).get("models") or {}).items():
        print(f"kernels {label}: " + (k["error"] if "error" in k else
                                      f"error {k['max_error']:.2e} against the bf16 reference core's "
                                      f"{k['reference_error']:.2e} ({k['worst']})")
              + f" -> {'pass' if k['passed'] else 'FAIL'}")
    if figures:
        print(f"\n{'model':<26}{'core':<11}{'figure':<28}{'DCViT':>11}{'ViT':>11}{'ratio':>7}{'target':>8}  met")
        for f in figures:
            op, bound = TARGETS[f["kind"]]
            fmt = (lambda v: f"{v / 2**20:.0f} MiB") if f["unit"] == "bytes" else (lambda v: f"{v:.1f} ms")
            print(f"{f['model']:<26}{f['core']:<11}{f['kind'] + '/' + f['dtype'] + '/' + f['backend']:<28}"
                  f"{fmt(f['dcvit']):>11}{fmt(f['vit']):>11}{f['ratio']:>7.3f}{op + str(bound):>8}  "
                  f"{'yes' if f['met'] else 'no'}")
        print("\nfastest training core: " + ", ".join(f"{k}: {v}" for k, v in result["fastest_training_core"].items()))
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
    print(f"\n{'PASS' if result['passed'] else 'FAIL'}: wrote {dest / 'gpu_check.json'}")
    return result


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python scripts/gpu_check_report.py SCRATCH [OUT] (the folders gpu_check.sh wrote)")
    sys.exit(0 if report(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) == 3 else None)["passed"] else 1)
