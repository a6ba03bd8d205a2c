"""scripts/gpu_check_report.py turns what gpu_check.sh leaves in its folder into
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
    (tmp_path / "steps.tsv").write_text("tests\tpass\t30\t360\ttests.log\n"
                                        "bench_S_eager_torch\ttimeout\t240\t240\tx.log\n")
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
    result = _report_module().report(tmp_path)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["passed"] is False                                   # a step timed out
    assert saved["fastest_training_core"] == {"dcvit_small_patch16_224/eager": "triton (0.950x ViT)"}
    assert saved["suggested_cuda_measured"] == {"NVIDIA H100": {"eager": "triton"}}
    met = {(f["core"], f["kind"]): f["met"] for f in saved["figures"]}
    assert met == {("triton", "train"): True, ("triton", "memory"): True,
                   ("torch", "train"): False, ("torch", "memory"): False}
    assert saved["training_runs"]["run_eager"]["epochs"] == 1
    out = capsys.readouterr().out
    assert "bench_S_eager_torch" in out and "timeout" in out and "+10.0 %" in out
    assert result["loop_overhead"]["overhead"] == 0.1
    times = {r["what"]: (r["estimate"], r["measured"]) for r in saved["kernel_times"]}
    assert times["forward ms"] == (0.07, 0.2)                            # measured next to the estimate
    assert times["backward ms"] == (pytest.approx(0.17), None)            # not timed: estimate only
    assert times["training ratio"] == (0.85, 0.95)                        # the eager triton bench figure
    assert "training ratio" in out


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
