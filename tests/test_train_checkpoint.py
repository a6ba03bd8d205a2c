"""train_imagenet.checkpoint: checksums verified on load, `resume=auto` walking back past
damaged checkpoints (named in a warning, set aside), and the rank-0 pick every rank loads."""
import logging
import os

import pytest
import torch

import train_imagenet.start as start_mod
from train_imagenet.checkpoint import (CheckpointError, content_digest, list_checkpoints,
                                       load_checkpoint, load_latest, save_checkpoint)
from train_imagenet.config import load_config
from train_imagenet.distributed import DistInfo


def _save(run_dir, epoch, update):
    return save_checkpoint({"model": {"w": torch.full((64,), float(update))}, "epoch": epoch,
                            "update": update, "arch": {"model": "m"}}, str(run_dir), keep=10)


def _flip_tensor_byte(path, value):
    """Alters one byte inside the stored tensor (the file still unpickles)."""
    data = bytearray(open(path, "rb").read())
    needle = torch.full((64,), float(value)).numpy().tobytes()
    at = bytes(data).index(needle) + 5
    data[at] ^= 0x40
    open(path, "wb").write(bytes(data))


def test_checksum_covers_every_value():
    state = {"model": {"w": torch.arange(4.0)}, "epoch": 1, "rng": [1, [2, 3]], "x": None}
    base = content_digest(state)
    assert content_digest({**state, "checksum": {"sha256": "anything"}}) == base
    for changed in ({**state, "epoch": 2}, {**state, "rng": [1, [2, 4]]},
                    {**state, "model": {"w": torch.arange(4.0).double()}},
                    {**state, "model": {"w": torch.tensor([0.0, 1.0, 2.0, 3.5])}}):
        assert content_digest(changed) != base


def test_altered_bytes_are_found_on_load(tmp_path):
    path = _save(tmp_path, 0, 4)
    assert load_checkpoint(path)["checksum"]["sha256"]
    _flip_tensor_byte(path, 4)
    torch.load(path, weights_only=True)                            # still unpickles
    with pytest.raises(CheckpointError, match="is damaged: its content does not match"):
        load_checkpoint(path)


def test_load_latest_falls_back_past_damaged_checkpoints(tmp_path, caplog):
    good = _save(tmp_path, 0, 4)
    altered = _save(tmp_path, 1, 8)
    _flip_tensor_byte(altered, 8)
    truncated = _save(tmp_path, 2, 12)
    with open(truncated, "r+b") as f:
        f.truncate(100)
    garbage = tmp_path / "ckpt-e0003-u00000016.pth"
    garbage.write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING, logger="train_imagenet.checkpoint"):
        path, state = load_latest(str(tmp_path))
    assert path == good and state["update"] == 4
    for bad in (str(garbage), truncated, altered):
        assert bad in caplog.text and os.path.exists(bad + ".corrupt") and not os.path.exists(bad)
    assert list_checkpoints(str(tmp_path)) == [good]
    assert load_latest(str(tmp_path / "empty")) == (None, None)


def test_resume_pick_is_made_on_rank_0_and_broadcast(tmp_path, monkeypatch):
    newest = _save(tmp_path, 1, 8)
    sent = []
    monkeypatch.setattr(start_mod, "broadcast_object", lambda obj: sent.append(obj) or "FROM-RANK-0")
    cfg = load_config(None, ["resume=auto", f"output_dir={tmp_path}"])
    path, state = start_mod.checkpoint_to_start(cfg, DistInfo(rank=0, world_size=2))
    assert path == "FROM-RANK-0" and state["update"] == 8 and sent == [newest]

    def no_listing(run_dir, set_aside=True):
        raise AssertionError("a rank other than 0 listed the run directory")
    monkeypatch.setattr(start_mod, "load_latest", no_listing)
    assert start_mod.checkpoint_to_start(cfg, DistInfo(rank=1, world_size=2)) == ("FROM-RANK-0", None)
    assert sent == [newest, None]


@pytest.mark.parametrize("amp, saved", [
    ("fp16", {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
              "growth_interval": 2000, "_growth_tracker": 7}),
    ("bf16", None),
])
def test_loss_scaler_state_resumes(tmp_path, amp, saved):
    """The checkpoint's `scaler` entry, as every version saved it (torch's GradScaler state
    for amp=fp16, None otherwise), resumes into the recipe's timm NativeScaler; without fp16
    the recipe has no scaler."""
    import dataclasses
    import warnings
    from timm.utils import NativeScaler
    from train_imagenet.config import load_config
    from train_imagenet.recipe import build_recipe
    from train_imagenet.start import arch_of, start_training

    cfg = load_config(None, ["data.num_classes=3", "epochs=2", f"amp={amp}"])
    model = torch.nn.Linear(4, 3)
    with warnings.catch_warnings():                      # "CUDA is not available": disabled
        warnings.simplefilter("ignore")
        recipe = build_recipe(cfg, model, batches_per_epoch=4, world_size=1)
    assert isinstance(recipe.scaler, NativeScaler) if amp == "fp16" else recipe.scaler is None
    if amp == "fp16":                                    # fp16 runs on CUDA; its scaler on CPU here
        recipe = dataclasses.replace(recipe, scaler=NativeScaler("cpu"))
    state = {"model": model.state_dict(), "optimizer": recipe.optimizer.state_dict(),
             "scheduler": recipe.scheduler.state_dict(), "scaler": saved, "epoch": 1,
             "batch": 0, "update": 4, "arch": arch_of(cfg), "config": {}}
    start = start_training(cfg, model, recipe, DistInfo(), str(tmp_path / "c.pth"), state,
                           {}, updates_per_epoch=4)
    assert (start.epoch, start.update) == (1, 4)
    assert (recipe.scaler.state_dict() if recipe.scaler else None) == saved
