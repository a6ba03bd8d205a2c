#!/usr/bin/env python
"""Training-pipeline overhead: train_imagenet's epoch loop on WebDataset shards vs a bare loop.

Both sides train the same model with the same optimizer, loss and batch size, alternating in
one process (docs/spec.md §5): the bare loop feeds batches that were decoded and transformed in
advance and held in memory; the pipeline reads the shards, decodes, transforms, shuffles and
batches them with DataLoader workers, runs mixup-free steps through `train_one_epoch`
(scheduler, loss sync, checkpoint hook). The ratio of their images/s is the overhead. A third
timing reads the data alone (no model): how far loading outpaces training. The data
settings (transforms, shuffle buffer) come from --config (default: the quick-start recipe).

    python scripts/bench_pipeline.py --shards DIR [--model dcvit_tiny] [--repeats 3]
    python scripts/bench_pipeline.py --make-digits /tmp/digits_shards   # writes the shards first

With ``--sources DIR`` it compares the loader alone (no model) on the same JPEG images held
as this project's shards, as timm's WebDataset release (with ``_info.json``) and as a Hugging
Face Parquet folder: images/s of each, full epochs alternated, medians of ``--repeats``.

    python scripts/bench_pipeline.py --sources /tmp/bench_sources [--images 2000] [--workers 1]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def make_digits(out: str) -> str:
    """sklearn digits as 32x32 PNG shards (1797 images, 6 train shards)."""
    import io
    import numpy as np
    import webdataset as wds
    from PIL import Image
    from sklearn.datasets import load_digits
    d = load_digits()
    x = np.repeat(np.repeat((d.images / 16.0 * 255).astype(np.uint8), 4, axis=1), 4, axis=2)
    os.makedirs(out, exist_ok=True)
    for s, start in enumerate(range(0, len(x), 300)):
        with wds.TarWriter(os.path.join(out, f"train-{s:06d}.tar")) as sink:
            for i in range(start, min(start + 300, len(x))):
                buf = io.BytesIO()
                Image.fromarray(np.stack([x[i]] * 3, axis=-1)).save(buf, format="PNG")
                sink.write({"__key__": f"{i:08d}", "png": buf.getvalue(), "cls": str(int(d.target[i])).encode()})
    return out


def make_sources(out: str, n: int, per_shard: int = 250) -> dict:
    """The same `n` random 96x96 JPEGs (10 classes) as this project's shards, timm's release
    and a Parquet folder: {kind: folder}."""
    import io
    import numpy as np
    import webdataset as wds
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image
    rng = np.random.default_rng(0)
    samples = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (96, 96, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
        samples.append((f"img_{i:06d}", buf.getvalue(), i % 10))
    dirs = {k: os.path.join(out, k) for k in ("shards", "timm-wds", "parquet")}
    for d in dirs.values():
        os.makedirs(os.path.join(d, "data"), exist_ok=True)
    names, lengths = [], []
    for s, start in enumerate(range(0, n, per_shard)):
        part = samples[start:start + per_shard]
        for path in (os.path.join(dirs["shards"], f"train-{s:06d}.tar"),
                     os.path.join(dirs["timm-wds"], f"imagenet1k-train-{s:04d}.tar")):
            with wds.TarWriter(path) as sink:
                for key, data, label in part:
                    sink.write({"__key__": key, "jpg": data, "cls": str(label).encode()})
        names.append(f"imagenet1k-train-{s:04d}.tar")
        lengths.append(len(part))
        table = pa.table({"image": [{"bytes": d, "path": k + ".JPEG"} for k, d, _ in part],
                          "label": pa.array([l for _, _, l in part], pa.int64())})
        pq.write_table(table, os.path.join(dirs["parquet"], "data",
                                           f"train-{s:05d}-of-{-(-n // per_shard):05d}.parquet"),
                       row_group_size=per_shard // 2)
    with open(os.path.join(dirs["timm-wds"], "_info.json"), "w") as f:
        json.dump({"splits": {"train": {"name": "train", "num_samples": n, "filenames": names,
                                        "shard_lengths": lengths}}}, f)
    return dirs


def compare_sources(args) -> None:
    from train_imagenet.config import load_config
    from train_imagenet.data import build_data
    dirs = make_sources(args.sources, args.images)
    pipes = {}
    for kind, folder in dirs.items():
        cfg = load_config(args.config, [f"data.train={folder}", f"data.val={folder}",
                                        f"data.num_workers={args.workers}", "data.num_classes=10",
                                        "data.img_size=64", f"batch_size={args.batch_size}"])
        pipes[kind] = build_data(cfg, "train")

    def epoch(pipe, e: int) -> float:
        t = time.perf_counter()
        n = sum(len(y) for _, y, _ in pipe.loader(e))
        return n / (time.perf_counter() - t)

    for pipe in pipes.values():
        epoch(pipe, 0)                                   # warm-up (page cache, imports)
    rounds = {k: [] for k in pipes}
    for r in range(args.repeats):
        for kind, pipe in pipes.items():
            rounds[kind].append(epoch(pipe, r + 1))
    med = {k: statistics.median(v) for k, v in rounds.items()}
    print(json.dumps({"images": args.images, "workers": args.workers, "batch_size": args.batch_size,
                      "img_s": {k: round(v, 1) for k, v in med.items()},
                      "vs_shards_pct": {k: round(100 * (v / med["shards"] - 1), 1) for k, v in med.items()},
                      "rounds": {k: [round(x, 1) for x in v] for k, v in rounds.items()}}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", help="directory with train-*.tar shards")
    p.add_argument("--make-digits", metavar="DIR", help="write digits shards to DIR and use them")
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "quickstart.yaml"),
                   help="recipe whose data settings (transforms, shuffle buffer) are used")
    p.add_argument("--model", default="dcvit_tiny")
    p.add_argument("--model-kwargs", default="{img_size: 32, patch_size: 8, depth: 4, embed_dim: 128, num_heads: 4}")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="alternating (bare, pipeline) rounds")
    p.add_argument("--sources", metavar="DIR", help="compare the loader on shards, timm's WDS and Parquet")
    p.add_argument("--images", type=int, default=2000, help="images per source (--sources)")
    args = p.parse_args()
    if args.sources:
        return compare_sources(args)
    shards = make_digits(args.make_digits) if args.make_digits else args.shards
    if not shards:
        p.error("give --shards DIR or --make-digits DIR")
    torch.set_num_threads(args.threads)

    from train_imagenet.model import build_model
    from train_imagenet.config import load_config
    from train_imagenet.data import build_data
    from train_imagenet.engine import EpochState, Loop, train_one_epoch
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2

    cfg = load_config(args.config, [f"model={args.model}", f"model_kwargs={args.model_kwargs}",
                                    f"data.train={shards}", f"data.val={shards}",
                                    f"data.num_workers={args.workers}", "aug.mixup=0", "aug.cutmix=0",
                                    "aug.smoothing=0", "drop_path=0", f"batch_size={args.batch_size}"])
    pipe = build_data(cfg, "train")
    model = build_model(cfg)
    opt = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    sched, _ = create_scheduler_v2(opt, sched="cosine", num_epochs=1000, step_on_epochs=False,
                                   updates_per_epoch=pipe.batches_per_epoch)
    loss_fn = torch.nn.CrossEntropyLoss()
    batches = [(x, y) for x, y, _ in pipe.loader(0)]     # decoded + transformed once, in memory
    n_img = sum(len(y) for _, y in batches)

    def bare() -> float:
        model.train()
        t = time.perf_counter()
        for x, y in batches:
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return n_img / (time.perf_counter() - t)

    def pipeline(epoch: int) -> float:
        stats = train_one_epoch(Loop(model, opt, sched, loss_fn, torch.device("cpu")), pipe,
                                EpochState(epoch, 0))
        return stats["img_per_s"]

    def data_only(epoch: int) -> float:
        t = time.perf_counter()
        n = sum(len(y) for _, y, _ in pipe.loader(epoch))
        return n / (time.perf_counter() - t)

    bare()  # warm-up
    results = {"bare": [], "pipeline": [], "data_only": []}
    for r in range(args.repeats):
        results["bare"].append(bare())
        results["pipeline"].append(pipeline(r + 1))
        results["data_only"].append(data_only(r + 1))
    b, q = statistics.median(results["bare"]), statistics.median(results["pipeline"])
    print(json.dumps({"model": args.model, "model_kwargs": args.model_kwargs, "batch_size": args.batch_size,
                      "workers": args.workers, "threads": args.threads, "images_per_epoch": n_img,
                      "bare_img_s": round(b, 1), "pipeline_img_s": round(q, 1),
                      "overhead_pct": round(100 * (b / q - 1), 1),
                      "data_only_img_s": round(statistics.median(results["data_only"]), 1),
                      "rounds": {k: [round(v, 1) for v in vs] for k, vs in results.items()}}))


if __name__ == "__main__":
    main()
