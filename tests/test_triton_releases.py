"""The kernels fit under the oldest and the newest Triton they support, not only this venv's.

For each release a scratch environment takes everything from the running one (torch, the
project) and only ``triton==X`` from the package registry: ``pip install --no-deps --target
DIR``, with DIR first on PYTHONPATH. There `scripts/kernel_report.py --production --check`
compiles every variant DCViT trains with (head dim 64, bf16, both Compose stages with both
matrix sides, no mask, heads 3, 6, 12, 16, every `block_sizes` candidate, sm_80 and sm_90)
with that release's compiler and ptxas, and fails on a compile error, a spill or a block
over 160 KiB of shared memory. A new Triton release that tips a kernel over fails here
first. The wheel is kept in pytest's cache between runs; the first run needs the registry.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASES = ("3.4.0", "3.9.0")       # the oldest and newest Triton the kernels support


def _scratch_triton(cache, version: str) -> str:
    """A directory holding only triton==version (installed once, then reused)."""
    target = str(cache.mkdir(f"triton-{version}"))
    if not os.path.isdir(os.path.join(target, "triton")):
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
                               "--no-deps", "--target", target, f"triton=={version}"],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"pip could not install triton=={version}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    return target


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("version", RELEASES)
def test_production_variants_fit_under_release(request, tmp_path, version):
    target = _scratch_triton(request.config.cache, version)
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([target, ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "kernel_report.py"), "--production",
                           "--targets", "sm80", "sm90", "--check", "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    report = json.loads(out.read_text())
    assert report["triton"] == version, f"the report ran under Triton {report['triton']}, not the scratch {version}"
    rows = report["rows"]
    assert {(r["H"], r["arch"]) for r in rows} == {(h, a) for h in (3, 6, 12, 16) for a in (80, 90)}
    assert not [r for r in rows if r["mask"] or r["dtype"] != "bf16" or (r["pre"], r["post"]) != ("qk", "qk")]
    assert all("error" not in r and r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in rows), tail
