"""The README's main job, end to end at reduced size, through the same entry points."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_quickstart_end_to_end(tmp_path):
    out, data = tmp_path / "runs", tmp_path / "data"
    proc = subprocess.run(
        [sys.executable, "scripts/quickstart.py", "--out", str(out), "--data", str(data), "epochs=1",
         "sched.warmup_epochs=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for model in ("vit_tiny_patch16_224", "dcvit_tiny"):
        result = json.loads((out / model / "eval.json").read_text())
        assert result["model"] == model and result["num_samples"] == 359
        assert 0 <= result["top1"] <= 100
        assert f"{model:<24} top-1 {result['top1']:6.2f} %" in proc.stdout
    report = json.loads((out / "report" / "report.json").read_text())
    rows = {row["model"].split("(")[0]: row for row in report["rows"]}
    assert rows["dcvit_tiny"]["params"] > rows["vit_tiny_patch16_224"]["params"]
    assert rows["dcvit_tiny"]["top1"] is not None
    for name in ("report.md", "report.csv", "report.png"):
        assert (out / "report" / name).stat().st_size > 0
    with Image.open(out / "attention_maps.png") as img:
        assert img.format == "PNG"
    assert str(out / "report" / "report.md") in proc.stdout
