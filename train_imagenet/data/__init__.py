"""Data: where `data.train`/`data.val` point, turned into a per-rank loader of
``(images, labels, skipped)`` batches.

The package, one idea a module:

- `source`: `Source` (what a key resolved to) and `DataError`;
- `resolve`: spec + key -> `Source` (the kind from what is on disk, the split from the key);
- `shards`: tar shards read as a webdataset stream; `folder`: image files read by index;
- `labels`: the labels-file formats (shared with the converter);
- `verify`: the one shard verifier (the start-up check and ``make_wds_shards.py --verify``);
- `transforms`: timm's transforms; `loader`: `DataPipe`, the seeded DataLoader of each epoch.

`build_data` is the entry the trainer, the predictor and the tools use.
"""
from typing import Dict, List, Optional, Tuple

from ..config import Config
from . import folder, shards
from .loader import DataPipe
from .resolve import resolve_source
from .shards import ShardStream
from .source import DataError, Source, is_remote
from .transforms import build_transform

__all__ = ["DataError", "Source", "resolve_source", "is_remote", "count_samples", "build_transform",
           "ShardStream", "DataPipe", "build_data"]

KINDS = {"wds": shards, "folder": folder}   # Source.kind -> its module (count, dataset)


def count_samples(source: Source, key: str = "data", num_classes: Optional[int] = None,
                  cache_dir: Optional[str] = None) -> Dict[str, int]:
    """{'num_samples', 'num_classes', 'classes_exact'} of a source, after checking it (local
    shards: `verify.check_shards`, cached by size and mtime; a folder: listed)."""
    return KINDS[source.kind].count(source, key, num_classes, cache_dir)


def build_data(cfg: Config, split: str, rank: int = 0, world_size: int = 1,
               counts: Optional[Dict[str, int]] = None,
               norm: Optional[Tuple[List[float], List[float]]] = None) -> DataPipe:
    """The DataPipe for `split` ('train' or 'val'); `counts` as from `count_samples`, `norm`
    the input (mean, std) as `build_transform` takes it."""
    training = split == "train"
    key = f"data.{split}"
    source = resolve_source(getattr(cfg.data, split), key)
    given = cfg.data.train_samples if training else cfg.data.val_samples
    if counts is None:
        counts = {"num_samples": given, "num_classes": 0} if given else count_samples(
            source, key, cfg.data.num_classes)
    num_samples = given or counts["num_samples"]
    if num_samples <= 0:
        raise DataError(f"{key}={getattr(cfg.data, split)!r} holds no samples "
                        f"(each needs an image .jpg/.png and a .cls label)")
    found = counts.get("num_classes", 0)
    if found > cfg.data.num_classes or (counts.get("classes_exact") and found != cfg.data.num_classes):
        raise DataError(f"{key} has {found} classes (labels 0..{found - 1}) but "
                        f"data.num_classes={cfg.data.num_classes}; set data.num_classes={found}")
    transform = build_transform(cfg, training, norm)
    b, accum = cfg.batch_size, cfg.accum_steps
    if training:
        per_rank = num_samples // world_size
        batches = (per_rank // (b * accum)) * accum
        if batches == 0:
            raise DataError(f"{key} has {num_samples} samples, fewer than one update needs "
                            f"(batch_size {b} x accum_steps {accum} x {world_size} processes); "
                            f"lower batch_size")
    else:
        batches = -(-num_samples // (b * world_size))  # an upper bound; evaluation runs to the end
    ds, sampler_fn, batches = KINDS[source.kind].dataset(source, transform, cfg, training, rank,
                                                         world_size, batches)
    return DataPipe(ds, training=training, batch_size=b, num_workers=cfg.data.num_workers,
                    pin_memory=cfg.data.pin_memory, seed=cfg.seed, rank=rank,
                    world_size=world_size, num_samples=num_samples, batches_per_epoch=batches,
                    sampler_fn=sampler_fn, source=source)
