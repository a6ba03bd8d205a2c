"""train_imagenet.checkpoint: checksums verified on load, `resume=auto` walking back past
damaged checkpoints (named in a warning, set aside), and the rank-0 pick every rank loads."""
import errno
import logging
import os

import pytest
import torch

import train_imagenet.__main__ as entry
import train_imagenet.start as start_mod
from train_imagenet.checkpoint import (CheckpointError, content_digest, list_checkpoints,
                                       load_checkpoint, load_latest, save_checkpoint, seed_all)
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


@pytest.mark.parametrize("seed", [2**63 - 1, -2**63])
def test_seeds_derived_from_any_valid_seed_are_taken(seed):
    """The run seeds its RNG streams with seed * 1000 + rank + 1 + epoch: past 64 bits for the
    largest seeds the config accepts, which torch takes modulo 2**64."""
    derived = seed * 1000 + 1 + 299
    seed_all(derived)
    assert torch.initial_seed() == derived % 2**64
    a = torch.rand(3)
    seed_all(derived)
    assert torch.equal(torch.rand(3), a)


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


def test_timm_train_py_checkpoint_is_named_as_written_elsewhere(tmp_path, caplog):
    """A checkpoint of timm's train.py (CheckpointSaver's keys) is named as such, not as one of
    this package's own older checkpoints; an own checkpoint without checksum still is."""
    timm_ckpt = tmp_path / "model_best.pth.tar"
    torch.save({"epoch": 7, "arch": "visiontransformer", "state_dict": {"w": torch.ones(2)},
                "optimizer": {}, "version": 2, "metric": 71.5}, timm_ckpt)
    older = tmp_path / "older.pth"
    torch.save({"model": {"w": torch.ones(2)}, "epoch": 1, "update": 3, "arch": {"model": "m"}}, older)
    with caplog.at_level(logging.WARNING, logger="train_imagenet.checkpoint"):
        assert load_checkpoint(str(timm_ckpt))["epoch"] == 7
        timm_line = caplog.text
        caplog.clear()
        load_checkpoint(str(older))
    assert "written elsewhere (timm's train.py: arch 'visiontransformer', epoch 7)" in timm_line
    assert "older version" not in timm_line
    assert "no checksum (saved by an older version of train_imagenet)" in caplog.text


@pytest.fixture(scope="module")
def data(digits_shards):
    return digits_shards(48, 20, 24, 20)            # 48 train samples in 2 shards


def test_output_dir_made_unwritable_mid_run_is_one_line(data, tmp_path, capsys, monkeypatch):
    """The run directory stops accepting new files at the third checkpoint: one line naming
    what could not be written, the intact checkpoints and how to resume; no traceback."""
    from train_helpers import TINY_RUN
    import train_imagenet.checkpoint as checkpoint_mod
    real_write = checkpoint_mod.atomic_write
    out = tmp_path / "out"
    calls = []

    def write_then_lose_access(path, write):
        calls.append(path)
        if len(calls) < 3:
            return real_write(path, write)
        if os.geteuid() != 0:         # a real read-only folder; root's writes ignore the mode
            os.chmod(out, 0o555)
            return real_write(path, write)
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.x1y2.tmp")
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), tmp)   # as mkstemp raises
    monkeypatch.setattr(checkpoint_mod, "atomic_write", write_then_lose_access)
    args = [f"data.train={data.root}", f"data.val={data.root}", f"output_dir={out}", *TINY_RUN,
            "epochs=2", "aug.mixup=0", "aug.cutmix=0", "save_every_steps=2"]
    try:
        assert entry.main(args) == 2
    finally:
        os.chmod(out, 0o755)
    err = capsys.readouterr().err
    kept = list_checkpoints(str(out))
    assert [os.path.basename(p) for p in kept] == ["ckpt-e0000-u00000002.pth", "ckpt-e0000-u00000004.pth"]
    line = next(ln for ln in err.splitlines() if ln.startswith("error:"))
    assert f"cannot write {out}{os.sep}.ckpt-e0001-u00000006.pth." in line and "Permission denied" in line
    assert f"the newest: {kept[-1]}" in line and "resume=auto" in line
    assert "Traceback" not in err and not [n for n in os.listdir(out) if n.endswith(".tmp")]
    load_checkpoint(kept[-1])
    monkeypatch.setattr(checkpoint_mod, "atomic_write", real_write)      # writable again: resume
    assert entry.main(args + ["resume=auto"]) == 0
    assert "resumed from" in capsys.readouterr().err


def test_timm_train_py_checkpoint_starts_a_run(data, tmp_path, capsys, caplog):
    """``checkpoint=`` a timm train.py checkpoint: without its args it loads (named as written
    elsewhere); with them (an argparse.Namespace) it is refused as unsafe, naming the way out."""
    import argparse
    import timm
    from train_helpers import TINY_RUN
    model = timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=8,
                              depth=1, embed_dim=24, num_heads=2)
    saved = {"epoch": 4, "arch": "vit_tiny_patch16_224", "state_dict": model.state_dict(),
             "optimizer": {}, "version": 2}
    torch.save(saved, tmp_path / "last.pth.tar")
    args = [f"data.train={data.root}", f"data.val={data.root}", *TINY_RUN, "--eval-only"]
    with caplog.at_level(logging.WARNING, logger="train_imagenet.checkpoint"):
        assert entry.main(args + [f"output_dir={tmp_path / 'a'}", f"checkpoint={tmp_path / 'last.pth.tar'}"]) == 0
    assert "written elsewhere (timm's train.py: arch 'vit_tiny_patch16_224', epoch 4)" in caplog.text
    torch.save({**saved, "args": argparse.Namespace(model="vit_tiny_patch16_224")}, tmp_path / "args.pth.tar")
    assert entry.main(args + [f"output_dir={tmp_path / 'b'}", f"checkpoint={tmp_path / 'args.pth.tar'}"]) == 2
    err = capsys.readouterr().err
    assert "is not a safe checkpoint" in err and "timm's clean_checkpoint.py writes its weights alone" in err
