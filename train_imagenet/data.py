"""Data: WebDataset shards (primary) or an ImageFolder, timm transforms, per-rank loaders.

Shards are tar files of samples ``<key>.jpg|.png`` (image bytes) + ``<key>.cls`` (ASCII label),
given as a brace pattern (``DIR/train-{000000..000099}.tar``), a directory of ``.tar`` files
(only its ``train-*.tar`` / ``val-*.tar`` when present), or a single file. A directory without
``.tar`` files is read as an ImageFolder. Shards named for another split (``data.val`` given
``train-*.tar``) are refused. Local shards are checked before training (`shard_check`):
every tar readable, every label in range.

Training streams are cut to a fixed number of samples per rank per epoch
(``floor(num_samples / world) // batch_size`` full batches), so every rank runs the same
number of steps and none waits at the end of an epoch. Shards are shuffled per epoch and
dealt to (rank, worker) slots; each slot cycles over its shards through a shuffle buffer
until it has produced its quota. Evaluation streams visit every sample exactly once across
all ranks and workers (split by shard, or by sample index when there are fewer shards than
slots) and never pad, so metrics are exact with an uneven last batch.

All randomness of the data order comes from ``(seed, epoch, rank, worker)``: a run restarted
mid-epoch replays the same batches. A corrupt training sample is replaced by the next
readable one (the shard stream cycles; an ImageFolder reads the next index), so batches stay
full and the per-rank count holds; a corrupt evaluation sample is dropped. Every sample carries
the number of corrupt samples skipped just before it, so the trainer can count them.

The shard stream is a webdataset pipeline (tar reader, shuffle buffer, image decoder, epoch
length); dealing shards to slots, cycling and counting corrupt samples stay ours, for the
reasons docs/training.md ("Built on webdataset") gives.
"""
import itertools
import json
import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import braceexpand
import torch
import webdataset as wds
from webdataset.autodecode import imagehandler
from webdataset.tariterators import tarfile_samples
from PIL import Image
from torch.utils.data import DataLoader, Dataset, IterableDataset
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
from timm.data.distributed_sampler import RepeatAugSampler

from dcvit.schema import IMAGE_EXTENSIONS, LABEL_EXTENSION, ShardMeta, metadata_path, split_of

from .config import Config
from .shard_check import check_shards

__all__ = ["DataError", "Source", "resolve_source", "is_remote", "count_samples", "build_transform",
           "ShardStream", "DataPipe", "build_data"]

_logger = logging.getLogger(__name__)


class DataError(ValueError):
    """Missing, empty or inconsistent data; the message names the path and the fix."""


@dataclass
class Source:
    kind: str                                         # 'wds' or 'folder'
    shards: List[str] = field(default_factory=list)   # wds: the tar files, in order
    root: str = ""                                    # folder: the ImageFolder root


# Shard names say their split ('train-000000.tar'); a split must not read another's files.
_FOREIGN_SPLITS = {"train": ("val", "validation", "test"), "val": ("train",)}


def resolve_source(spec: str, key: str) -> Source:
    """Turns `data.train`/`data.val` into a list of existing shards or an ImageFolder root."""
    if not spec:
        raise DataError(f"{key} is empty; set {key}=DIR/train-{{000000..000009}}.tar "
                        f"(WebDataset shards) or {key}=IMAGEFOLDER_ROOT")
    if os.path.isdir(spec):
        tars = sorted(os.path.join(spec, n) for n in os.listdir(spec) if n.endswith(".tar"))
        split = key.rsplit(".", 1)[-1]  # 'train' / 'val': a shared directory holds both splits
        if any(os.path.basename(t).startswith(split + "-") for t in tars):
            tars = [t for t in tars if os.path.basename(t).startswith(split + "-")]
        if tars:
            return Source("wds", shards=_check_split(tars, key, spec))
        if any(os.path.isdir(os.path.join(spec, n)) for n in os.listdir(spec)):
            return Source("folder", root=spec)
        raise DataError(f"{key}={spec!r} is a directory with neither .tar shards nor class "
                        f"sub-folders; write shards with scripts/make_wds_shards.py")
    shards = list(braceexpand.braceexpand(spec))
    if any(is_remote(s) for s in shards):
        return Source("wds", shards=_check_split(shards, key, spec))  # counts: data.*_samples
    missing = [s for s in shards if not os.path.isfile(s)]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise DataError(f"{key}={spec!r}: {len(missing)} of {len(shards)} shards are missing "
                        f"({', '.join(missing[:3])}{more}); check the path and the brace range")
    return Source("wds", shards=_check_split(shards, key, spec))


def _check_split(shards: List[str], key: str, spec: str) -> List[str]:
    """Refuses shards whose names say they belong to another split (e.g. data.val=DIR where
    DIR holds only train-*.tar): the result would be reported for the wrong split."""
    split = key.rsplit(".", 1)[-1]
    for shard in shards:
        prefix = split_of(shard)
        if prefix in _FOREIGN_SPLITS.get(split, ()):
            raise DataError(f"{key}={spec!r} gives {prefix} shards ({shard!r}), not {split} "
                            f"shards; point {key} at the {split}-*.tar files (make_wds_shards.py "
                            f"--split {split})")
    return shards


def is_remote(url: str) -> bool:
    return url.startswith("pipe:") or "://" in url


def _metadata(shards: List[str]) -> Optional[ShardMeta]:
    """`DIR/<split>.json` written next to the shards, if it describes exactly these shards."""
    path = metadata_path(shards[0])
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            meta = ShardMeta.from_dict(json.load(f), path)
    except (OSError, ValueError):
        return None
    if meta.shards is not None and sorted(os.path.basename(s) for s in meta.shards) != sorted(
            os.path.basename(s) for s in shards):
        return None
    return meta


def count_samples(source: Source, key: str = "data", num_classes: Optional[int] = None,
                  cache_dir: Optional[str] = None) -> Dict[str, int]:
    """{'num_samples', 'num_classes', 'classes_exact'} of a source, after checking it.

    Local shards are always checked (`shard_check.check_shards`: every tar readable, every
    label an integer in [0, num_classes); headers and labels only, cached by size and mtime);
    the count is the checked one, and the class count comes from the shards' metadata
    (`DIR/<split>.json`) when present. An ImageFolder is listed.
    """
    if source.kind == "folder":
        from torchvision.datasets import ImageFolder
        ds = ImageFolder(source.root)
        return {"num_samples": len(ds), "num_classes": len(ds.classes), "classes_exact": 1}
    if any(is_remote(s) for s in source.shards):
        raise DataError(f"cannot count the samples of remote shards ({source.shards[0]!r}, ...); "
                        f"set data.train_samples / data.val_samples")
    check = check_shards(source.shards, key, num_classes if num_classes else 2**62, cache_dir)
    if check.problem:
        raise DataError(check.problem)
    meta = _metadata(source.shards)
    if meta is not None and meta.num_samples != check.num_samples:
        _logger.warning("%s says num_samples=%d but the shards hold %d samples: using %d "
                        "(make_wds_shards.py --verify checks the metadata)",
                        metadata_path(source.shards[0]), meta.num_samples, check.num_samples,
                        check.num_samples)
    if meta is not None and meta.num_classes is not None:
        return {"num_samples": check.num_samples, "num_classes": meta.num_classes,
                "classes_exact": 1}
    return {"num_samples": check.num_samples, "num_classes": check.max_label + 1,
            "classes_exact": 0}


def build_transform(cfg: Config, training: bool,
                    norm: Optional[Tuple[List[float], List[float]]] = None) -> Callable:
    """timm's transforms: RandAugment, random erasing, random-resized crop; eval centre crop.
    `norm` is (mean, std) (`model.input_norm`); by default ``data.mean``/``data.std``, else
    timm's ImageNet values."""
    d, a = cfg.data, cfg.aug
    mean, std = norm or (d.mean or IMAGENET_DEFAULT_MEAN, d.std or IMAGENET_DEFAULT_STD)
    common = dict(input_size=d.img_size, interpolation=d.interpolation,
                  mean=tuple(mean), std=tuple(std), crop_pct=d.crop_pct)
    if not training or a.no_aug:
        return create_transform(is_training=False, **common)
    transform = create_transform(is_training=True, scale=tuple(a.scale), hflip=a.hflip,
                                 color_jitter=a.color_jitter, auto_augment=a.auto_augment or None,
                                 re_prob=a.reprob, re_mode=a.remode, **common)
    return _zero_bit_posterize(transform)


def _posterize(img: Image.Image, bits_to_keep: int, **kwargs: Any) -> Image.Image:
    """timm's posterize, keeping 0 bits as a black image (as Pillow < 13 did)."""
    from timm.data.auto_augment import posterize
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return posterize(img, bits_to_keep, **kwargs)


def _zero_bit_posterize(transform: Callable) -> Callable:
    """Pillow >= 13 rejects ImageOps.posterize(img, 0), which timm's RandAugment asks for at
    magnitude 10 ('rand-m9-mstd0.5-inc1' reaches it). With such a Pillow, the posterize ops of
    this transform's augmentations (RandAugment, AutoAugment, AugMix) keep 0 bits as a black
    image instead; timm's own op table is left as it is."""
    from PIL import ImageOps
    from timm.data.auto_augment import posterize
    try:
        ImageOps.posterize(Image.new("RGB", (1, 1)), 0)
        return transform
    except ValueError:
        pass
    for step in getattr(transform, "transforms", [transform]):
        ops = list(getattr(step, "ops", [])) + [op for sub in getattr(step, "policy", [])
                                                 for op in sub]
        for op in ops:
            if getattr(op, "aug_fn", None) is posterize:
                op.aug_fn = _posterize
    return transform


def _seed(*parts: int) -> random.Random:
    return random.Random("-".join(str(p) for p in parts))


_IMAGE = imagehandler("pilrgb", extensions=IMAGE_EXTENSIONS)  # webdataset's PIL decoder, to RGB


def _decode(sample: Dict[str, Any]) -> Tuple[Image.Image, int]:
    ext = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
    if ext is None:
        raise ValueError(f"no image member ({'/'.join(IMAGE_EXTENSIONS)}) in sample")
    if LABEL_EXTENSION not in sample:
        raise ValueError(f"no .{LABEL_EXTENSION} member in sample")
    return _IMAGE(ext, sample[ext]), int(sample[LABEL_EXTENSION])


def _read_tar(shard: str) -> Iterator[Dict[str, Any]]:
    """Samples of one shard as {'__key__', ext: bytes} (WebDataset's tar reader, which splits
    member names with `base_plus_ext`; any URL webdataset.gopen opens works, e.g.
    'pipe:curl -s URL')."""
    try:
        yield from tarfile_samples([{"url": shard}])
    except DataError:
        raise
    except Exception as e:  # tarfile.ReadError, OSError, a failing 'pipe:' command
        raise DataError(f"shard {shard!r} cannot be read ({type(e).__name__}: {e}); it passed the "
                        f"start-up check, so it changed or its storage failed since: re-write "
                        f"it with scripts/make_wds_shards.py") from e


def _samples(shards: Iterable[str]) -> Iterator[Dict[str, Any]]:
    for shard in shards:
        yield from _read_tar(shard)


def _repeated(samples: Iterable[Dict[str, Any]], times: int) -> Iterator[Dict[str, Any]]:
    for sample in samples:
        for _ in range(times):
            yield sample


class _Decoded:
    """The decoding stage: (image, label, skipped) from raw samples, one pass per call.

    A corrupt sample fails (`on_corrupt='fail'`) or is skipped and counted in the next yielded
    sample's `skipped` (the count carries over from one pass to the next). In training a pass
    without one readable sample is an error: cycling would never fill the quota."""

    def __init__(self, transform: Callable, on_corrupt: str, training: bool):
        self.transform, self.on_corrupt, self.training = transform, on_corrupt, training
        self.skipped = 0

    def __call__(self, samples: Iterable[Dict[str, Any]]) -> Iterator[Tuple[Any, int, int]]:
        good, bad_shards = 0, []
        for sample in samples:
            try:
                img, label = _decode(sample)
            except Exception as e:  # PIL raises many types for broken files
                where = sample.get("__url__", "?")
                if self.on_corrupt == "fail":
                    raise DataError(f"corrupt sample {sample.get('__key__')!r} in {where!r}: {e} "
                                    f"(set data.on_corrupt=skip to skip and count such samples)") from e
                if where not in bad_shards:
                    bad_shards.append(where)
                self.skipped += 1
                continue
            good += 1
            yield self.transform(img), label, self.skipped
            self.skipped = 0
        if self.training and good == 0:
            raise DataError(f"no readable sample in a whole pass over this worker's shards "
                            f"({self.skipped} corrupt, in {', '.join(map(repr, bad_shards[:3]))}"
                            f"{' and more' if len(bad_shards) > 3 else ''}); re-write them "
                            f"with scripts/make_wds_shards.py")


class ShardStream(IterableDataset):
    """A stream of (image, label, skipped) from tar shards for one rank, built in each
    DataLoader worker as a `webdataset.DataPipeline`: this slot's shards, WebDataset's tar
    reader, its shuffle buffer (seeded), its image decoder and, in training, its `with_epoch`
    cut at this worker's quota (the pipeline is run again, on a reshuffled order, until the
    quota is reached).

    `quota` (training) is the number of samples this rank yields per epoch; None (evaluation)
    yields this rank's share of every sample exactly once.
    """

    def __init__(self, shards: List[str], transform: Callable, *, rank: int, world_size: int,
                 seed: int, quota: Optional[int] = None, batch_size: int = 1,
                 shuffle_buffer: int = 0, repeats: int = 1, on_corrupt: str = "skip"):
        self.shards, self.transform = list(shards), transform
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.quota, self.batch_size = quota, batch_size
        self.shuffle_buffer, self.repeats, self.on_corrupt = shuffle_buffer, repeats, on_corrupt
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _worker(self) -> Tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def __iter__(self) -> Iterator[Tuple[Any, int, int]]:
        wid, nw = self._worker()
        slot, nslots = self.rank * nw + wid, self.world_size * nw
        if self.quota is None:
            return iter(self._eval_pipeline(slot, nslots))
        quota = self._worker_quota(wid, nw)
        if quota == 0:
            return iter(())
        # the training pipeline is rerun until the quota is met, so a corrupt sample is replaced
        # by the next one and this worker yields exactly its quota (whole batches)
        return iter(self._train_pipeline(slot, nslots).with_epoch(quota))

    def _worker_quota(self, wid: int, nw: int) -> int:
        """This worker's share of the rank's batches, in samples (whole batches)."""
        batches = self.quota // self.batch_size
        return (batches // nw + (wid < batches % nw)) * self.batch_size

    def _eval_pipeline(self, slot: int, nslots: int) -> wds.DataPipeline:
        """Every sample once across all slots; corrupt ones are dropped (and counted)."""
        decoded = _Decoded(self.transform, self.on_corrupt, training=False)
        if len(self.shards) >= nslots:  # whole shards per slot
            return wds.DataPipeline(lambda: iter(self.shards[slot::nslots]), _samples, decoded)
        # fewer shards than slots: every slot reads all, keeps every nslots-th sample
        return wds.DataPipeline(lambda: iter(self.shards), _samples,
                                lambda samples: itertools.islice(samples, slot, None, nslots),
                                decoded)

    def _train_pipeline(self, slot: int, nslots: int) -> wds.DataPipeline:
        """This slot's shards in a new order each pass, through the shuffle buffer (drained at
        the end of each pass: no repeats inside a pass)."""
        order = list(self.shards)
        _seed(self.seed, self.epoch).shuffle(order)  # same deal on every slot
        while len(order) < nslots:
            order += order
        mine = order[slot::nslots]
        rng = _seed(self.seed, self.epoch, slot)

        def one_pass() -> List[str]:
            rng.shuffle(mine)
            return list(mine)

        buffer = max(self.shuffle_buffer, 1)
        return wds.DataPipeline(one_pass, _samples,
                                lambda samples: _repeated(samples, self.repeats),
                                wds.shuffle(buffer, initial=buffer, rng=rng),
                                _Decoded(self.transform, self.on_corrupt, training=True))


class FolderDataset(Dataset):
    """torchvision's ImageFolder that returns (image, label, skipped).

    A corrupt file fails (`on_corrupt='fail'`) or is skipped: for training (`replace=True`) the
    next index is read instead, so every batch stays full; for evaluation None is returned and
    the collate function drops it, so no sample is counted twice."""

    def __init__(self, root: str, transform: Callable, on_corrupt: str = "skip",
                 replace: bool = False):
        from torchvision.datasets import ImageFolder
        self.folder = ImageFolder(root)
        self.transform, self.on_corrupt, self.replace = transform, on_corrupt, replace

    def __len__(self) -> int:
        return len(self.folder)

    def _open(self, path: str) -> Optional[Image.Image]:
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except Exception as e:  # PIL raises many types for broken files
            if self.on_corrupt == "fail":
                raise DataError(f"corrupt image {path!r}: {e} (set data.on_corrupt=skip)") from e
            return None

    def __getitem__(self, i: int) -> Optional[Tuple[Any, int, int]]:
        n = len(self.folder)
        for skipped in range(n if self.replace else 1):
            path, label = self.folder.samples[(i + skipped) % n]
            img = self._open(path)
            if img is not None:
                return self.transform(img), label, skipped
        if self.replace:
            raise DataError(f"no readable image in {self.folder.root!r} ({n} corrupt files)")
        return None


def _collate(batch: List[Optional[Tuple[Any, int, int]]]) -> Tuple[torch.Tensor, torch.Tensor, int]:
    kept = [b for b in batch if b is not None]  # None: a dropped corrupt evaluation image
    skipped = len(batch) - len(kept) + sum(b[2] for b in kept)
    if not kept:
        return torch.empty(0), torch.empty(0, dtype=torch.long), skipped
    return (torch.stack([b[0] for b in kept]), torch.tensor([b[1] for b in kept]), skipped)


class DataPipe:
    """The loader of one split for one rank: `loader(epoch)` is a fresh, seeded DataLoader."""

    def __init__(self, dataset: Any, *, training: bool, batch_size: int, num_workers: int,
                 pin_memory: bool, seed: int, rank: int, world_size: int, num_samples: int,
                 batches_per_epoch: int, sampler_fn: Optional[Callable[[int], Any]] = None):
        self.dataset, self.training = dataset, training
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.num_samples, self.batches_per_epoch = num_samples, batches_per_epoch
        self.sampler_fn = sampler_fn

    def loader(self, epoch: int = 0) -> DataLoader:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        gen = torch.Generator().manual_seed(_seed(self.seed, epoch, self.rank).getrandbits(62))
        sampler = self.sampler_fn(epoch) if self.sampler_fn else None
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler,
                          num_workers=self.num_workers,
                          pin_memory=self.pin_memory and torch.cuda.is_available(),
                          drop_last=self.training and sampler is not None, generator=gen,
                          collate_fn=_collate, persistent_workers=False)


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
    common = dict(training=training, batch_size=b, num_workers=cfg.data.num_workers,
                  pin_memory=cfg.data.pin_memory, seed=cfg.seed, rank=rank,
                  world_size=world_size, num_samples=num_samples)
    if training:
        per_rank = num_samples // world_size
        batches = (per_rank // (b * accum)) * accum
        if batches == 0:
            raise DataError(f"{key} has {num_samples} samples, fewer than one update needs "
                            f"(batch_size {b} x accum_steps {accum} x {world_size} processes); "
                            f"lower batch_size")
    else:
        batches = -(-num_samples // (b * world_size))  # an upper bound; evaluation runs to the end
    if source.kind == "wds":
        slots = world_size * max(cfg.data.num_workers, 1)
        if training and len(source.shards) < slots and rank == 0:
            _logger.warning("%s has %d shards for %d (rank, worker) slots: some shards are read by "
                            "several slots, so samples repeat within an epoch; write more, smaller "
                            "shards (make_wds_shards.py --shard-size)", key, len(source.shards), slots)
        ds = ShardStream(source.shards, transform, rank=rank, world_size=world_size,
                         seed=cfg.seed, quota=batches * b if training else None, batch_size=b,
                         shuffle_buffer=cfg.data.shuffle_buffer if training else 0,
                         repeats=cfg.aug.repeated_aug if training else 1,
                         on_corrupt=cfg.data.on_corrupt)
        return DataPipe(ds, batches_per_epoch=batches, **common)
    ds = FolderDataset(source.root, transform, cfg.data.on_corrupt, replace=training)
    n = len(ds)
    if training:
        def sampler_fn(epoch: int):
            if cfg.aug.repeated_aug > 1:
                s = RepeatAugSampler(ds, num_replicas=world_size, rank=rank, shuffle=True,
                                     num_repeats=cfg.aug.repeated_aug)
            else:
                s = torch.utils.data.DistributedSampler(ds, num_replicas=world_size, rank=rank,
                                                        shuffle=True, seed=cfg.seed, drop_last=True)
            s.set_epoch(epoch)
            return s
        batches = (len(sampler_fn(0)) // (b * accum)) * accum  # RepeatAugSampler selects fewer
    else:
        def sampler_fn(epoch: int):
            return list(range(rank, n, world_size))  # every sample once, no padding
    return DataPipe(ds, batches_per_epoch=batches, sampler_fn=sampler_fn, **common)
