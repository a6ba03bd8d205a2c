"""Tar shards read as a stream (this project's WebDataset shards): their metadata, their
start-up check and count, and `ShardStream`, the per-rank stream of (image, label, skipped).

Training streams are cut to a fixed number of samples per rank per epoch
(``floor(num_samples / world) // batch_size`` full batches), so every rank runs the same
number of steps and none waits at the end of an epoch. Shards are shuffled per epoch and
dealt to (rank, worker) slots; each slot cycles over its shards through a shuffle buffer
until it has produced its quota. Evaluation streams visit every sample exactly once across
all ranks and workers (split by shard, or by sample index when there are fewer shards than
slots) and never pad, so metrics are exact with an uneven last batch.

All randomness of the data order comes from ``(seed, epoch, rank, worker)``: a run restarted
mid-epoch replays the same batches. A corrupt training sample is replaced by the next
readable one (the shard stream cycles), so batches stay full and the per-rank count holds; a
corrupt evaluation sample is dropped. Every sample carries the number of corrupt samples
skipped just before it, so the trainer can count them.

The stream is a webdataset pipeline (tar reader, shuffle buffer, image decoder, epoch
length); dealing shards to slots, cycling and counting corrupt samples stay ours, for the
reasons docs/training.md ("Built on webdataset") gives.
"""
import itertools
import json
import logging
import os
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import webdataset as wds
from webdataset.autodecode import imagehandler
from webdataset.tariterators import tarfile_samples
from PIL import Image
from torch.utils.data import IterableDataset

from dcvit.schema import IMAGE_EXTENSIONS, LABEL_EXTENSION, ShardMeta, metadata_path

from .loader import seeded
from .source import DataError, Source, is_remote
from .verify import check_shards

__all__ = ["ShardStream", "count", "dataset"]

_logger = logging.getLogger(__name__)


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


def count(source: Source, key: str = "data", num_classes: Optional[int] = None,
                  cache_dir: Optional[str] = None) -> Dict[str, int]:
    """{'num_samples', 'num_classes', 'classes_exact'} of a source, after checking it.

    Local shards are always checked (`verify.check_shards`: every tar readable, every
    label an integer in [0, num_classes); headers and labels only, cached by size and mtime);
    the count is the checked one, and the class count comes from the shards' metadata
    (`DIR/<split>.json`) when present.
    """
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
        seeded(self.seed, self.epoch).shuffle(order)  # same deal on every slot
        while len(order) < nslots:
            order += order
        mine = order[slot::nslots]
        rng = seeded(self.seed, self.epoch, slot)

        def one_pass() -> List[str]:
            rng.shuffle(mine)
            return list(mine)

        buffer = max(self.shuffle_buffer, 1)
        return wds.DataPipeline(one_pass, _samples,
                                lambda samples: _repeated(samples, self.repeats),
                                wds.shuffle(buffer, initial=buffer, rng=rng),
                                _Decoded(self.transform, self.on_corrupt, training=True))


def dataset(source: Source, transform: Callable, cfg: Any, training: bool, rank: int,
            world_size: int, batches: int) -> Tuple[ShardStream, None, int]:
    """(the rank's stream, no sampler, batches per epoch) of tar shards."""
    b = cfg.batch_size
    slots = world_size * max(cfg.data.num_workers, 1)
    if training and len(source.shards) < slots and rank == 0:
        _logger.warning("data.train has %d shards for %d (rank, worker) slots: some shards are "
                        "read by several slots, so samples repeat within an epoch; write more, "
                        "smaller shards (make_wds_shards.py --shard-size)", len(source.shards), slots)
    ds = ShardStream(source.shards, transform, rank=rank, world_size=world_size,
                     seed=cfg.seed, quota=batches * b if training else None, batch_size=b,
                     shuffle_buffer=cfg.data.shuffle_buffer if training else 0,
                     repeats=cfg.aug.repeated_aug if training else 1,
                     on_corrupt=cfg.data.on_corrupt)
    return ds, None, batches
