"""`SampleStream`: the per-rank stream of (image, label, skipped) that every streamed source
(tar shards, Parquet row groups) is read through, built in each DataLoader worker as a
`webdataset.DataPipeline`.

A source is a list of *units* (a tar, a row group) read in order by ``read(unit)`` into raw
samples ``{'__key__', '__url__', <image ext>: bytes, 'cls': label}``. When the units' lengths
are known (the start-up check counts every local shard, timm's ``_info`` and Parquet's
metadata give them), each epoch is dealt by sample position:

- **training**: the units are shuffled by ``(seed, epoch)`` (the same order on every slot)
  and read as one ring of samples, starting at a position drawn from ``(seed, epoch)``;
  (rank, worker) slot ``s`` reads the ``s``-th contiguous range of it, of its quota's
  length, through its shuffle buffer (seeded by ``(seed, epoch, slot)``, drained at the end
  of the range). Every sample is read once per epoch, except the few past the last whole
  batch of each rank (fewer than one update's worth per rank), whatever the units' sizes;
  those left out are others every epoch (the start moves), as a `DistributedSampler`'s are.
  Every rank yields the same number of whole batches. A corrupt sample is replaced by the
  next readable one after the range (read in order, unshuffled), so the quota holds;
  `with_epoch` cuts the stream at it.
- **evaluation**: slot ``s`` reads the ``s``-th of ``world x workers`` near-equal contiguous
  ranges of the units in their given order: every sample once, no padding; a corrupt one
  is dropped (and counted).

When the lengths are not known (remote shards given with ``data.train_samples``), units are
dealt whole to slots: each training slot cycles over its units until it has its quota, so
samples repeat within an epoch when units are uneven; an evaluation slot reads whole units
(or every ``n``-th sample when there are fewer units than slots).

All randomness comes from ``(seed, epoch, rank, worker)``: a run restarted mid-epoch replays
the same batches. Every sample carries the number of corrupt samples skipped just before
it, so the trainer can count them.
"""
import itertools
import re
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import IterableDataset

from dcvit.schema import IMAGE_EXTENSIONS, LABEL_EXTENSION

from ..images import open_image
from .loader import seeded
from .source import DataError

__all__ = ["SampleStream", "decode", "parse_cls", "positions"]

_DIGITS = re.compile(rb"\s*\d+\s*")


def parse_cls(value: Any) -> int:
    """A ``.cls`` member as a class index: ASCII digits only (``int()`` would also take
    ``0_3``, ``+3`` or ``٣``), surrounding white space allowed; an int passes as it is."""
    if isinstance(value, int):
        return value
    raw = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
    if not _DIGITS.fullmatch(raw):
        raise ValueError(f"the label {raw[:20]!r} is not an integer (ASCII digits only)")
    return int(raw)


def decode(sample: Dict[str, Any]) -> Tuple[Image.Image, int]:
    ext = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
    if ext is None:
        raise ValueError(f"no image member ({'/'.join(IMAGE_EXTENSIONS)}) in sample")
    if LABEL_EXTENSION not in sample:
        raise ValueError(f"no .{LABEL_EXTENSION} member in sample")
    label = parse_cls(sample[LABEL_EXTENSION])
    return open_image(sample[ext], name=f"{sample.get('__key__')}.{ext}"), label


def _repeated(samples: Iterable[Dict[str, Any]], times: int) -> Iterator[Dict[str, Any]]:
    for sample in samples:
        for _ in range(times):
            yield sample


def positions(lengths: Sequence[int], order: Sequence[int], start: int,
              stop: int) -> List[Tuple[int, int, int]]:
    """[(unit, begin, end)]: the pieces of units that hold positions [start, stop) of the
    sequence of units read in `order`, taken as a ring (position p is p modulo the
    sequence's length: a range past its end goes on from its start)."""
    total = sum(lengths[unit] for unit in order)
    out: List[Tuple[int, int, int]] = []
    while start < stop and total:
        base = start - start % total
        lo, hi = start - base, min(stop - base, total)
        offset = 0
        for unit in order:
            n = lengths[unit]
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                out.append((unit, a - offset, b - offset))
            offset += n
            if offset >= hi:
                break
        start = base + hi
    return out


class _Decoded:
    """The decoding stage: (image, label, skipped) from raw samples, one pass per call.

    A corrupt sample fails (`on_corrupt='fail'`) or is skipped and counted in the next yielded
    sample's `skipped` (the count carries over from one pass to the next). In training a pass
    without one readable sample is an error: the quota would never fill."""

    def __init__(self, transform: Callable, on_corrupt: str, training: bool):
        self.transform, self.on_corrupt, self.training = transform, on_corrupt, training
        self.skipped = 0

    def __call__(self, samples: Iterable[Dict[str, Any]]) -> Iterator[Tuple[Any, int, int]]:
        good, bad_units = 0, []
        for sample in samples:
            try:
                img, label = decode(sample)
            except Exception as e:  # PIL raises many types for broken files
                where = sample.get("__url__", "?")
                if self.on_corrupt == "fail":
                    raise DataError(f"corrupt sample {sample.get('__key__')!r} in {where!r}: {e} "
                                    f"(set data.on_corrupt=skip to skip and count such samples)") from e
                if where not in bad_units:
                    bad_units.append(where)
                self.skipped += 1
                continue
            good += 1
            yield self.transform(img), label, self.skipped
            self.skipped = 0
        if self.training and good == 0:
            raise DataError(f"no readable sample in a whole pass over this worker's data "
                            f"({self.skipped} corrupt, in {', '.join(map(repr, bad_units[:3]))}"
                            f"{' and more' if len(bad_units) > 3 else ''}); re-write them "
                            f"with scripts/make_wds_shards.py")


class SampleStream(IterableDataset):
    """The stream of one rank (see the module's docstring).

    `units` are what `read` opens; `lengths` their sample counts, or None when unknown.
    `quota` (training) is the number of samples this rank yields per epoch (whole batches);
    None (evaluation) yields this rank's share of every sample exactly once.
    """

    def __init__(self, units: Sequence[Any], read: Callable[[Any], Iterator[Dict[str, Any]]],
                 transform: Callable, *, rank: int, world_size: int, seed: int,
                 lengths: Optional[Sequence[int]] = None, quota: Optional[int] = None,
                 batch_size: int = 1, shuffle_buffer: int = 0, repeats: int = 1,
                 on_corrupt: str = "skip"):
        self.units, self.read, self.transform = list(units), read, transform
        self.lengths = list(lengths) if lengths is not None else None
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.quota, self.batch_size = quota, batch_size
        self.shuffle_buffer, self.repeats, self.on_corrupt = shuffle_buffer, repeats, on_corrupt
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _worker(self) -> Tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def _worker_quota(self, wid: int, nw: int) -> int:
        """This worker's share of the rank's batches, in samples (whole batches)."""
        batches = self.quota // self.batch_size
        return (batches // nw + (wid < batches % nw)) * self.batch_size

    def _read(self, pieces: List[Tuple[int, int, int]]) -> Iterator[Dict[str, Any]]:
        for unit, begin, end in pieces:
            yield from itertools.islice(self.read(self.units[unit]), begin, end)

    def __iter__(self) -> Iterator[Tuple[Any, int, int]]:
        wid, nw = self._worker()
        slot, nslots = self.rank * nw + wid, self.world_size * nw
        if self.quota is None:
            pipe = self._eval_pipeline(slot, nslots) if self.lengths is not None else \
                self._eval_pipeline_whole_units(slot, nslots)
            return iter(pipe)
        quota = self._worker_quota(wid, nw)
        if quota == 0:
            return iter(())
        pipe = self._train_pipeline(wid, nw) if self.lengths is not None else \
            self._train_pipeline_whole_units(slot, nslots)
        return iter(pipe.with_epoch(quota))

    # ---------------------------------------------------------------- lengths known
    def _eval_pipeline(self, slot: int, nslots: int) -> wds.DataPipeline:
        total = sum(self.lengths)
        lo, hi = slot * total // nslots, (slot + 1) * total // nslots
        pieces = positions(self.lengths, range(len(self.units)), lo, hi)
        return wds.DataPipeline(lambda: self._read(pieces),
                                _Decoded(self.transform, self.on_corrupt, training=False))

    def _train_pipeline(self, wid: int, nw: int) -> wds.DataPipeline:
        total = sum(self.lengths)
        order = list(range(len(self.units)))
        deal = seeded(self.seed, self.epoch)                     # the same deal on every slot
        deal.shuffle(order)
        first = deal.randrange(total) if total else 0   # where the epoch starts: moves the tail
        distinct = [-(-self._worker_quota(w, nw) // self.repeats) for w in range(nw)]
        start = first + self.rank * sum(distinct) + sum(distinct[:wid])
        stop = start + distinct[wid]
        mine = positions(self.lengths, order, start, stop)
        # replacements for corrupt samples: the samples after this range, in order, wrapping
        spare = positions(self.lengths, order, stop, start + total)
        rng = seeded(self.seed, self.epoch, self.rank * nw + wid)
        buffer = max(self.shuffle_buffer, 1)
        return wds.DataPipeline(lambda: self._read(mine),
                                lambda samples: _repeated(samples, self.repeats),
                                wds.shuffle(buffer, initial=buffer, rng=rng),
                                lambda samples: itertools.chain(samples, self._read(spare)),
                                _Decoded(self.transform, self.on_corrupt, training=True))

    # ---------------------------------------------------------------- lengths unknown
    def _whole(self, units: Iterable[Any]) -> Iterator[Dict[str, Any]]:
        for unit in units:
            yield from self.read(unit)

    def _eval_pipeline_whole_units(self, slot: int, nslots: int) -> wds.DataPipeline:
        decoded = _Decoded(self.transform, self.on_corrupt, training=False)
        if len(self.units) >= nslots:  # whole units per slot
            return wds.DataPipeline(lambda: self._whole(self.units[slot::nslots]), decoded)
        # fewer units than slots: every slot reads all, keeps every nslots-th sample
        return wds.DataPipeline(lambda: self._whole(self.units),
                                lambda samples: itertools.islice(samples, slot, None, nslots),
                                decoded)

    def _train_pipeline_whole_units(self, slot: int, nslots: int) -> wds.DataPipeline:
        """This slot's units in a new order each pass, through the shuffle buffer (drained at
        the end of each pass: no repeats inside a pass)."""
        order = list(self.units)
        seeded(self.seed, self.epoch).shuffle(order)  # same deal on every slot
        while len(order) < nslots:
            order += order
        mine = order[slot::nslots]
        rng = seeded(self.seed, self.epoch, slot)

        def one_pass() -> Iterator[Dict[str, Any]]:
            rng.shuffle(mine)
            return self._whole(list(mine))

        buffer = max(self.shuffle_buffer, 1)
        return wds.DataPipeline(one_pass,
                                lambda samples: _repeated(samples, self.repeats),
                                wds.shuffle(buffer, initial=buffer, rng=rng),
                                _Decoded(self.transform, self.on_corrupt, training=True))
