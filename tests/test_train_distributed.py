"""Multi-process runs under torchrun on CPU (gloo): DDP equals one process with the same global
batch; a worker killed mid-epoch and restarted by torchrun ends where an uninterrupted run
ends; two torchrun agents (--nnodes=2) rendezvous on localhost and train together; a stop
signal (SIGTERM to the launcher, SIGUSR1 to one rank) ends the run with a checkpoint that
resumes identically; a node lost outright ends the other with one line, and the job started
again (as a requeue does) resumes identically."""
import json
import os
import signal
import socket
import subprocess
import tempfile
import sys

import pytest
import torch

from train_imagenet.__main__ import main
from train_imagenet.checkpoint import list_checkpoints, load_checkpoint

from train_imagenet.preemption import EXIT_PREEMPTED

from train_helpers import digits, write_folder, write_shards

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model=vit_tiny_patch16_224",
        "model_kwargs={img_size: 32, patch_size: 8, depth: 1, embed_dim: 24, num_heads: 2}",
        "data.num_classes=10", "data.img_size=32", "data.shuffle_buffer=16", "data.crop_pct=1.0",
        "optim.lr=2e-3", "optim.lr_batch_size=null", "sched.warmup_epochs=1", "threads=1"]
AUG = ["aug.auto_augment=rand-m9-mstd0.5-inc1", "aug.mixup=0.8", "aug.cutmix=1.0", "drop_path=0.1",
       "ema.enabled=true", "ema.decay=0.9", "epochs=2", "batch_size=8", "data.num_workers=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(launcher, args, entry=("-m", "train_imagenet")):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, *entry, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(proc, timeout=420, ok=True):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)            # the agent and its workers, nothing else
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s:\n{out[-4000:]}")
    if ok:
        assert proc.returncode == 0, out[-4000:]
    return out


def _assert_same_weights(a, b):
    wa, wb = _final(a), _final(b)
    assert wa["update"] == wb["update"] == 12
    for k in wa["model"]:
        assert torch.equal(wa["model"][k], wb["model"][k]), k
        assert torch.equal(wa["ema"][k], wb["ema"][k]), k
    assert _json(a / "eval.json")["top1"] == _json(b / "eval.json")["top1"]


def _final(run_dir):
    return load_checkpoint(list_checkpoints(str(run_dir))[-1])


def _json(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def private_tmp():
    """A temporary directory outside pytest's numbered ones, which a concurrent pytest session
    of the same user may delete while these minute-long runs still use them."""
    with tempfile.TemporaryDirectory(prefix="train_imagenet_mp_") as d:
        yield d


@pytest.fixture
def tmp_path(private_tmp, request):
    """An empty directory per test; a rerun (``--reruns``, CI's slow tier) gets its own again
    in place of the failed attempt's, which would otherwise make the rerun an error."""
    import pathlib
    import shutil
    path = pathlib.Path(private_tmp) / request.node.name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def shards(private_tmp):
    root = os.path.join(private_tmp, "digits")
    x, y = digits(149)
    write_shards(root, "train", x[:96], y[:96], 24)      # 4 shards
    write_shards(root, "val", x[96:], y[96:], 20)        # 53 samples in 3 shards
    return root


@pytest.fixture(scope="module")
def reference(shards, private_tmp):
    """An uninterrupted 2-process run on the shards, with every source of randomness on."""
    import pathlib
    out = pathlib.Path(private_tmp) / "reference"
    _finish(_torchrun(["--standalone", "--nproc_per_node=2"],
                      [f"data.train={shards}", f"data.val={shards}", f"output_dir={out}", *TINY, *AUG]))
    return out


def _two_ranks_and_one(tmp_path, args, ddp_args=()):
    """The same run on 64 digits (no augmentation, no drop path) as two torchrun ranks at
    batch 8 (in tmp_path/ddp) and as one process at batch 16 (in tmp_path/one): the two final
    checkpoints and the torchrun log."""
    x, y = digits(120)
    write_folder(str(tmp_path / "train"), x[:64], y[:64])
    write_folder(str(tmp_path / "val"), x[64:], y[64:])
    common = [f"data.train={tmp_path / 'train'}", f"data.val={tmp_path / 'val'}", *TINY,
              "aug.no_aug=true", "aug.mixup=0", "aug.cutmix=0", "aug.smoothing=0", "drop_path=0",
              "data.num_workers=0", *args]
    log = _finish(_torchrun(["--standalone", "--nproc_per_node=2"],
                            [*common, "batch_size=8", *ddp_args, f"output_dir={tmp_path / 'ddp'}"]))
    n = torch.get_num_threads()
    try:
        assert main([*common, "batch_size=16", f"output_dir={tmp_path / 'one'}"]) == 0
    finally:
        torch.set_num_threads(n)
    return _final(tmp_path / "ddp"), _final(tmp_path / "one"), log


def test_ddp_two_processes_equal_one_with_same_global_batch(tmp_path):
    a, b, _ = _two_ranks_and_one(tmp_path, ["epochs=2", "optim.clip_grad=1.0"])
    assert a["update"] == b["update"] == 8                       # 64 samples / 16 x 2 epochs
    diffs = [(a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"]]
    assert max(diffs) < 1e-5, max(diffs)
    first = load_checkpoint(list_checkpoints(str(tmp_path / "one"))[0])      # after epoch 0
    assert first["update"] == 4
    assert max((a["model"][k] - first["model"][k]).abs().max().item() for k in a["model"]) > 1e-4
    ra, rb = _json(tmp_path / "ddp" / "eval.json"), _json(tmp_path / "one" / "eval.json")
    assert ra["num_samples"] == rb["num_samples"] == 56 and ra["top1"] == pytest.approx(rb["top1"])


def test_killed_worker_restarted_by_torchrun_ends_identically(shards, reference, tmp_path):
    """Both ranks exit hard after update 9 (tests/exit_after_update.py); torchrun restarts
    them, they resume from update 8's checkpoint and end as the uninterrupted run."""
    out = tmp_path / "restarted"
    log = _finish(_torchrun(["--standalone", "--nproc_per_node=2", "--max-restarts=1"],
                            [f"data.train={shards}", f"data.val={shards}", f"output_dir={out}",
                             *TINY, *AUG, "resume=auto", "save_every_steps=4",
                             "keep_checkpoints=5"],
                            entry=[os.path.join(ROOT, "tests", "exit_after_update.py"), "9"]))
    assert "simulated failure" in log and "resumed from" in log and "u00000008" in log
    a, b = _final(reference), _final(out)
    assert a["update"] == b["update"] == 12
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
        assert torch.equal(a["ema"][k], b["ema"][k]), k
    ra, rb = _json(reference / "eval.json"), _json(out / "eval.json")
    assert (ra["top1"], ra["top5"], ra["num_samples"]) == (rb["top1"], rb["top5"], rb["num_samples"])


def test_two_node_rendezvous_on_localhost(shards, reference, tmp_path):
    out = tmp_path / "two_nodes"
    port = _free_port()
    launcher = ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=dcvit-test", "--max-restarts=0"]
    args = [f"data.train={shards}", f"data.val={shards}", f"output_dir={out}", *TINY, *AUG]
    agents = [_torchrun(launcher, args) for _ in range(2)]
    for agent in agents:
        _finish(agent)
    a, b = _final(reference), _final(out)                  # same world size, same ranks' data
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert _json(out / "eval.json")["top1"] == _json(reference / "eval.json")["top1"]


def test_compiled_ddp_equals_eager_one_process(tmp_path):
    """compile=true under torchrun: the model is compiled, then wrapped in DDP (timm's order);
    two compiled processes with accumulation end where one eager process with the same global
    batch ends, so DDP's gradient sync (and its skip on the first micro-batch) works through it."""
    a, b, out = _two_ranks_and_one(tmp_path, ["epochs=1", "accum_steps=2"], ["compile=true"])
    assert a["config"]["compile"] is True and b["config"]["compile"] is False, out[-2000:]
    assert a["update"] == b["update"] == 2                       # 64 samples / (16 x 2)
    diffs = [(a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"]]
    assert max(diffs) < 1e-4, max(diffs)
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in a["model"])  # plain names


SIGNAL_AFTER = os.path.join(ROOT, "tests", "signal_after_update.py")
_PROJECT_FRAME = f'File "{os.path.join(ROOT, "train_imagenet")}'   # a traceback through the trainer


@pytest.mark.parametrize("who, stop", [("launcher", None), ("rank1", 8)])
def test_stop_signal_saves_and_the_resumed_run_ends_identically(shards, reference, tmp_path,
                                                                who, stop):
    """`launcher`: SIGTERM to the torchrun agent after update 3 (it passes SIGTERM on to both
    ranks); `rank1`: SIGUSR1 to rank 1 alone after update 8. Both ranks stop after the same
    update, rank 0 saves there, the ranks exit 75; the run resumed with resume=auto ends
    bit-identical to the uninterrupted one, every epoch logged once."""
    out = tmp_path / "stopped"
    args = [f"data.train={shards}", f"data.val={shards}", f"output_dir={out}", *TINY, *AUG,
            "resume=auto"]
    log = _finish(_torchrun(["--standalone", "--nproc_per_node=2", "--max-restarts=0"], args,
                            entry=[SIGNAL_AFTER, who, "3" if stop is None else str(stop)]), ok=False)
    lines = [ln for ln in log.splitlines() if "[train_imagenet] stopped by" in ln]
    assert len(lines) == 1, log[-4000:]
    assert f"exit code {EXIT_PREEMPTED}" in lines[0] and _PROJECT_FRAME not in log, log[-4000:]
    assert list_checkpoints(str(out)), (lines, os.listdir(out))    # "[" in the path is no pattern
    newest = list_checkpoints(str(out))[-1]
    assert newest in lines[0]
    saved = load_checkpoint(newest)
    if stop is None:
        assert "stopped by SIGTERM" in lines[0] and 3 <= saved["update"] < 12
    else:
        assert "another rank" in lines[0] and saved["update"] == stop       # agreed at update 8
        assert newest.endswith("ckpt-e0001-u00000008.pth")
    _finish(_torchrun(["--standalone", "--nproc_per_node=2"], args))
    _assert_same_weights(reference, out)
    with open(out / "log.jsonl") as f:
        assert [json.loads(line)["epoch"] for line in f] == [0, 1]


def test_lost_node_says_one_line_and_the_restarted_job_resumes(shards, reference, tmp_path):
    """Two agents (--nnodes=2, one rank each); after update 5 node 1 is lost outright (its rank
    SIGKILLs its agent and itself). Node 0's rank prints one line naming rank 1, what it was
    doing and the checkpoint to resume from, and exits 4; the job started again on both nodes
    with resume=auto (what scripts/slurm_train.sh's requeue does) ends as the uninterrupted run."""
    out = tmp_path / "two_nodes"
    args = [f"data.train={shards}", f"data.val={shards}", f"output_dir={out}", *TINY, *AUG,
            "resume=auto", "save_every_steps=2", "dist_timeout=60"]

    def launcher():
        return ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=dcvit-lost", "--max-restarts=0"]
    port = _free_port()
    agents = [_torchrun(launcher(), args, entry=[SIGNAL_AFTER, "node1", "5"]) for _ in range(2)]
    logs = [_finish(agent, ok=False) for agent in agents]
    lines = [ln for log in logs for ln in log.splitlines() if ln.startswith("error: rank 0 lost")]
    assert len(lines) == 1, "\n----\n".join(log[-3000:] for log in logs)
    assert "rank 1 (pid" in lines[0] and "epoch 0" in lines[0] and "resume=auto" in lines[0]
    newest = list_checkpoints(str(out))[-1]
    assert f"Resume from {newest}" in lines[0] and newest.endswith("u00000004.pth")
    node0 = next(log for log in logs if "error: rank 0 lost" in log)
    assert _PROJECT_FRAME not in node0 and "Connection reset" not in node0, node0[-4000:]
    port = _free_port()
    for agent in [_torchrun(launcher(), args) for _ in range(2)]:
        _finish(agent)
    _assert_same_weights(reference, out)
