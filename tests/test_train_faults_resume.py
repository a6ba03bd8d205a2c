"""Trainer faults found by trying to break a run as a user or a cluster would: a resume into
a run with other data or batches, a stopped rank, unreadable checkpoint files, a full disk,
numbers out of range, and records lost across a restart. Each ends in a clear refusal
before any work, or is handled with nothing lost (docs/training_fault_cases.md)."""
import csv
import errno
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from argparse import Namespace

import pytest
import torch

import train_imagenet.__main__ as entry_mod
import train_imagenet.checkpoint as checkpoint_mod
import train_imagenet.results as results_mod
from train_imagenet.__main__ import main
from train_imagenet.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from train_imagenet.data import DataError
from train_imagenet.distributed import timeout_message, waiting_for
from train_imagenet.engine import EpochState, Loop, train_one_epoch
from train_helpers import TINY_RUN, kill_torchrun, read_records, torchrun_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [*TINY_RUN, "sched.min_lr=1e-5", "epochs=2", "aug.mixup=0", "aug.cutmix=0"]
MID = "ckpt-e0001-u00000020.pth"     # epoch 1, batch 8 of 12 (96 samples, batch 8)


@pytest.fixture(scope="module")
def data(digits_shards):
    return digits_shards()                          # 96 train samples in 4 shards, 53 val


@pytest.fixture(scope="module")
def small(digits_shards):
    return digits_shards(48, 53, 24, 20)            # 48 train samples in 2 shards


def _run(data, out, *extra, train=None):
    return main([f"data.train={train or data.root}", f"data.val={data.root}",
                 f"output_dir={out}", *TINY, *extra])


_records = read_records


@pytest.fixture(scope="module")
def full(data, tmp_path_factory):
    """An uninterrupted 2-epoch run with a checkpoint every 5 updates (all kept)."""
    out = tmp_path_factory.mktemp("full")
    assert _run(data, out, "save_every_steps=5", "keep_checkpoints=20") == 0
    return out


def _killed_after(full, name, out):
    """`out` as a run killed right after writing `full`'s checkpoint `name`."""
    out.mkdir()
    shutil.copy(full / name, out)
    return out


# ------------------------------------------------------------------ resume into another run
@pytest.mark.parametrize("change, said", [
    ("train", "data.train: 4 shards (train-000000.tar .. train-000003.tar"),
    ("batch_size=4", "batch_size (per process): 8 -> 4; global batch 8 -> 4"),
    ("accum_steps=2", "accum_steps: 1 -> 2"),
])
def test_resume_with_other_data_or_batches_is_refused(data, small, full, tmp_path, capsys,
                                                     change, said):
    out = _killed_after(full, MID, tmp_path / "out")
    extra = [] if change == "train" else [change]
    assert _run(data, out, "resume=auto", *extra, train=small.root if change == "train" else None) == 2
    err = capsys.readouterr().err
    assert said in err and "resume_at_epoch_boundary=true" in err and "another output_dir" in err
    if change == "train":
        assert "-> 2 shards (train-000000.tar .. train-000001.tar" in err and "48 samples" in err
    assert list_checkpoints(str(out)) == [str(out / MID)] and not (out / "config.yaml").exists()


def test_rewritten_shard_of_the_same_name_is_a_change(data, full, tmp_path, capsys):
    copy = tmp_path / "data"
    shutil.copytree(data.root, copy)
    with open(copy / "train-000003.tar", "ab") as f:
        f.write(b"\0" * 1024)                        # another size: other content
    out = _killed_after(full, MID, tmp_path / "out")
    assert _run(data, out, "resume=auto", train=str(copy)) == 2
    assert "the shards were rewritten (train-000003.tar" in capsys.readouterr().err


def test_resume_at_epoch_boundary_continues_on_the_new_schedule(data, small, full, tmp_path, capsys):
    """On purpose: from the mid-epoch checkpoint's next boundary (epoch 2) with 6 updates per
    epoch: the update count is 2 x 6, and the schedule anneals to min_lr at the run's end."""
    out = _killed_after(full, MID, tmp_path / "out")
    assert _run(data, out, "resume=auto", "resume_at_epoch_boundary=true", "epochs=3",
                train=small.root) == 0
    err = capsys.readouterr().err
    assert "continuing from the start of epoch 2 (update 12" in err and "rest of epoch 1" in err
    assert [r["epoch"] for r in _records(out)] == [2]
    final = load_checkpoint(list_checkpoints(str(out))[-1])
    assert (final["epoch"], final["update"]) == (3, 18)
    assert _records(out)[0]["lr"] == pytest.approx(1e-5)            # annealed to sched.min_lr
    assert final["position"]["train_data"]["num_samples"] == 48


def test_same_run_resumes_without_the_flag(data, full, tmp_path):
    out = _killed_after(full, MID, tmp_path / "out")
    assert _run(data, out, "resume=auto", "save_every_steps=5", "keep_checkpoints=20") == 0


def _cosine(t, total, lr_max=2e-3, lr_min=1e-5):
    """timm's cosine schedule after the warm-up (TINY: lr 2e-3, min_lr 1e-5), at update t."""
    return lr_min + 0.5 * (lr_max - lr_min) * (1 + math.cos(math.pi * t / total))


def test_resume_with_more_epochs_follows_the_new_schedule(data, full, tmp_path, capsys):
    """epochs 2 -> 3 on a resume at update 20 (12 updates per epoch): the schedule is this
    config's cosine over 36 updates, and the log says so; the saved one (24 updates) would
    have ended epoch 1 at min_lr."""
    out = _killed_after(full, MID, tmp_path / "out")
    assert _run(data, out, "resume=auto", "epochs=3") == 0
    err = capsys.readouterr().err
    assert (f"was saved with another learning-rate schedule or weight decay (epochs 2 -> 3): continuing on this "
            f"config's schedule from update 20, where the learning rate is {_cosine(20, 36):.3g} "
            f"(it was {_cosine(20, 24):.3g} at the save)") in err
    records = _records(out)
    assert [r["epoch"] for r in records] == [1, 2]
    assert records[0]["lr"] == pytest.approx(_cosine(24, 36), rel=1e-6)
    assert records[1]["lr"] == pytest.approx(1e-5)
    final = load_checkpoint(list_checkpoints(str(out))[-1])
    assert (final["epoch"], final["update"]) == (3, 36)


def test_resume_with_another_weight_decay_follows_the_config(data, full, tmp_path, capsys):
    """The optimizer's moments come from the checkpoint, its weight decay from the config
    (the groups without decay keep none)."""
    out = _killed_after(full, MID, tmp_path / "out")
    assert _run(data, out, "resume=auto", "optim.weight_decay=0.123") == 0
    assert "(optim.weight_decay " in capsys.readouterr().err
    final = load_checkpoint(list_checkpoints(str(out))[-1])
    assert {g["weight_decay"] for g in final["optimizer"]["param_groups"]} == {0.0, 0.123}


def test_resume_past_the_new_last_epoch_is_refused(data, full, tmp_path, capsys):
    out = _killed_after(full, MID, tmp_path / "out")
    assert _run(data, out, "resume=auto", "epochs=1") == 2
    err = capsys.readouterr().err
    assert "is at epoch 1, batch 8: this run's epochs=1 leave nothing to train; set epochs=2 or more" in err
    assert list_checkpoints(str(out)) == [str(out / MID)] and not (out / "config.yaml").exists()


class _Pipe:
    """A train pipe of `total` batches whose loader yields `n` of them."""
    def __init__(self, total, n):
        self.batches_per_epoch, self.n = total, n

    def loader(self, epoch):
        return [(torch.randn(2, 4), torch.tensor([0, 1]), 0)] * self.n


@pytest.mark.parametrize("start_batch, yielded, error, message", [
    (3, 3, CheckpointError, "would resume at batch 3, but it has 3 batches"),
    (0, 0, DataError, "epoch 0 ran no update"),
])
def test_an_epoch_with_no_update_is_an_error(start_batch, yielded, error, message):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = Namespace(step_update=lambda u: None)
    with pytest.raises(error, match=message):
        train_one_epoch(Loop(model, opt, sched, torch.nn.functional.cross_entropy,
                             torch.device("cpu")), _Pipe(3, yielded), EpochState(0, 0, start_batch))


# ------------------------------------------------------------------ a rank that stops answering
def test_timeout_message_names_the_rank_and_what_it_waited_for():
    waiting_for("the loss check of epoch 3 at update 1200")
    line = timeout_message(RuntimeError(
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation"), 5)
    assert line.startswith("rank 0 waited more than dist_timeout=5 s") and \
        "in the loss check of epoch 3 at update 1200" in line and "resume=auto" in line
    assert timeout_message(RuntimeError("size mismatch"), 5) is None


def test_collective_timeout_exits_4_with_one_line(data, tmp_path, capsys, monkeypatch):
    def stuck(cfg):
        waiting_for("the gradient all-reduce of epoch 0, update 7")
        raise RuntimeError("[unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation")
    monkeypatch.setattr(entry_mod, "run", stuck)
    assert _run(data, tmp_path / "out", "dist_timeout=10") == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: rank 0 waited more than dist_timeout=10 s")
    assert "gradient all-reduce of epoch 0, update 7" in err[0] and "Traceback" not in err[0]


def _ended_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lost_peer_message_names_the_lost_rank(monkeypatch):
    """Rank 1's process on this host has ended: rank 0's line names it by its pid; a rank on
    another host is named as the one on another host."""
    import socket
    import train_imagenet.distributed as dist_mod
    here = socket.gethostname()
    monkeypatch.setitem(dist_mod._group, "peers", [(here, os.getpid()), (here, _ended_pid())])
    waiting_for("the gradient all-reduce of epoch 2, update 31")
    error = RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:40123: "
                         "Connection reset by peer")
    line = timeout_message(error, 5) or dist_mod.lost_peer_message(error)
    assert line.startswith("rank 0 lost rank 1 (pid ") and "in the gradient all-reduce of " \
        "epoch 2, update 31 (process ended)" in line
    monkeypatch.setitem(dist_mod._group, "peers", [(here, os.getpid()), ("node-gone.invalid", 4242)])
    line = dist_mod.lost_peer_message(error)
    assert "lost rank 1 (pid 4242 on node-gone.invalid)" in line and "on another host" in line
    assert dist_mod.lost_peer_message(RuntimeError("size mismatch")) is None


def test_lost_peer_exits_4_with_one_line(data, tmp_path, capsys, monkeypatch):
    import socket
    import train_imagenet.distributed as dist_mod
    monkeypatch.setitem(dist_mod._group, "peers",
                        [(socket.gethostname(), os.getpid()), (socket.gethostname(), _ended_pid())])

    def lost(cfg):
        waiting_for("the loss check of epoch 0 at update 5")
        raise RuntimeError("Connection closed by peer [127.0.0.1]:5000")
    monkeypatch.setattr(entry_mod, "run", lost)
    assert _run(data, tmp_path / "out") == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: rank 0 lost rank 1 (pid "), err
    assert "the loss check of epoch 0 at update 5" in err[0]
    assert err[0].endswith("No checkpoint was saved yet: run the job again")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_stopped_rank_ends_the_run_within_dist_timeout(data, tmp_path):
    """SIGSTOP on rank 1 of two: rank 0 waits dist_timeout=10 s in its next collective, then
    the run ends non-zero with one line naming rank 0 and what it waited for; the newest
    checkpoint verifies."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "train_imagenet", f"data.train={data.root}", f"data.val={data.root}",
           f"output_dir={out}", *TINY, "epochs=100", "save_every_steps=2", "dist_timeout=10"]
    agent = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1",
                                                     PYTHONPATH=ROOT),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    workers = {}
    try:
        deadline = time.time() + 300
        while not list_checkpoints(str(out)) and agent.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        workers = torchrun_workers(agent.pid)
        assert agent.poll() is None and 1 in workers, "the run did not get to its first checkpoint"
        os.kill(workers[1], signal.SIGSTOP)
        log, _ = agent.communicate(timeout=180)
    finally:
        kill_torchrun(agent, workers)
    assert agent.returncode != 0
    lines = [ln for ln in log.splitlines() if "error: rank 0 waited more than dist_timeout=10 s" in ln]
    assert len(lines) == 1, log[-3000:]
    # what rank 0 waited for depends on where rank 1 stopped (an update's all-reduce, a save, ...)
    waited = re.search(r"for the other ranks in (.+?): a rank stopped, hung or was lost", lines[0])
    assert waited and re.search(r"epoch \d+", waited.group(1)), lines[0]
    assert "the last checkpoint is " in lines[0]
    newest = list_checkpoints(str(out))[-1]
    assert newest in lines[0]
    load_checkpoint(newest)                                          # verifies its checksum


# ------------------------------------------------------------------ files that are not checkpoints
def _safetensors(tmp_path, full, keep):
    from safetensors.torch import save_file
    path = tmp_path / "w.safetensors"
    save_file(load_checkpoint(str(full / MID))["model"], str(path))
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep))
    return path


@pytest.mark.parametrize("how", ["--eval-only", "start"])
def test_truncated_safetensors_is_refused(data, full, tmp_path, capsys, how):
    path = _safetensors(tmp_path, full, 0.5)
    args = ["--eval-only"] if how == "--eval-only" else []
    assert _run(data, tmp_path / "out", *args, f"checkpoint={path}") == 2
    err = capsys.readouterr().err
    assert f"checkpoint={str(path)!r} cannot be read: it is truncated or damaged" in err
    assert "Traceback" not in err


def _legacy_pickle(tmp_path):
    path = tmp_path / "legacy.pth"
    with open(path, "wb") as f:
        pickle.dump({"model": Namespace(w=1)}, f)                   # not a zip: a plain pickle
    return path


@pytest.mark.parametrize("key", ["checkpoint", "resume"])
def test_legacy_pickle_is_not_a_safe_checkpoint(data, tmp_path, capsys, key):
    path = _legacy_pickle(tmp_path)
    assert _run(data, tmp_path / "out", f"{key}={path}") == 2
    err = capsys.readouterr().err
    assert "is not a safe checkpoint" in err and "never unpickled" in err
    assert "weights_only" not in err and "Traceback" not in err


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(data, tmp_path, capsys, monkeypatch):
    real_save = checkpoint_mod._save
    saves = []

    def save_until_full(state, tmp):
        saves.append(tmp)
        if len(saves) == 3:
            with open(tmp, "wb") as f:
                f.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(state, tmp)
    monkeypatch.setattr(checkpoint_mod, "_save", save_until_full)
    out = tmp_path / "out"
    assert _run(data, out, "save_every_steps=2") == 2
    err = capsys.readouterr().err
    kept = list_checkpoints(str(out))
    assert [os.path.basename(p) for p in kept] == ["ckpt-e0000-u00000002.pth", "ckpt-e0000-u00000004.pth"]
    assert f"error: no space left on " in err and \
        f"writing {out / 'ckpt-e0000-u00000006.pth'}; the checkpoints already there are intact (the " \
        f"newest: {kept[-1]})" in err
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    load_checkpoint(kept[-1])
    monkeypatch.setattr(checkpoint_mod, "_save", real_save)       # space freed: resume
    assert _run(data, out, "save_every_steps=2", "resume=auto") == 0
    assert "resumed from" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("optim.lr=-1", "optim.lr=-1.0 must be > 0"),
    ("optim.lr=.nan", "optim.lr=nan must be > 0"),
    ("epochs=0", "epochs=0 must be >= 1"),
    ("batch_size=0", "batch_size=0 must be >= 1"),
    ("sched.warmup_epochs=-1", "sched.warmup_epochs=-1.0 must be >= 0"),
    ("optim.weight_decay=-0.05", "optim.weight_decay=-0.05 must be >= 0"),
    ("aug.reprob=1.5", "aug.reprob=1.5 must be in [0, 1]"),
    ("drop_path=-0.1", "drop_path=-0.1 must be in [0, 1]"),
    ("ema.decay=2", "ema.decay=2.0 must be in [0, 1]"),
    ("aug.smoothing=1", "aug.smoothing=1.0 must be in [0, 1)"),
    ("aug.scale=[0.5, 0.1]", "aug.scale=[0.5, 0.1] must be [min, max]"),
    ("dist_timeout=0", "dist_timeout=0.0 must be > 0"),
    ("data.std=[0, 0, 0]", "data.std=[0.0, 0.0, 0.0]: each value must be > 0"),
    ("data.std=[0.2, -0.2, 0.2]", "data.std=[0.2, -0.2, 0.2]: each value must be > 0"),
    ("seed=9223372036854775808", "seed=9223372036854775808 must be in [-2**63, 2**63 - 1]"),
])
def test_numbers_out_of_range_name_the_key(data, tmp_path, capsys, override, message):
    assert _run(data, tmp_path / "out", override) == 2
    err = capsys.readouterr().err
    assert message in err and "optimizer" not in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ records across a restart
def test_stop_during_evaluation_loses_no_record(data, full, tmp_path, monkeypatch):
    """The run stops while evaluating epoch 0 (after its checkpoint): the resumed run
    evaluates and logs epoch 0, so log.jsonl and summary.csv equal the uninterrupted run's."""
    real = results_mod.evaluate

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt("stopped during evaluation")        # as SIGTERM/SIGINT would
    monkeypatch.setattr(results_mod, "evaluate", stopped)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _run(data, out, "resume=auto", "save_every_steps=5", "keep_checkpoints=20")
    assert not (out / "log.jsonl").exists()
    monkeypatch.setattr(results_mod, "evaluate", real)
    assert _run(data, out, "resume=auto", "save_every_steps=5", "keep_checkpoints=20") == 0
    got, want = _records(out), _records(full)
    assert [r["epoch"] for r in got] == [0, 1]
    for a, b in zip(got, want):
        for key in ("train_loss", "lr", "top1", "top5", "val_loss", "corrupt_skipped"):
            assert a[key] == b[key], key
    with open(out / "summary.csv") as f:
        assert [row["epoch"] for row in csv.DictReader(f)] == ["0", "1"]


def test_resumed_epoch_record_covers_the_whole_epoch(data, full, tmp_path):
    out = _killed_after(full, MID, tmp_path / "out")
    assert _run(data, out, "resume=auto", "save_every_steps=5", "keep_checkpoints=20") == 0
    got = [r for r in _records(out) if r["epoch"] == 1]
    want = [r for r in _records(full) if r["epoch"] == 1]
    assert len(got) == 1 and got[0]["train_loss"] == want[0]["train_loss"]
    assert got[0]["corrupt_skipped"] == want[0]["corrupt_skipped"]
    assert load_checkpoint(str(full / MID))["totals"]["loss_n"] == 8     # 8 of the epoch's 12
