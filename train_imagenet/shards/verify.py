"""``dcvit-shards --verify``: every shard of a folder and every split against its metadata.

Each shard is checked by the trainer's verifier (`train_imagenet.shard_check.scan_shard`,
here also decoding every image, in parallel processes); each split as a whole against its
``<split>.json``: labels in range, samples per shard and in total, listed shards present and
no unlisted one beside them, no key in two shards, ``num_classes`` as in ``classes.json``.
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from contextlib import closing
from pathlib import Path
from typing import Sequence

from dcvit.schema import CLASSES_FILE, split_names
from train_imagenet.data.verify import scan_shard

from train_imagenet.data import timm_wds
from train_imagenet.data.labels import LabelsError, read_class_names
from .plan import ConversionError
from .write import run_tasks


def _scan(path: str) -> tuple[str, dict]:
    """(shard name, `scan_shard` with every image decoded): one task of `verify`."""
    return Path(path).name, scan_shard(path, decode=True)


def verify(out: Path, splits: Sequence[str] | None, workers: int, progress: bool = True) -> list[str]:
    """Problems found in the shards of ``out`` (every split with metadata unless ``splits``),
    printed; a missing folder is a ConversionError (bad input, exit status 2).

    Each shard is checked by the trainer's verifier (`train_imagenet.shard_check.scan_shard`,
    here also decoding every image); the split as a whole against its ``<split>.json``."""
    if not out.is_dir():
        raise ConversionError(f"--verify {out}: no such folder; give the --out folder of the shards")
    if splits is None:
        # timm's _info.json is its release's metadata, never a split of ours
        splits = [s for s in split_names(str(out)) if f"{s}.json" not in timm_wds.INFO_NAMES]
        if not splits and timm_wds.is_timm(str(out), sorted(p.name for p in out.glob("*.tar"))):
            raise ConversionError(f"--verify {out}: this is timm's WebDataset release, not shards written "
                                  f"by dcvit-shards; train on it as it is, or convert it with --src {out}")
        if not splits:  # empty, or a conversion stopped before writing its metadata
            problem = (f"no split metadata (<split>.json) in {out}: write shards with --src/--out "
                       f"first (an interrupted conversion leaves none: re-run it)")
            print(f"verify: {problem}", file=sys.stderr)
            return [problem]
    problems: list[str] = []
    classes = None
    if (out / CLASSES_FILE).exists():
        try:
            classes = read_class_names(out / CLASSES_FILE)
        except (ConversionError, LabelsError) as e:
            problems.append(str(e))
    from tqdm import tqdm
    for split in splits:
        meta_path = out / f"{split}.json"
        try:
            meta = json.loads(meta_path.read_text())
            shards, per_shard = meta["shards"], meta["samples_per_shard"]
            num_samples, num_classes = int(meta["num_samples"]), int(meta["num_classes"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{meta_path}: missing or incomplete metadata ({type(e).__name__}: {e}); "
                            "an interrupted conversion leaves none: re-run it")
            continue
        split_problems = []
        if classes is not None and len(classes) != num_classes:
            split_problems.append(f"{meta_path}: num_classes {num_classes} but classes.json lists {len(classes)}")
        if len(per_shard) != len(shards):
            split_problems.append(f"{meta_path}: {len(shards)} shards but {len(per_shard)} samples_per_shard entries")
        present = [s for s in shards if (out / s).is_file()]
        split_problems += [f"{split}: shard {s} listed in {meta_path.name} is missing" for s in shards
                           if s not in present]
        extra = sorted(p.name for p in out.glob(f"{split}-*.tar") if p.name not in shards)
        if extra:
            split_problems.append(f"{split}: shard(s) {extra[:5]} are not listed in {meta_path.name}")
        expected = dict(zip(shards, per_shard))
        labels, keys, total = Counter(), Counter(), 0
        with tqdm(total=len(present), unit="shard", desc=f"verify {split}", disable=not progress) as bar, \
                closing(run_tasks(_scan, [str(out / s) for s in present], workers)) as done:
            for name, r in done:
                bar.update(1)
                total += r["samples"]
                labels.update(r["labels"])
                keys.update(set(r["keys"]))  # a key repeated within a shard is one of its problems
                split_problems += [f"{name}: {p}" for p in r["problems"]]
                split_problems += [f"{name}: label {label} out of range [0, {num_classes})"
                                   for label in sorted(r["labels"]) if not 0 <= label < num_classes]
                if r["samples"] != expected.get(name):
                    split_problems.append(f"{split}: shard {name} holds {r['samples']} samples, "
                                          f"metadata says {expected.get(name)}")
        if total != num_samples:
            split_problems.append(f"{split}: read {total} samples, metadata says num_samples={num_samples}")
        dupes = [k for k, c in keys.items() if c > 1]
        if dupes:
            split_problems.append(f"{split}: {len(dupes)} key(s) occur in more than one shard, e.g. {dupes[:3]}")
        status = "OK" if not split_problems else f"{len(split_problems)} problem(s)"
        print(f"verify {split}: {len(present)}/{len(shards)} shards, {total} samples, "
              f"{len(labels)}/{num_classes} classes present: {status}")
        problems += split_problems
    for p in problems:
        print(f"  {p}", file=sys.stderr)
    return problems
