"""Resumes with settings changed since the checkpoint (issue 44): the settings the data order
depends on (refused mid-epoch with one line, fine at an epoch boundary) and the optimizer
(refused before anything is written). The run, its checkpoints and its helpers are those of
test_train_faults_resume.py."""
import os

import pytest
import torch

from train_imagenet.checkpoint import content_digest, list_checkpoints, load_checkpoint

from test_train_faults_resume import MID, _killed_after, _records, _run, data, full  # noqa: F401

BOUNDARY = "ckpt-e0001-u00000012.pth"     # epoch 1, batch 0


def _errors(err):
    return [ln for ln in err.splitlines() if ln.startswith("error:")]


def _unchanged(out, name):
    """Nothing was written: the one checkpoint is there, no config.yaml, no log."""
    assert list_checkpoints(str(out)) == [str(out / name)]
    assert not (out / "config.yaml").exists() and not (out / "log.jsonl").exists()


# ------------------------------------------------------------------ the data order's settings
@pytest.mark.parametrize("change, said, back", [
    ("data.num_workers=2", "data.num_workers 0 -> 2", "data.num_workers=0"),
    ("seed=7", "seed 0 -> 7", "seed=0"),
    ("data.shuffle_buffer=8", "data.shuffle_buffer 16 -> 8", "data.shuffle_buffer=16"),
    ("aug.repeated_aug=2", "aug.repeated_aug 1 -> 2", "aug.repeated_aug=1"),
])
def test_resume_mid_epoch_with_another_data_order_is_refused(data, full, tmp_path, capsys,
                                                             change, said, back):
    """Issue 44.1: the rest of epoch 1 would be read in another order (samples trained twice
    or never): exit 2 with one line naming the setting, both values and the fixes."""
    out = _killed_after(full, MID, tmp_path / "out")
    assert _run(data, out, "resume=auto", change) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1, errors
    assert said in errors[0] and back in errors[0] and "epoch 1, batch 8" in errors[0]
    assert "resume_at_epoch_boundary=true" in errors[0] and "Traceback" not in errors[0]
    _unchanged(out, MID)


def test_data_order_changed_at_an_epoch_boundary_is_said(data, full, tmp_path, capsys):
    out = _killed_after(full, BOUNDARY, tmp_path / "out")
    assert _run(data, out, "resume=auto", "seed=7", "data.shuffle_buffer=8") == 0
    err = capsys.readouterr().err
    assert "seed 0 -> 7; data.shuffle_buffer 16 -> 8" in err and "at an epoch boundary" in err
    assert [r["epoch"] for r in _records(out)] == [0, 1]        # epoch 0's record was unlogged
    assert load_checkpoint(list_checkpoints(str(out))[-1])["position"]["data_order"]["seed"] == 7


def test_data_order_changed_mid_epoch_continues_at_the_boundary_when_asked(data, full, tmp_path,
                                                                           capsys):
    out = _killed_after(full, MID, tmp_path / "out")
    assert _run(data, out, "resume=auto", "data.shuffle_buffer=8", "resume_at_epoch_boundary=true",
                "epochs=3") == 0
    err = capsys.readouterr().err
    assert "data.shuffle_buffer 16 -> 8" in err and "continuing from the start of epoch 2" in err
    assert [r["epoch"] for r in _records(out)] == [2]


def test_checkpoint_without_the_record_still_resumes(data, full, tmp_path, capsys):
    """A checkpoint saved before the data order's settings were recorded loads and resumes;
    the log says that they are not checked."""
    out = tmp_path / "out"
    out.mkdir()
    state = load_checkpoint(str(full / MID))
    del state["position"]["data_order"]
    state["checksum"] = {"sha256": content_digest(state)}
    torch.save(state, out / MID)
    assert _run(data, out, "resume=auto", "data.shuffle_buffer=8") == 0
    err = capsys.readouterr().err
    assert "does not record the settings its data order depends on" in err
    assert [r["epoch"] for r in _records(out)] == [1]


# ------------------------------------------------------------------ the optimizer
@pytest.mark.parametrize("opt", ["sgd", "lamb"])
def test_resume_with_another_optimizer_is_refused_before_writing(data, full, tmp_path, capsys, opt):
    """Issue 44.4: adamw's state does not load into another optimizer (KeyError 'momentum'
    in the first step, after config.yaml was rewritten): exit 2 with one line, nothing
    written."""
    out = _killed_after(full, MID, tmp_path / "out")
    assert _run(data, out, "resume=auto", f"optim.opt={opt}") == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1, errors
    assert f"optim.opt='adamw', this run has optim.opt={opt!r}" in errors[0]
    assert "set optim.opt=adamw" in errors[0] and f"checkpoint={out / MID}" in errors[0]
    _unchanged(out, MID)
    assert sorted(os.listdir(out)) == [".lock", MID]
