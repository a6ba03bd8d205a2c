"""scripts/upcycle_digits.py end to end at reduced size: the converted arm starts equal."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_upcycle_end_to_end(tmp_path):
    out, data = tmp_path / "runs", tmp_path / "data"
    proc = subprocess.run(
        [sys.executable, "scripts/upcycle_digits.py", "--out", str(out), "--data", str(data),
         "--pretrain-epochs", "1", "--epochs", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    vit, dc = (json.loads((out / f"{arm}_step0" / "eval.json").read_text()) for arm in ("vit", "dc"))
    assert vit["top1"] == dc["top1"] and abs(vit["loss"] - dc["loss"]) <= 1e-6 * abs(vit["loss"])
    assert vit["convert"] is None and dc["convert"] == {"layers": None, "options": {}}
    table = (out / "upcycle.md").read_text()
    assert f"| 0 | {vit['top1']:.2f} | {dc['top1']:.2f} |" in table and "\n| 1 | " in table
    ckpt = json.loads((out / "dc_finetune" / "eval.json").read_text())
    assert ckpt["convert"] == {"layers": None, "options": {}}
