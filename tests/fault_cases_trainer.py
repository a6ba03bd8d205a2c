"""Reproduces the trainer's fault cases of docs/training_fault_cases.md against a checkout and
prints one line per case: the exit code and what the user sees.

    python tests/fault_cases_trainer.py [--repo CHECKOUT] [--skip-torchrun]

Each case runs `python -m train_imagenet` of CHECKOUT (default: this one) in a subprocess on
digits shards in a temporary directory; the disk-full case needs root (it mounts a small
tmpfs) and is skipped otherwise. The torchrun case stops one of two ranks with SIGSTOP and
waits at most 120 s for the run to end.
"""
import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from train_helpers import TINY_RUN  # noqa: E402  (from this checkout, after sys.path)

TINY = [*TINY_RUN, "aug.mixup=0", "aug.cutmix=0", "epochs=2"]


def _env(repo):
    return dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1")


def run(repo, args, prelude="", timeout=600):
    """`python -m train_imagenet ARGS` of `repo` (after `prelude`): (exit code, stderr)."""
    code = (f"import sys\n{prelude}\nfrom train_imagenet.__main__ import main\n"
            f"sys.exit(main(sys.argv[1:]))")
    p = subprocess.run([sys.executable, "-c", code, *args], cwd=repo, env=_env(repo),
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stderr


def salient(err):
    """The line a user reads: `error: ...`, else the exception line of a traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("error:"):
            return ln[:300]
    tb = [ln for ln in lines if not ln.startswith((" ", "[train_imagenet]", "Traceback"))]
    return (tb[-1] if tb else (lines[-1] if lines else ""))[:300]


def records(run_dir):
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def ckpts(run_dir):
    return sorted(glob.glob(os.path.join(run_dir, "ckpt-*.pth")))


def mid_checkpoint(run_dir, name, tmp):
    """A run directory holding only the checkpoint `name` of `run_dir` (as if killed after it)."""
    out = os.path.join(tmp, f"from-{name}-{len(os.listdir(tmp))}")
    os.makedirs(out)
    shutil.copy(os.path.join(run_dir, name), out)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repo", default=os.path.dirname(HERE))
    ap.add_argument("--skip-torchrun", action="store_true")
    a = ap.parse_args()
    repo = os.path.abspath(a.repo)
    from train_helpers import digits, kill_torchrun, torchrun_workers, write_shards
    tmp = tempfile.mkdtemp(prefix="fault_cases_trainer_")
    x, y = digits(149)
    data, small = os.path.join(tmp, "data"), os.path.join(tmp, "small")
    write_shards(data, "train", x[:96], y[:96], 24)
    write_shards(data, "val", x[96:], y[96:], 20)
    write_shards(small, "train", x[:48], y[:48], 24)
    write_shards(small, "val", x[96:], y[96:], 20)

    def args(out, *extra, train=data):
        return [f"data.train={train}", f"data.val={data}", f"output_dir={out}", *TINY, *extra]

    rows = []

    def report(case, code, what):
        rows.append((case, code, what))
        print(f"{case} | exit {code} | {what}", flush=True)

    full = os.path.join(tmp, "full")
    code, err = run(repo, args(full, "save_every_steps=5", "keep_checkpoints=20"))
    assert code == 0, err
    mid = "ckpt-e0001-u00000020.pth"                     # epoch 1, batch 8 of 12

    # 3: resume into a run with other data / another batch size
    out = mid_checkpoint(full, mid, tmp)
    code, err = run(repo, args(out, "resume=auto", train=small))
    e1 = [r for r in records(out) if r["epoch"] == 1]
    report("3 resume=auto, data.train 96 -> 48 samples", code,
           salient(err) if code else f"epoch 1 record {e1}; eval.json written: "
           f"{os.path.exists(os.path.join(out, 'eval.json'))}")
    out = mid_checkpoint(full, mid, tmp)
    code, err = run(repo, args(out, "resume=auto", "batch_size=4"))
    resumed = [ln for ln in err.splitlines() if "resumed from" in ln]
    report("3 resume=auto, batch_size 8 -> 4", code, salient(err) if code else
           f"{resumed[0].split('] ')[-1] if resumed else ''} (of batches of 4)")

    # 8: unreadable checkpoints, disk full, bad numbers
    import torch
    from safetensors.torch import save_file
    state = torch.load(os.path.join(full, mid), weights_only=True)["model"]
    st = os.path.join(tmp, "w.safetensors")
    save_file(state, st)
    with open(st, "r+b") as f:
        f.truncate(os.path.getsize(st) // 2)
    code, err = run(repo, args(os.path.join(tmp, "ev1"), "--eval-only", f"checkpoint={st}"))
    report("8 truncated .safetensors as checkpoint=", code, salient(err))
    legacy = os.path.join(tmp, "legacy.pth")
    import pickle
    with open(legacy, "wb") as f:
        pickle.dump({"model": argparse.Namespace(w=1)}, f)
    code, err = run(repo, args(os.path.join(tmp, "ev2"), "--eval-only", f"checkpoint={legacy}"))
    report("8 legacy (non-zip) pickle as checkpoint=", code, salient(err) +
           (" [suggests weights_only=False]" if "weights_only` set to `False`" in err else ""))
    if os.geteuid() == 0:
        size = os.path.getsize(os.path.join(full, mid))
        mnt = os.path.join(tmp, "small_disk")
        os.makedirs(mnt)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.6) // 4096 * 4096}",
                        "tmpfs", mnt], check=True)
        try:
            out = os.path.join(mnt, "run")
            code, err = run(repo, args(out, "save_every_steps=3"))
            left = [os.path.basename(p) for p in ckpts(out)]
            report("8 disk full during a checkpoint save", code,
                   f"{salient(err)} | on disk: {left}")
        finally:
            subprocess.run(["umount", mnt], check=True)
    code, err = run(repo, args(os.path.join(tmp, "lr"), "optim.lr=-1"))
    report("8 optim.lr=-1", code, salient(err))

    # 9: records across a restart
    out = os.path.join(tmp, "sigterm")
    kill_in_eval = ("import os, signal, train_imagenet.results as r\n"
                    "r.evaluate = lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM)")
    code1, _ = run(repo, args(out, "resume=auto"), prelude=kill_in_eval)
    code, err = run(repo, args(out, "resume=auto"))
    report("9 SIGTERM during evaluation, then resume=auto", code,
           f"first exit {code1}; log.jsonl epochs {[r['epoch'] for r in records(out)]} "
           f"(uninterrupted: {[r['epoch'] for r in records(full)]})")
    out = mid_checkpoint(full, mid, tmp)
    code, err = run(repo, args(out, "resume=auto", "save_every_steps=5", "keep_checkpoints=20"))
    got = [r["train_loss"] for r in records(out) if r["epoch"] == 1]
    want = [r["train_loss"] for r in records(full) if r["epoch"] == 1]
    report("9 train_loss of an epoch resumed mid-way", code,
           f"{got[0] if got else None!r} vs {want[0]!r} uninterrupted")

    # 10: resume with another number of epochs
    out = mid_checkpoint(full, mid, tmp)
    code, err = run(repo, args(out, "resume=auto", "epochs=3"))
    said = [ln.split("] ", 1)[-1] for ln in err.splitlines() if "learning-rate schedule" in ln]
    lr = [r["lr"] for r in records(out) if r["epoch"] == 1]
    report("10 resume=auto, epochs 2 -> 3", code,
           f"{said[0] if said else 'nothing said about the schedule'}; epoch 1 ends at lr "
           f"{lr[0] if lr else None!r} (cosine over 36 updates at 24: 0.000508; the saved "
           f"24-update schedule: 1e-05)")
    out = mid_checkpoint(full, mid, tmp)
    code, err = run(repo, args(out, "resume=auto", "epochs=1"))
    report("10 resume=auto, epochs 2 -> 1", code, salient(err) if code else
           f"log.jsonl epochs {[r['epoch'] for r in records(out)]}; eval.json written: "
           f"{os.path.exists(os.path.join(out, 'eval.json'))}")

    # 4: a stopped rank under torchrun
    if not a.skip_torchrun:
        out = os.path.join(tmp, "stopped")
        with open(os.path.join(repo, "train_imagenet", "config.py")) as f:
            timeout = ["dist_timeout=10"] if "dist_timeout" in f.read() else []
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "train_imagenet", *args(out, "epochs=50", "save_every_steps=2", *timeout)]
        p = subprocess.Popen(cmd, cwd=repo, env=_env(repo), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        while not ckpts(out) and p.poll() is None:
            time.sleep(0.5)
        ranks = {}
        while 1 not in ranks and p.poll() is None:
            ranks = torchrun_workers(p.pid)
        os.kill(ranks[1], signal.SIGSTOP)
        t0 = time.time()
        try:
            text, _ = p.communicate(timeout=120)
            what = f"ended after {time.time() - t0:.0f} s: " + salient(text)
        except subprocess.TimeoutExpired:
            what = "still running 120 s after the stop, killed"
        finally:
            kill_torchrun(p, ranks)
        intact = []
        for c in ckpts(out):
            try:
                torch.load(c, weights_only=True)
                intact.append(os.path.basename(c))
            except Exception:
                pass
        report("4 SIGSTOP on rank 1 of 2 (torchrun, gloo)", p.returncode,
               f"{what}; checkpoints that load: {intact}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
