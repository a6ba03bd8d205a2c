"""scripts/gpu_check_report.py turns what gpu_check.sh leaves in its scratch folder into
gpu_check.json and a table, and scripts/loop_overhead.py runs (the GPU-side steps themselves
run only on a GPU; `bash scripts/gpu_check.sh --dry-run` runs them all on CPU)."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _report_module():
    spec = importlib.util.spec_from_file_location("gpu_check_report", ROOT / "scripts" / "gpu_check_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench(path: Path, core: str, train_ratio: float, memory_ratio: float) -> None:
    figures = {
        "train/bf16/eager/b256": {"dcvit_ms": 100.0, "vit_ms": 100.0 * train_ratio, "ratio": train_ratio},
        "memory/bf16/eager/b256": {"dcvit_bytes": memory_ratio * 2**30, "vit_bytes": 2**30, "ratio": memory_ratio},
    }
    path.write_text(json.dumps({"model": "dcvit_small_patch16_224", "baseline": "vit_small_patch16_224",
                                "impl": core, "figures": figures}))


def test_report_reads_steps_figures_and_runs(tmp_path, capsys):
    (tmp_path / "environment.json").write_text(json.dumps({"device": "NVIDIA H100"}))
    step = dict(what="", planned_s=30.0, limit_s=60.0)
    (tmp_path / "steps.json").write_text(json.dumps({"budget_s": 500, "elapsed_s": 320.0, "plan": [], "steps": [
        dict(step, step="kernels", status="pass", seconds=30.0, log="kernels.log"),
        dict(step, step="bench_S_eager_torch", status="timeout", seconds=60.0, log="x.log"),
        dict(step, step="train_smoke_compile", status="skipped", seconds=0.0, reason="planned 246 s > 80 s left")]}))
    (tmp_path / "kernels.json").write_text(json.dumps({"models": {"S/16": {
        "max_error": 0.004, "reference_error": 0.006, "worst": "grad qkv.weight", "passed": True}}}))
    _bench(tmp_path / "bench_S_eager_triton.json", "triton", 0.95, 1.05)
    _bench(tmp_path / "bench_S_eager_torch.json", "torch", 0.40, 1.30)
    (tmp_path / "loop_overhead.json").write_text(json.dumps(
        {"loop_ms_per_step": 110.0, "bare_ms_per_step": 100.0, "overhead": 0.1}))
    kernels = {k: {"estimate": e} for k, e in (("fwd", 0.07), ("bwd_q", 0.09), ("bwd_k", 0.08))}
    (tmp_path / "kernel_times.json").write_text(json.dumps({
        "models": {"S/16": {"dcvit": "dcvit_small_patch16_224", "train_ratio": 0.85, "kernels": kernels,
                            "sdpa": {"forward": {"estimate": 0.05}, "backward": {"estimate": 0.09}}}},
        "measured": {"S/16": {"forward": {"estimate": 0.07, "measured": 0.2}}}}))
    run = tmp_path / "run_eager"
    run.mkdir()
    (run / "log.jsonl").write_text(json.dumps({"epoch": 0, "train_loss": 2.3, "img_per_s": 900.0}) + "\n")
    dest = tmp_path / "out"
    result = _report_module().report(tmp_path, dest)
    saved = json.loads((dest / "gpu_check.json").read_text())
    assert saved["passed"] is False                                   # a step timed out
    assert saved["skipped"] == ["train_smoke_compile"] and saved["budget_s"] == 500
    assert saved["kernels"]["models"]["S/16"]["passed"] is True
    assert saved["fastest_training_core"] == {"dcvit_small_patch16_224/eager": "triton (0.950x ViT)"}
    met = {(f["core"], f["kind"]): f["met"] for f in saved["figures"]}
    assert met == {("triton", "train"): True, ("triton", "memory"): True,
                   ("torch", "train"): False, ("torch", "memory"): False}
    assert saved["training_runs"]["run_eager"]["epochs"] == 1
    out = capsys.readouterr().out
    assert "bench_S_eager_torch" in out and "timeout" in out and "+10.0 %" in out
    assert "planned 246 s > 80 s left" in out and "kernels S/16: error 4.00e-03 against the bf16 reference core's 6.00e-03" in out
    assert result["loop_overhead"]["overhead"] == 0.1
    times = {r["what"]: (r["estimate"], r["measured"]) for r in saved["kernel_times"]}
    assert times["forward ms"] == (0.07, 0.2)                            # measured next to the estimate
    assert times["backward ms"] == (pytest.approx(0.17), None)            # not timed: estimate only
    assert times["training ratio"] == (0.85, 0.95)                        # the eager triton bench figure
    assert "training ratio" in out


def test_a_skipped_step_is_no_failure_and_the_targets_are_the_benchmarks(tmp_path):
    """Only failures and timeouts fail the check; the summary's targets (written out so that
    it needs no torch) are dcvit.bench's."""
    from dcvit.bench import TARGETS
    module = _report_module()
    assert module.TARGETS == TARGETS
    (tmp_path / "steps.json").write_text(json.dumps({"steps": [
        dict(step="environment", what="", status="pass", planned_s=1.0, seconds=1.0, limit_s=2.0, log="e.log"),
        dict(step="kernels", what="", status="skipped", planned_s=9.0, seconds=0.0, limit_s=0.0, log=None,
             reason="planned 9 s > 1 s left of the budget")]}))
    assert module.report(tmp_path, quiet=True)["passed"] is True


def test_loop_overhead_runs_the_engine_loop_and_a_bare_loop(tmp_path):
    """scripts/loop_overhead.py on CPU at toy size: both loops run, the JSON says what it
    measured (no timing asserted)."""
    spec = importlib.util.spec_from_file_location("loop_overhead", ROOT / "scripts" / "loop_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "loop.json"
    result = module.measure(["--device", "cpu", "--model", "dcvit_tiny_patch16_224", "--img-size", "32",
                             "--depth", "1", "--batch-size", "2", "--amp", "none", "--steps", "2",
                             "--repeats", "1", "--log-every", "1", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["steps"] == 2 and len(saved["loop_times_s"]) == len(saved["bare_times_s"]) == 1
    assert saved["loop_ms_per_step"] > 0 and saved["bare_ms_per_step"] > 0
    assert saved["overhead"] == result["overhead"]
