"""Stop signals (SIGTERM, SIGUSR1, SIGHUP; SIGINT with exit code 130) end a run after the
update in progress with a checkpoint and exit code 75, mid-epoch, during an evaluation or
during a save, and a second signal does not kill the process as it ends; the resumed run ends
bit-identical to an uninterrupted one, with every epoch logged once. One process here; the
torchrun cases (signals to the launcher and to one rank, a lost node) are in
test_train_distributed.py."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import train_imagenet.engine as engine_mod
import train_imagenet.results as results_mod
import train_imagenet.trainer as trainer_mod
from train_imagenet.__main__ import main
from train_imagenet.checkpoint import list_checkpoints, load_checkpoint
from train_imagenet.logs import CSV_FIELDS
from train_imagenet.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED
from train_helpers import TINY_RUN, read_records as _records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [*TINY_RUN, "epochs=2", "aug.mixup=0", "aug.cutmix=0", "drop_path=0.1"]
KEYS = ("train_loss", "lr", "top1", "top5", "val_loss", "corrupt_skipped")


@pytest.fixture(scope="module")
def data(digits_shards):
    return digits_shards()                 # 96 train samples in 4 shards: 12 updates an epoch


def _run(data, out, *extra):
    return main([f"data.train={data.root}", f"data.val={data.root}", f"output_dir={out}",
                 *TINY, "resume=auto", *extra])


@pytest.fixture(scope="module")
def full(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    assert _run(data, out) == 0
    return out


def _same_run(a, b):
    """The final weights of two runs are equal bit for bit, and their logs hold the same
    records, one per epoch."""
    wa, wb = load_checkpoint(list_checkpoints(str(a))[-1]), load_checkpoint(list_checkpoints(str(b))[-1])
    assert wa["update"] == wb["update"] == 24
    for k in wa["model"]:
        assert torch.equal(wa["model"][k], wb["model"][k]), k
    ra, rb = _records(a), _records(b)
    assert [r["epoch"] for r in ra] == [r["epoch"] for r in rb] == [0, 1]
    for x, y in zip(ra, rb):
        for key in KEYS:
            assert x[key] == y[key], key


def _signal_at(sig):
    os.kill(os.getpid(), sig)


@pytest.mark.parametrize("sig, code", [(signal.SIGUSR1, EXIT_PREEMPTED), (signal.SIGHUP, EXIT_PREEMPTED),
                                       (signal.SIGINT, EXIT_INTERRUPTED)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_stop_signal_mid_epoch_saves_there_and_resumes_identically(data, full, tmp_path, capsys,
                                                                   monkeypatch, sig, code):
    """SIGUSR1, SIGHUP (a closed terminal) and SIGINT (Ctrl-C) save at the signal and print
    one line with the command that continues; Ctrl-C exits 130, the others 75."""
    real, before = engine_mod.train_step, signal.getsignal(sig)

    def step(loop, batch, state):
        state = real(loop, batch, state)
        if state.update == 15 and state.batch == 3:          # epoch 1, batch 3
            _signal_at(sig)
        return state
    monkeypatch.setattr(engine_mod, "train_step", step)
    out = tmp_path / "out"
    assert _run(data, out) == code
    newest = list_checkpoints(str(out))[-1]
    assert newest.endswith("ckpt-e0001-u00000015.pth")
    saved = load_checkpoint(newest)
    assert (saved["epoch"], saved["batch"], saved["totals"]["loss_n"]) == (1, 3, 3)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "stopped by" in ln]
    assert len(lines) == 1 and f"stopped by {sig.name} after epoch 1, batch 3, update 15" in lines[0]
    assert newest in lines[0] and f"exit code {code}; to continue: python -m train_imagenet " \
        f"data.train={data.root} " in lines[0] and lines[0].endswith(" resume=auto")
    assert lines[0].count("resume=") == 1 and "Traceback" not in err
    assert [r["epoch"] for r in _records(out)] == [0]
    assert signal.getsignal(sig) is before                     # the handlers are put back
    monkeypatch.setattr(engine_mod, "train_step", real)
    assert _run(data, out) == 0
    _same_run(full, out)


def _signal_before(monkeypatch, module, name):
    """`module.name` sends this process SIGTERM before it runs; returns the real one."""
    real = getattr(module, name)

    def signalled(*args, **kwargs):
        _signal_at(signal.SIGTERM)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, signalled)
    return real


def test_sigterm_during_evaluation_ends_with_the_epochs_checkpoint(data, full, tmp_path, monkeypatch):
    real = _signal_before(monkeypatch, results_mod, "evaluate")
    out = tmp_path / "out"
    assert _run(data, out) == EXIT_PREEMPTED
    assert list_checkpoints(str(out))[-1].endswith("ckpt-e0001-u00000012.pth")
    assert [r["epoch"] for r in _records(out)] == [0]          # evaluated, logged, then stopped
    monkeypatch.setattr(results_mod, "evaluate", real)
    assert _run(data, out) == 0
    _same_run(full, out)                                       # epoch 0 not logged twice


def test_sigterm_during_a_save_ends_with_that_checkpoint(data, full, tmp_path, monkeypatch):
    real = _signal_before(monkeypatch, trainer_mod, "save_checkpoint")
    out = tmp_path / "out"
    assert _run(data, out) == EXIT_PREEMPTED
    assert list_checkpoints(str(out))[-1].endswith("ckpt-e0001-u00000012.pth")
    assert not (out / "log.jsonl").exists()     # epoch 0's record is in its checkpoint
    monkeypatch.setattr(trainer_mod, "save_checkpoint", real)
    assert _run(data, out) == 0                 # evaluates and logs epoch 0, then trains on
    _same_run(full, out)


def test_line_cut_short_by_a_kill_is_not_continued_on_resume(data, full, tmp_path, monkeypatch,
                                                             caplog):
    """A run killed while appending epoch 0's record leaves a line cut short in log.jsonl and
    summary.csv: the resumed run removes it (with a warning) and writes the record again
    (its checkpoint holds it), so every line parses and the run equals an uninterrupted one."""
    real = _signal_before(monkeypatch, trainer_mod, "save_checkpoint")
    out = tmp_path / "out"
    assert _run(data, out) == EXIT_PREEMPTED             # epoch 0 saved, not yet logged
    record = load_checkpoint(list_checkpoints(str(out))[-1])["record"]
    (out / "log.jsonl").write_text(json.dumps(record)[:25])
    (out / "summary.csv").write_text(",".join(CSV_FIELDS) + "\n0,2.3")
    monkeypatch.setattr(trainer_mod, "save_checkpoint", real)
    assert _run(data, out) == 0
    _same_run(full, out)                                 # every line of log.jsonl parses
    with open(out / "summary.csv") as f:
        assert [ln.split(",")[0] for ln in f.read().splitlines()] == ["epoch", "0", "1"]
    assert f"{out / 'log.jsonl'} ended in a line cut short (25 bytes" in caplog.text


@pytest.mark.parametrize("sig, code", [("SIGTERM", EXIT_PREEMPTED), ("SIGINT", EXIT_INTERRUPTED)])
def test_second_signal_50ms_later_leaves_the_exit_code(data, tmp_path, sig, code):
    """SLURM and torchrun each forward a SIGTERM (a user presses Ctrl-C twice): the process
    run as `python -m train_imagenet` saves and exits with its code, not killed by the second
    (status 143 or 130, or a KeyboardInterrupt traceback)."""
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "signal_after_update.py"),
                        f"twice-{sig}", "3", f"data.train={data.root}", f"data.val={data.root}",
                        f"output_dir={out}", *TINY], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert p.returncode == code, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if "stopped by" in ln]
    assert len(lines) == 1 and f"stopped by {sig} after epoch 0, batch 3, update 3" in lines[0]
    assert list_checkpoints(str(out))[-1].endswith("ckpt-e0000-u00000003.pth")
    assert "Traceback" not in p.stderr
