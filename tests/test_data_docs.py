"""docs/data.md, "Training on each source": every command of its bash block runs, on tiny
exact copies of each layout (tests/data_layouts.py) in place of its `/data/...` paths, with
the tiny model's settings added, and trains one epoch on the labels the source holds."""
import re
import shlex
from pathlib import Path

import pytest

import data_layouts as L
from train_helpers import TINY_RUN

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Training on each source"
# the /data/<name> each command names -> the tiny copy's builder
COPIES = {"imagenet-1k-wds": L.timm_wds, "imagenet-1k": L.hf_parquet,
          "torchvision-imagenet": L.torchvision_root, "kaggle": L.kaggle}


def commands():
    text = (ROOT / "docs" / "data.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the section has one bash block of commands"
    return [line for line in blocks[0].splitlines() if line.strip()]


def test_every_source_of_the_table_has_a_command():
    names = {re.search(r"/data/([\w-]+)", c).group(1) for c in commands()}
    assert names == set(COPIES)


@pytest.mark.parametrize("command", commands(), ids=lambda c: re.search(r"/data/([\w-]+)", c).group(1))
def test_the_command_trains_one_epoch(command, tmp_path, monkeypatch):
    from train_imagenet.__main__ import main
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "train_imagenet"]
    name = re.search(r"/data/([\w-]+)", command).group(1)
    copy = tmp_path / name
    COPIES[name](str(copy))
    argv = [a.replace(f"/data/{name}", str(copy)) for a in argv[3:]]
    monkeypatch.chdir(ROOT)          # --config configs/... is relative to the checkout
    assert main([*argv, f"output_dir={tmp_path / 'run'}", *TINY_RUN, "data.num_classes=4",
                 "epochs=1", "aug.repeated_aug=1"]) == 0
    assert (tmp_path / "run" / "eval.json").exists()
