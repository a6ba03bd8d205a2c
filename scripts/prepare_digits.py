#!/usr/bin/env python
"""Convert scikit-learn's bundled digits into an ImageFolder tree (offline, deterministic).

    python scripts/prepare_digits.py OUT [--size 32] [--val-fraction 0.2] [--seed 0]

writes ``OUT/train/<digit>/<idx>.png`` and ``OUT/val/<digit>/<idx>.png``: the 1,797 real
8x8 handwritten digits of ``sklearn.datasets.load_digits``, upscaled (bicubic) to
``size x size`` RGB PNGs, with a fixed stratified split (per class, ``round(n * fraction)``
images go to val, chosen by a seeded permutation). ``<idx>`` is the image's index in
scikit-learn's array, so every file can be traced back to its source.

Re-running with the same arguments is a no-op (``OUT/digits.json`` records what was
written); other arguments rewrite the tree and remove files of the old split.
"""
import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
from PIL import Image
from tqdm import tqdm

from dcvit.io import atomic_write, write_json
from dcvit.optional import require

__all__ = ["split_indices", "digit_image", "prepare_digits"]

MANIFEST = "digits.json"
SPLITS = ("train", "val")


def split_indices(labels: np.ndarray, val_fraction: float, seed: int) -> Dict[str, np.ndarray]:
    """A stratified split: per class, ``round(n_c * val_fraction)`` indices go to val.

    Implemented here (not with ``train_test_split``) so that the split depends only on
    numpy's seeded generator, never on the scikit-learn version. Returns sorted indices.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    rng = np.random.default_rng(seed)
    train: List[np.ndarray] = []
    val: List[np.ndarray] = []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_val = int(round(len(idx) * val_fraction))
        val.append(idx[:n_val])
        train.append(idx[n_val:])
    return {"train": np.sort(np.concatenate(train)), "val": np.sort(np.concatenate(val))}


def digit_image(pixels: np.ndarray, size: int) -> Image.Image:
    """An 8x8 digit with values 0..16 as a ``size x size`` RGB image (bicubic upscaling)."""
    grey = np.clip(np.rint(pixels * (255.0 / 16.0)), 0, 255).astype(np.uint8)  # (8, 8)
    img = Image.fromarray(grey, mode="L")
    if size != grey.shape[0]:
        img = img.resize((size, size), Image.Resampling.BICUBIC)
    return img.convert("RGB")                                                  # grey -> 3 channels


def _file_name(idx: int) -> str:
    return f"{idx:04d}.png"


def prepare_digits(out: os.PathLike, size: int = 32, val_fraction: float = 0.2, seed: int = 0,
                   force: bool = False, progress: bool = True) -> dict:
    """Write the ImageFolder tree under ``out`` (see module docstring); return the manifest.

    The manifest holds the arguments, ``counts`` per split and ``class_counts`` per split
    and digit, and ``skipped`` is True when the tree was already up to date.
    """
    if size < 8:
        raise ValueError(f"size must be >= 8 (the digits are 8x8), got {size}")
    out = Path(out)
    digits = require("sklearn.datasets", "the quick start's digits").load_digits()
    images, labels = digits.images, digits.target                      # (1797, 8, 8), (1797,)
    splits = split_indices(labels, val_fraction, seed)
    manifest = {
        "source": "sklearn.datasets.load_digits",
        "size": size, "val_fraction": val_fraction, "seed": seed,
        "counts": {s: int(len(splits[s])) for s in SPLITS},
        "class_counts": {s: {str(c): int((labels[splits[s]] == c).sum()) for c in range(10)}
                         for s in SPLITS},
    }
    expected = {out / s / str(int(labels[i])) / _file_name(int(i)) for s in SPLITS for i in splits[s]}

    manifest_path = out / MANIFEST
    if not force and manifest_path.is_file():
        try:
            old = json.loads(manifest_path.read_text())
        except json.JSONDecodeError:
            old = None
        if old is not None and {k: old.get(k) for k in manifest} == manifest \
                and all(p.is_file() for p in expected):
            return {**manifest, "skipped": True}

    # Remove PNGs of an earlier, different split (only files of this layout).
    for split in SPLITS:
        for path in sorted((out / split).glob("*/*.png")):
            if path not in expected:
                path.unlink()
    for split in SPLITS:
        for c in range(10):
            (out / split / str(c)).mkdir(parents=True, exist_ok=True)
    jobs = [(s, int(i)) for s in SPLITS for i in splits[s]]
    for split, i in tqdm(jobs, desc=f"digits -> {out}", unit="img", disable=not progress):
        img = digit_image(images[i], size)
        atomic_write(out / split / str(int(labels[i])) / _file_name(i), lambda tmp: img.save(tmp, format="PNG"))
    write_json(manifest_path, manifest)
    return {**manifest, "skipped": False}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="output directory (gets train/ and val/)")
    parser.add_argument("--size", type=int, default=32, help="output side in pixels (default 32)")
    parser.add_argument("--val-fraction", type=float, default=0.2,
                        help="fraction of each class held out for val (default 0.2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split (default 0)")
    parser.add_argument("--force", action="store_true", help="rewrite even if up to date")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        m = prepare_digits(args.out, args.size, args.val_fraction, args.seed, args.force,
                           progress=not args.quiet)
    except ValueError as e:
        parser.error(str(e))
    state = "up to date, nothing written" if m["skipped"] else "written"
    print(f"digits {m['size']}x{m['size']} RGB in {args.out} ({state}): "
          f"train {m['counts']['train']}, val {m['counts']['val']} "
          f"(val fraction {m['val_fraction']}, seed {m['seed']})")
    for split in SPLITS:
        per_class = " ".join(f"{c}:{n}" for c, n in m["class_counts"][split].items())
        print(f"  {split:5s} per digit  {per_class}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
