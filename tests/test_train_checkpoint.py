"""train_imagenet.checkpoint: `resume=auto` discovery by listing, warnings for unreadable
checkpoints, and the rank-0 pick every rank then loads."""
import logging

import pytest
import torch

import train_imagenet.__main__ as entry
from train_imagenet.checkpoint import find_latest, list_checkpoints, save_checkpoint
from train_imagenet.distributed import DistInfo


def _save(run_dir, epoch, update):
    return save_checkpoint({"model": {"w": torch.full((2,), float(update))}, "epoch": epoch,
                            "update": update}, str(run_dir), keep=10)


def test_find_latest_names_newest_without_loading(tmp_path, monkeypatch):
    paths = [_save(tmp_path, e, u) for e, u in [(0, 9), (1, 10), (2, 100)]]
    assert list_checkpoints(str(tmp_path)) == paths                 # by update count, not name
    def no_load(*a, **k):
        raise AssertionError("find_latest loaded a checkpoint")
    monkeypatch.setattr(torch, "load", no_load)
    assert find_latest(str(tmp_path)) == paths[-1]
    assert find_latest(str(tmp_path / "empty")) is None


def test_find_latest_warns_about_unreadable_checkpoints(tmp_path, caplog):
    good = _save(tmp_path, 0, 4)
    truncated = _save(tmp_path, 1, 8)
    with open(truncated, "r+b") as f:
        f.truncate(100)
    garbage = tmp_path / "ckpt-e0002-u00000012.pth"
    garbage.write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING, logger="train_imagenet.checkpoint"):
        assert find_latest(str(tmp_path)) == good
    text = caplog.text
    assert str(garbage) in text and str(truncated) in text and "BadZipFile" in text


def test_resume_pick_is_made_on_rank_0_and_broadcast(tmp_path, monkeypatch):
    newest = _save(tmp_path, 1, 8)
    sent = []
    monkeypatch.setattr(entry, "broadcast_object", lambda obj: sent.append(obj) or "FROM-RANK-0")
    assert entry._latest_checkpoint(str(tmp_path), DistInfo(rank=0, world_size=2)) == "FROM-RANK-0"
    assert sent == [newest]
    def no_listing(run_dir):
        raise AssertionError("a rank other than 0 listed the run directory")
    monkeypatch.setattr(entry, "find_latest", no_listing)
    assert entry._latest_checkpoint(str(tmp_path), DistInfo(rank=1, world_size=2)) == "FROM-RANK-0"
    assert sent == [newest, None]

