"""Faults injected into `python -m train_imagenet` (one process, CPU): each ends in a clear
exit-2 refusal before any work, or the run completes without losing an epoch."""
import json
import os
import shutil

import pytest
import torch

import train_imagenet.results as results_mod
import train_imagenet.trainer as trainer_mod
from train_imagenet.data import verify as shard_check
from train_imagenet.__main__ import main
from train_imagenet.checkpoint import list_checkpoints, load_checkpoint
from train_imagenet.config import load_config
from train_imagenet.data import DataError, build_data

from train_helpers import TINY_RUN, digits, nan_loss_at, write_shards

TINY = [*TINY_RUN, "epochs=1", "aug.mixup=0", "aug.cutmix=0"]


def _shards(root, n_train=48, n_val=30, per_shard=16, labels=None):
    """Train and val shards of digits with `<split>.json` metadata, as make_wds_shards writes."""
    x, y = digits(n_train + n_val)
    if labels:
        y = y.copy()
        for i, v in labels.items():
            y[i] = v
    for split, sl in (("train", slice(0, n_train)), ("val", slice(n_train, n_train + n_val))):
        paths = write_shards(str(root), split, x[sl], y[sl], per_shard)
        meta = {"num_samples": len(y[sl]), "num_classes": 10, "split": split,
                "shards": [os.path.basename(p) for p in paths]}
        (root / f"{split}.json").write_text(json.dumps(meta))
    return root


def _run(root, out, *extra, val=None):
    return main([f"data.train={root}", f"data.val={val or root}", f"output_dir={out}", *TINY, *extra])


def _truncate(path, keep=0.5):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def _nothing_written(out):
    return not out.exists() or not any(n.startswith("ckpt") or n == "config.yaml"
                                       for n in os.listdir(out))


# ------------------------------------------------------------------ shards and labels at start-up
@pytest.mark.parametrize("split", ["train", "val"])
def test_truncated_shard_refused_at_start_even_with_metadata(tmp_path, capsys, split):
    root = _shards(tmp_path / "d")
    _truncate(root / f"{split}-000001.tar")
    assert _run(root, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"{split}-000001.tar" in err and "truncated" in err and "Traceback" not in err
    assert _nothing_written(tmp_path / "out")


@pytest.mark.parametrize("split, index, label, message", [
    ("val", 50, 12, "data.val has 13 classes"),            # >= num_classes, val.json present
    ("train", 3, 12, "data.train has 13 classes"),
    ("train", 20, -1, "holds the label -1"),
])
def test_label_out_of_range_refused_at_start(tmp_path, capsys, split, index, label, message):
    root = _shards(tmp_path / "d", labels={index: label})
    assert _run(root, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert message in err and f"{split}-00000{(index - (48 if split == 'val' else 0)) // 16}.tar" in err
    assert _nothing_written(tmp_path / "out")


def test_label_that_is_no_integer_refused(tmp_path, capsys):
    import webdataset as wds
    root = _shards(tmp_path / "d")
    with wds.TarWriter(str(root / "val-000002.tar")) as sink:
        sink.write({"__key__": "odd", "png": b"x", "cls": b"seven"})
    assert _run(root, tmp_path / "out") == 2
    assert "'odd' has the label b'seven', not an integer" in capsys.readouterr().err


def test_val_folder_of_train_shards_refused(tmp_path, capsys):
    root = _shards(tmp_path / "d")
    only_train = tmp_path / "only_train"
    only_train.mkdir()
    for p in root.glob("train-*.tar"):
        shutil.copy(p, only_train)
    assert _run(root, tmp_path / "out", val=only_train) == 2
    err = capsys.readouterr().err
    assert "gives train shards" in err and "not val shards" in err
    assert _run(root, tmp_path / "out", val=f"{root}/train-{{000000..000002}}.tar") == 2
    assert "gives train shards" in capsys.readouterr().err
    assert main([f"data.train={root}/val-000000.tar", f"data.val={root}",
                 f"output_dir={tmp_path / 'out'}", *TINY]) == 2
    assert "gives val shards" in capsys.readouterr().err
    assert _nothing_written(tmp_path / "out")


def test_check_is_cached_by_size_and_mtime(tmp_path, monkeypatch):
    root = _shards(tmp_path / "d")
    shards = sorted(str(p) for p in root.glob("val-*.tar"))
    first = shard_check.check_shards(shards, "data.val", 10)
    assert (first.num_samples, first.min_label, first.max_label, first.problem) == (30, 0, 9, None)
    assert (root / shard_check.CACHE_NAME).exists()
    scanned = []
    real_scan = shard_check.scan_shard
    monkeypatch.setattr(shard_check, "scan_shard", lambda p: scanned.append(p) or real_scan(p))
    assert shard_check.check_shards(shards, "data.val", 10) == first and scanned == []
    _truncate(shards[1])                                 # size and mtime change: read again
    again = shard_check.check_shards(shards, "data.val", 10)
    assert scanned == [shards[1]] and "truncated" in again.problem and shards[1] in again.problem


def test_check_cache_goes_to_run_dir_when_shard_folder_is_read_only(tmp_path, monkeypatch):
    root = _shards(tmp_path / "d")
    shards = sorted(str(p) for p in root.glob("val-*.tar"))
    real_access = os.access
    monkeypatch.setattr(shard_check.os, "access",
                        lambda p, mode: False if str(p) == str(root) else real_access(p, mode))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert shard_check.check_shards(shards, "data.val", 10, str(run_dir)).num_samples == 30
    assert not (root / shard_check.CACHE_NAME).exists()
    cached = json.loads((run_dir / shard_check.FALLBACK_NAME).read_text())["shards"]
    assert sorted(cached) == sorted(os.path.abspath(s) for s in shards)
    monkeypatch.setattr(shard_check, "scan_shard", lambda p: pytest.fail(f"re-read {p}"))
    assert shard_check.check_shards(shards, "data.val", 10, str(run_dir)).num_samples == 30


def test_shard_broken_after_the_check_names_it(tmp_path):
    root = _shards(tmp_path / "d")
    cfg = load_config(None, [f"data.train={root}", f"data.val={root}", *TINY,
                             "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]"])
    pipe = build_data(cfg, "val")
    with open(root / "val-000001.tar", "r+b") as f:
        f.truncate(512 + 50)                             # inside the first member's data
    with pytest.raises(DataError, match=r"val-000001.tar' cannot be read"):
        for _ in pipe.loader(0):
            pass


def test_all_corrupt_train_shards_name_the_bad_shard(tmp_path):
    x, y = digits(20)
    write_shards(str(tmp_path), "train", x, y, 20, corrupt=set(range(20)))
    cfg = load_config(None, [f"data.train={tmp_path}", f"data.val={tmp_path}", *TINY,
                             "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]", "aug.no_aug=true"])
    with pytest.raises(DataError, match=r"no readable sample .*train-000000.tar"):
        for _ in build_data(cfg, "train").loader(0):
            pass


# ------------------------------------------------------------------ the epoch survives evaluation
def test_epoch_checkpoint_is_saved_before_evaluation(tmp_path, monkeypatch):
    """Evaluation dies after the last epoch trained: the epoch's checkpoint exists, and
    resume=auto evaluates it without training again."""
    root = _shards(tmp_path / "d")
    out = tmp_path / "out"
    real_evaluate = results_mod.evaluate

    def broken(*args, **kwargs):
        raise OSError("simulated: the val storage went away")
    monkeypatch.setattr(results_mod, "evaluate", broken)
    with pytest.raises(OSError, match="simulated"):
        _run(root, out, "resume=auto")
    saved = list_checkpoints(str(out))
    assert [load_checkpoint(p)["epoch"] for p in saved] == [1]
    monkeypatch.setattr(results_mod, "evaluate", real_evaluate)
    assert _run(root, out, "resume=auto") == 0
    assert list_checkpoints(str(out)) == saved                 # nothing retrained
    result = json.loads((out / "eval.json").read_text())
    assert result["checkpoint"] == saved[0] and result["num_samples"] == 30


# ------------------------------------------------------------------ the run directory
def _hold_lock(run_dir):
    """Another live process holding `run_dir`'s lock; returns it (kill it to end the hold)."""
    import subprocess
    import sys
    code = ("import sys, time; from train_imagenet.run_lock import prepare_run_dir; "
            "prepare_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(600)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=root))
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_run_in_the_same_output_dir_is_refused(tmp_path, capsys):
    root = _shards(tmp_path / "d")
    out = tmp_path / "out"
    holder = _hold_lock(out)
    try:
        assert _run(root, out) == 2
        err = capsys.readouterr().err
        assert "is in use by another run" in err and f"pid {holder.pid}" in err
        assert _nothing_written(out)
    finally:
        holder.kill()
        holder.wait()
    assert _run(root, out) == 0                         # the holder died: its lock went with it
    assert list_checkpoints(str(out))


def test_refused_override_leaves_the_run_config_unchanged(tmp_path):
    root = _shards(tmp_path / "d")
    out = tmp_path / "out"
    assert _run(root, out) == 0
    before = (out / "config.yaml").read_text()
    assert _run(root, out, "resume=auto", "model_kwargs={img_size: 32, patch_size: 8, depth: 3, "
                "embed_dim: 24, num_heads: 2}", "epochs=2") == 2   # another architecture
    assert _run(root, out, "resume=auto", "data.num_classes=4") == 2
    assert (out / "config.yaml").read_text() == before


def test_stale_temporary_checkpoint_is_removed(tmp_path, capsys, caplog):
    root = _shards(tmp_path / "d")
    out = tmp_path / "out"
    out.mkdir()
    stale = out / ".ckpt-e0001-u00000006.pth.x1y2z3.tmp"
    stale.write_bytes(b"half a checkpoint")
    assert _run(root, out) == 0
    assert not stale.exists() and stale.name in caplog.text


@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_text("x"), "is a file, not a directory"),
    (lambda p: (p.parent / "f").write_text("x"), "cannot be written"),
])
def test_unusable_output_dir(tmp_path, capsys, make, message):
    root = _shards(tmp_path / "d")
    target = tmp_path / "target"
    make(target)
    out = target if target.exists() else tmp_path / "f" / "sub"
    assert _run(root, out) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_checkpoint_is_not_silently_ignored_by_resume_auto(tmp_path, capsys):
    root = _shards(tmp_path / "d")
    out = tmp_path / "out"
    assert _run(root, out) == 0
    other = list_checkpoints(str(out))[-1]
    capsys.readouterr()
    assert _run(root, out, "resume=auto", "epochs=2", f"checkpoint={other}") == 0
    assert "is not loaded: resume=auto continues this run" in capsys.readouterr().err


# ------------------------------------------------------------------ user errors: exit 2, no traceback
@pytest.mark.parametrize("args, message", [
    (["model_kwargs={img_size: 30, patch_size: 8, depth: 1, embed_dim: 24, num_heads: 2}",
      "data.img_size=30"], "data.img_size=30 is not a multiple of the patch size 8"),
    (["model_kwargs={img_size: 32, patch_size: 8"], "is not valid YAML"),
    (["optim.opt=adamq"], "optim.opt='adamq' is not a timm optimizer"),
    (["sched.sched=cosin"], "sched.sched='cosin' is not a timm scheduler"),
    pytest.param(["device=cuda"], "device=cuda but no CUDA device is visible", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a CUDA device is visible")),
    (["model=dcvit_tiny", "model_kwargs={img_size: 32, patch_size: 8, depth: 2, embed_dim: 24, "
      "num_heads: 2, query_wise: 'no'}"], "query_wise='no' must be True or False"),
    (["model=dcvit_tiny", "model_kwargs={img_size: 32, patch_size: 8, depth: 4, embed_dim: 24, "
      "num_heads: 2, dcmha_layers: 3}"], "dcmha_layers=3 must be a list of attention-layer indices"),
    (["--eval-only", "checkpoint=/nonexistent/ckpt.pth"], "does not exist"),
])
def test_user_errors_exit_2_before_any_work(tmp_path, capsys, args, message):
    root = _shards(tmp_path / "d")
    assert _run(root, tmp_path / "out", *args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert _nothing_written(tmp_path / "out")


def test_malformed_yaml_file_and_debug_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: vit\n  epochs: [1\n")
    assert main(["--config", str(bad)]) == 2
    assert "is not valid YAML" in capsys.readouterr().err
    from train_imagenet.config import ConfigError
    with pytest.raises(ConfigError, match="is not valid YAML"):
        main(["--config", str(bad), "--debug"])


# ------------------------------------------------------------------ damaged checkpoints
def _alter_a_tensor(path):
    """Flips one byte inside a tensor record of a torch.save zip (data.pkl stays intact)."""
    import zipfile
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def test_damaged_newest_checkpoint_falls_back_and_resumes_identically(tmp_path, caplog):
    root = _shards(tmp_path / "d")
    common = ["epochs=2", "save_every_steps=2", "keep_checkpoints=10"]
    full = tmp_path / "full"
    assert _run(root, full, *common) == 0
    mids = list_checkpoints(str(full))
    out = tmp_path / "out"
    out.mkdir()
    for p in mids[:4]:                                   # killed after its 4th save
        shutil.copy(p, out)
    newest = str(out / os.path.basename(mids[3]))
    _alter_a_tensor(newest)
    torch.load(newest, weights_only=True)               # unpickles: only the checksum tells
    assert _run(root, out, *common, "resume=auto") == 0
    assert newest in caplog.text and "damaged" in caplog.text
    assert os.path.exists(newest + ".corrupt")
    a, b = load_checkpoint(mids[-1]), load_checkpoint(list_checkpoints(str(out))[-1])
    assert a["update"] == b["update"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_damaged_checkpoint_named_explicitly_is_refused(tmp_path, capsys):
    root = _shards(tmp_path / "d")
    assert _run(root, tmp_path / "a") == 0
    path = list_checkpoints(str(tmp_path / "a"))[-1]
    _alter_a_tensor(path)
    assert _run(root, tmp_path / "b", f"resume={path}", "epochs=2") == 2
    assert "is damaged" in capsys.readouterr().err
    assert _run(root, tmp_path / "c", "--eval-only", f"checkpoint={path}") == 2
    assert "is damaged" in capsys.readouterr().err


def test_nan_stop_names_the_last_checkpoint_that_verifies(tmp_path, capsys, monkeypatch):
    """The checkpoint of update 6 is damaged on disk right after it was written; the NaN at
    update 7 then names update 4's checkpoint as the last good one, not the damaged file."""
    root = _shards(tmp_path / "d")
    real_save = trainer_mod.save_checkpoint

    def save_then_damage(state, run_dir, keep):
        path = real_save(state, run_dir, keep)
        if state["update"] == 6:
            _alter_a_tensor(path)
        return path
    monkeypatch.setattr(trainer_mod, "save_checkpoint", save_then_damage)
    nan_loss_at(monkeypatch, 7)
    out = tmp_path / "out"
    assert _run(root, out, "epochs=2", "save_every_steps=2", "keep_checkpoints=5",
                "log_every=2") == 3
    err = capsys.readouterr().err
    assert "loss is nan at epoch 1, update 7" in err
    assert "The last good checkpoint is " + str(out / "ckpt-e0000-u00000004.pth") in err


# ------------------------------------------------------------------ corrupt validation images
def test_corrupt_val_image_is_counted_in_eval_json_and_the_log(tmp_path, capsys):
    """A val sample that does not decode is left out of the metrics, counted in eval.json's
    corrupt_skipped and named in the log; data.on_corrupt=fail refuses it."""
    root = tmp_path / "d"
    x, y = digits(78)
    write_shards(str(root), "train", x[:48], y[:48], 16)
    write_shards(str(root), "val", x[48:], y[48:], 15, corrupt={2})       # 30 val samples
    out = tmp_path / "out"
    assert _run(root, out) == 0
    with open(out / "eval.json") as f:
        result = json.load(f)
    assert (result["num_samples"], result["corrupt_skipped"]) == (29, 1)
    err = capsys.readouterr().err
    assert err.count("evaluation: skipped 1 corrupt samples") == 1, err
    assert "the metrics cover the other 29" in err
    assert main([f"data.val={root}", f"output_dir={out}", *TINY, "--eval-only"]) == 0
    with open(out / "eval.json") as f:
        assert json.load(f)["corrupt_skipped"] == 1
    assert "evaluation: skipped 1 corrupt samples" in capsys.readouterr().err
    assert _run(root, tmp_path / "strict", "data.on_corrupt=fail") == 2
    assert "corrupt sample '00000002'" in capsys.readouterr().err
