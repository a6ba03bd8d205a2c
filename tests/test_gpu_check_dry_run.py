"""`scripts/gpu_check.sh --dry-run --budget 120` in an environment like a bare GPU image's:
an interpreter without fvcore, webdataset and the other pure-Python packages (and without
dcvit installed), given only the wheels that scripts/gpu_wheels.sh built. The check installs
them privately, runs the steps that fit the budget, skips the rest, and leaves two files."""
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_check_plan import REQUIREMENTS  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _bare_python(tmp: Path) -> Path:
    """A venv that sees this environment's packages except REQUIREMENTS' and dcvit: each
    remaining entry of site-packages linked into one folder that a .pth file adds."""
    hidden = set()
    for dist, _ in REQUIREMENTS + (("dcvit", "dcvit"),):
        try:
            d = metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            continue
        hidden |= {Path(str(f)).parts[0] for f in (d.files or [])}
        hidden.add(Path(str(d._path)).name)                  # its .dist-info folder
    site = Path(sysconfig.get_paths()["purelib"])
    linked = tmp / "linked"
    linked.mkdir()
    for entry in site.iterdir():
        if entry.name not in hidden and not entry.name.endswith(".pth") and entry.name != "__pycache__":
            (linked / entry.name).symlink_to(entry)
    venv = tmp / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    own = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    Path(own, "linked.pth").write_text(f"{linked}\n")
    return py


def test_dry_run_with_the_wheels_alone(tmp_path):
    wheels = tmp_path / "wheels"
    built = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_wheels.sh"), str(wheels)],
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    names = {p.name.split("-")[0].lower().replace("_", "-") for p in wheels.glob("*.whl")}
    assert names == {dist for dist, _ in REQUIREMENTS}
    assert all(p.name.endswith("-none-any.whl") for p in wheels.glob("*.whl"))

    py = _bare_python(tmp_path)
    probe = subprocess.run([str(py), str(ROOT / "scripts" / "gpu_check_plan.py"), "missing"],
                           capture_output=True, text=True, check=True, cwd=tmp_path)
    assert set(probe.stdout.split()) == {dist for dist, _ in REQUIREMENTS}   # none of them is there

    out, scratch = tmp_path / "out", tmp_path / "scratch"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--budget", "120",
                          "--wheels", str(wheels), "--out", str(out), "--scratch", str(scratch)],
                         capture_output=True, text=True, env=dict(env, PYTHON=str(py)), cwd=tmp_path, timeout=600)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check_logs.tar.gz"], run.stdout
    summary = json.loads((out / "gpu_check.json").read_text())
    assert run.returncode == 0 and summary["passed"], run.stdout[-4000:] + run.stderr[-2000:]
    assert {"passed", "budget_s", "elapsed_s", "dry_run", "environment", "plan", "steps", "skipped", "kernels",
            "figures", "kernel_times", "loop_overhead", "training_runs", "targets"} <= set(summary)
    assert summary["budget_s"] == 120 and summary["dry_run"] is True
    env_info = summary["environment"]
    assert set(env_info["wheels_installed"]) == {dist for dist, _ in REQUIREMENTS}
    assert env_info["device"] == "cpu" and set(env_info["cores"]) == {"S/16", "B/16"}
    steps = {s["step"]: s for s in summary["steps"]}
    for name in ("environment", "kernels", "kernel_times", "bench_S_eager_triton"):
        assert steps[name]["status"] == "pass", name
    # a step that runs passes; one that does not is skipped for the budget or for a step it
    # needs. Which of the later steps fit depends on the machine's speed, except the last:
    # its planned 130 s exceed the 115 s that a 120 s budget leaves on any machine.
    for name, row in steps.items():
        assert row["status"] == "pass" or (row["status"] == "skipped" and (
            "left of the budget" in row["reason"] or row["reason"].startswith("needs "))), (name, row)
    last = steps["bench_B_compile_triton"]
    assert last["status"] == "skipped" and last["reason"].startswith("planned 130 s > ")
    assert steps["train_smoke_compile"]["status"] != "pass" or steps["synthetic_shards"]["status"] == "pass"
    assert summary["skipped"] == [s for s, r in steps.items() if r["status"] == "skipped"]
    assert all(m["passed"] for m in summary["kernels"]["models"].values())
    assert {f["model"] for f in summary["figures"]} == {"dcvit_small_patch16_224"} | (
        {"dcvit_base_patch16_224"} if steps["bench_B_eager_triton"]["status"] == "pass" else set())
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        logs = tar.getnames()
    assert "gpu_check/environment.log" in logs and "gpu_check/steps.json" in logs
    assert not any(n.startswith("gpu_check/synthetic/") or "/site/" in n for n in logs)   # data, wheels: scratch only
    assert (scratch / "site" / "fvcore").is_dir()                            # the private target
