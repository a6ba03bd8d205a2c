"""Data: where `data.train`/`data.val` point, turned into a per-rank loader of
``(images, labels, skipped)`` batches.

The package, one idea a module:

- `source`: `Source` (what a key resolved to) and `DataError`;
- `resolve`: spec + key -> `Source` (the kind from what is on disk, the split from the key);
- one module per kind of source: `shards` (this project's tar shards, read as a webdataset
  stream), `timm_wds` (timm's WebDataset release, read as shards), `parquet` (a Hugging Face
  Parquet release, row groups streamed with pyarrow), `folder` (image files by index: an
  ImageFolder, a torchvision ImageNet root's split, a flat folder with a labels file);
  `stream` (`SampleStream`: how an epoch of a streamed source is dealt to ranks and workers);
- `overlap`: train and validation never share files or sample keys;
- `labels`: the labels-file formats (shared with the converter);
- `verify`: the one shard verifier (the start-up check and ``make_wds_shards.py --verify``);
- `transforms`: timm's transforms; `loader`: `DataPipe`, the seeded DataLoader of each epoch.

`build_data` is the entry the trainer, the predictor and the tools use.
"""
import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

from dcvit.schema import CLASSES_FILE

from ..config import Config
from . import folder, parquet, shards
from .loader import DataPipe
from .overlap import check_overlap
from .resolve import resolve_source
from .shards import ShardStream
from .source import DataError, Source, is_remote
from .transforms import build_transform

__all__ = ["DataError", "Source", "resolve_source", "source_of", "is_remote", "count_samples",
           "build_transform", "ShardStream", "DataPipe", "build_data"]

KINDS = {"wds": shards, "folder": folder, "parquet": parquet}   # Source.kind -> its module


def _identity(source: Source) -> List[Any]:
    """What a count describes: a count of another resolution of the same key is redone."""
    return [source.kind, source.layout, source.split, source.files, source.samples is not None]


def count_samples(source: Source, key: str = "data", num_classes: Optional[int] = None,
                  cache_dir: Optional[str] = None) -> Dict[str, Any]:
    """{'num_samples', 'num_classes', 'classes_exact', ...} of a source, after checking it
    (local shards: `verify.check_shards`, cached by size and mtime; timm's ``_info`` and
    Parquet metadata: read without a scan; a folder: listed)."""
    counts = dict(KINDS[source.kind].count(source, key, num_classes, cache_dir))
    counts["source"] = _identity(source)
    return counts


def classes_of(source: Source) -> Optional[List[str]]:
    """The class names of a source in label order, where it names them: an ImageFolder's
    folders, ``classes.json`` beside shards, a Parquet dataset card."""
    if source.classes:
        return list(source.classes)
    if source.kind == "folder" and source.layout != "flat":
        return folder.class_names(source.root)
    if source.kind == "wds" and source.shards and not is_remote(source.shards[0]):
        path = os.path.join(os.path.dirname(source.shards[0]), CLASSES_FILE)
        try:
            with open(path) as f:
                names = json.load(f)
            return names if isinstance(names, list) else None
        except (OSError, ValueError):
            return None
    return None


def source_of(cfg: Config, split: str) -> Source:
    """`data.<split>` resolved with its settings (``data.<split>_split``, ``_labels``,
    ``data.kind``); a flat folder's labels are looked up in the train split's classes."""
    d = cfg.data
    labels = getattr(d, f"{split}_labels")
    classes = None
    if labels and split == "val" and d.train:
        try:
            classes = classes_of(source_of(cfg, "train"))
        except DataError:
            classes = None
    return resolve_source(getattr(d, split), f"data.{split}", getattr(d, f"{split}_split"),
                          labels, d.kind, d.label_offset, d.label_names, classes, d.num_classes)


def build_data(cfg: Config, split: str, rank: int = 0, world_size: int = 1,
               counts: Optional[Dict[str, Any]] = None,
               norm: Optional[Tuple[List[float], List[float]]] = None) -> DataPipe:
    """The DataPipe for `split` ('train' or 'val'); `counts` as from `count_samples`, `norm`
    the input (mean, std) as `build_transform` takes it. Building 'val' refuses a validation
    source that shares files or sample keys with data.train. Rank 0 prints what the key
    resolved to (`Source.describe`)."""
    training = split == "train"
    key = f"data.{split}"
    source = source_of(cfg, split)
    if not training and cfg.data.train:
        try:
            train = source_of(cfg, "train")
        except DataError:
            train = None       # e.g. evaluating where the train data is not present
        if train is not None:
            check_overlap(train, source, cfg.data.train, cfg.data.val)
    given = cfg.data.train_samples if training else cfg.data.val_samples
    if counts is not None and "source" in counts and counts["source"] != _identity(source):
        counts = None          # counted on another resolution (without this key's settings)
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
                                                         world_size, batches, counts.get("lengths"))
    if rank == 0:
        print(f"[train_imagenet] {key}: {source.describe(num_samples, found or None)}",
              file=sys.stderr, flush=True)
    return DataPipe(ds, training=training, batch_size=b, num_workers=cfg.data.num_workers,
                    pin_memory=cfg.data.pin_memory, seed=cfg.seed, rank=rank,
                    world_size=world_size, num_samples=num_samples, batches_per_epoch=batches,
                    sampler_fn=sampler_fn, source=source)
