"""Small real data for the training tests: scikit-learn's digits as 32x32 RGB images, written
as WebDataset shards (with webdataset.TarWriter) or as an ImageFolder; the trainer's tiny
run (TINY_RUN); faults a test injects
(a NaN loss); torchrun's workers; a run's log records."""
import dataclasses
import io
import itertools
import os
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
from PIL import Image

# The trainer's overrides for a one-block ViT on 32x32 digits, one process and thread, no
# loader workers: what the training tests share (each adds its epochs, schedule and augment).
TINY_RUN = ["model=vit_tiny_patch16_224",
            "model_kwargs={img_size: 32, patch_size: 8, depth: 1, embed_dim: 24, num_heads: 2}",
            "data.num_classes=10", "data.img_size=32", "data.num_workers=0", "data.shuffle_buffer=16",
            "data.crop_pct=1.0", "data.interpolation=bilinear", "batch_size=8", "optim.lr=2e-3",
            "optim.lr_batch_size=null", "sched.warmup_epochs=1", "threads=1"]


def digits(n: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, 32, 32, 3), labels (N,)) from sklearn's bundled 8x8 digits."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.images / 16.0 * 255).astype(np.uint8)                       # (N, 8, 8)
    x = np.repeat(np.repeat(x, 4, axis=1), 4, axis=2)                  # (N, 32, 32)
    x = np.stack([x, x, x], axis=-1)                                   # (N, 32, 32, 3)
    if n:
        x, y = x[:n], d.target[:n]
    else:
        y = d.target
    return x, y.astype(np.int64)


def png_bytes(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def write_shards(out: str, split: str, images: np.ndarray, labels: Sequence[int],
                 per_shard: int, corrupt: Sequence[int] = ()) -> List[str]:
    """Writes `out/<split>-000000.tar`, ...; samples whose index is in `corrupt` get bad bytes."""
    import webdataset as wds
    os.makedirs(out, exist_ok=True)
    paths = []
    for s, start in enumerate(range(0, len(labels), per_shard)):
        path = os.path.join(out, f"{split}-{s:06d}.tar")
        with wds.TarWriter(path) as sink:
            for i in range(start, min(start + per_shard, len(labels))):
                data = b"not an image" if i in corrupt else png_bytes(images[i])
                sink.write({"__key__": f"{i:08d}", "png": data, "cls": str(int(labels[i])).encode()})
        paths.append(path)
    return paths


def write_folder(out: str, images: np.ndarray, labels: Sequence[int]) -> str:
    for i, (img, y) in enumerate(zip(images, labels)):
        d = os.path.join(out, f"class_{int(y):02d}")
        os.makedirs(d, exist_ok=True)
        Image.fromarray(img).save(os.path.join(d, f"{i:05d}.png"))
    return out


@dataclass(frozen=True)
class DigitsSplit:
    """Shards written by `write_digits_split`: their directory and the val images and labels."""
    root: str
    x_val: np.ndarray
    y_val: np.ndarray


def write_digits_split(root: str, n_train: int, n_val: int, train_per_shard: int,
                       val_per_shard: int) -> DigitsSplit:
    """The first `n_train` digits as `root/train-*.tar`, the next `n_val` as `root/val-*.tar`."""
    x, y = digits(n_train + n_val)
    write_shards(root, "train", x[:n_train], y[:n_train], train_per_shard)
    write_shards(root, "val", x[n_train:], y[n_train:], val_per_shard)
    return DigitsSplit(root, x[n_train:], y[n_train:])


def nan_loss_at(monkeypatch, update: int) -> None:
    """Runs of `train_imagenet.__main__.main` in this process get a loss function that returns
    NaN at its `update`-th call: optimizer update `update` of a run from scratch without
    accumulation (evaluation does not call it)."""
    import train_imagenet.trainer as trainer
    real_build = trainer.build_recipe

    def build_recipe(*args, **kwargs):
        recipe = real_build(*args, **kwargs)
        calls, loss_fn = itertools.count(1), recipe.loss_fn

        def nan_at(out, target):
            loss = loss_fn(out, target)
            return loss * float("nan") if next(calls) == update else loss
        return dataclasses.replace(recipe, loss_fn=nan_at)
    monkeypatch.setattr(trainer, "build_recipe", build_recipe)


def read_records(run_dir) -> List[dict]:
    """The records of a run's log.jsonl, in order."""
    import json
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def torchrun_workers(agent_pid: int) -> dict:
    """{rank: pid} of torchrun's worker processes (children of the agent)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if ppid == agent_pid and b"RANK" in env:
            found[int(env[b"RANK"])] = int(pid)
    return found


def kill_torchrun(agent, workers: dict) -> None:
    """SIGKILL torchrun's workers (each in its own session, so one by one), then the agent's
    process group if it still runs, and reap the agent."""
    import signal
    for pid in workers.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if agent.poll() is None:
        os.killpg(agent.pid, signal.SIGKILL)
    agent.communicate()

