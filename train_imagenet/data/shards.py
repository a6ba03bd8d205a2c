"""Tar shards read as a stream: this project's WebDataset shards and timm's release
(`timm_wds`): their metadata, their start-up check and count, and `ShardStream`, the
`SampleStream` whose units are shards (stream.py says how an epoch is dealt to ranks and
workers).

The stream is a webdataset pipeline (tar reader, shuffle buffer, image decoder, epoch
length); dealing samples to slots and counting corrupt samples stay ours, for the reasons
docs/training.md ("Built on webdataset") gives.
"""
import json
import logging
import os
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from webdataset.tariterators import tarfile_samples

from dcvit.schema import ShardMeta, metadata_path

from .source import DataError, Source, is_remote
from .stream import SampleStream
from .timm_wds import INFO_NAMES
from .verify import check_shards

__all__ = ["ShardStream", "count", "dataset", "lengths_of"]

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
          cache_dir: Optional[str] = None) -> Dict[str, Any]:
    """{'num_samples', 'num_classes', 'classes_exact'} of a source, after checking it.

    Local shards are always checked (`verify.check_shards`: every tar readable, every
    label an integer in [0, num_classes); headers and labels only, cached by size and mtime);
    the count is the checked one, and the class count comes from the shards' metadata
    (`DIR/<split>.json`) when present. The shard lengths timm's ``_info`` gives are checked
    against that count (a mismatch is a warning naming the shard; the count wins); those of
    remote shards are taken as given. 'lengths' holds the samples of each shard.
    """
    remote = any(is_remote(s) for s in source.shards)
    if source.shard_lengths is not None and remote:
        return {"num_samples": sum(source.shard_lengths), "num_classes": 0, "classes_exact": 0,
                "lengths": list(source.shard_lengths)}
    if remote:
        raise DataError(f"cannot count the samples of remote shards ({source.shards[0]!r}, ...); "
                        f"set data.train_samples / data.val_samples")
    check = check_shards(source.shards, key, num_classes if num_classes else 2**62, cache_dir)
    if check.problem:
        raise DataError(check.problem)
    if source.shard_lengths is not None:
        _warn_info_lengths(source, check.lengths)
    meta = _metadata(source.shards)
    if meta is not None and meta.num_samples != check.num_samples:
        _logger.warning("%s says num_samples=%d but the shards hold %d samples: using %d "
                        "(make_wds_shards.py --verify checks the metadata)",
                        metadata_path(source.shards[0]), meta.num_samples, check.num_samples,
                        check.num_samples)
    if meta is not None and meta.num_classes is not None:
        return {"num_samples": check.num_samples, "num_classes": meta.num_classes,
                "classes_exact": 1, "lengths": check.lengths}
    return {"num_samples": check.num_samples, "num_classes": check.max_label + 1,
            "classes_exact": 0, "lengths": check.lengths}


def _warn_info_lengths(source: Source, counted: List[int]) -> None:
    """Warns when timm's ``_info`` gives shard lengths other than the shards hold (too small,
    samples would never be read; too large, samples would be read twice an epoch)."""
    given = list(source.shard_lengths or [])
    wrong = [(s, a, b) for s, a, b in zip(source.shards, given, counted) if a != b]
    if not wrong:
        return
    folder = os.path.dirname(source.shards[0])
    info = next((os.path.join(folder, n) for n in INFO_NAMES
                 if os.path.isfile(os.path.join(folder, n))), os.path.join(folder, INFO_NAMES[0]))
    shard, a, b = wrong[0]
    more = f" (and {len(wrong) - 1} more shards differ)" if len(wrong) > 1 else ""
    _logger.warning("%s gives %s %d samples but it holds %d%s: split %s holds %d samples, not "
                    "%d; using the counted lengths (fix its shard_lengths, or remove it)", info,
                    shard, a, b, more, source.split, sum(counted), sum(given))


def lengths_of(source: Source, cache_dir: Optional[str] = None) -> Optional[List[int]]:
    """The sample count of each shard: the start-up check's (cached, so usually no tar is
    read again), or timm's ``_info`` for remote shards; None for other remote shards or
    shards that do not pass."""
    if any(is_remote(s) for s in source.shards):
        return list(source.shard_lengths) if source.shard_lengths is not None else None
    check = check_shards(source.shards, "data", 2**62, cache_dir)
    return None if check.problem else check.lengths


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


class ShardStream(SampleStream):
    """The `SampleStream` of tar shards: each unit is a shard, read by webdataset's tar
    reader; `lengths` are the shards' sample counts (from the start-up check or timm's
    ``_info``), or None."""

    def __init__(self, shards: List[str], transform: Callable, **kwargs: Any):
        super().__init__(shards, _read_tar, transform, **kwargs)


def dataset(source: Source, transform: Callable, cfg: Any, training: bool, rank: int,
            world_size: int, batches: int,
            lengths: Optional[List[int]] = None) -> Tuple[ShardStream, None, int]:
    """(the rank's stream, no sampler, batches per epoch) of tar shards; `lengths` as
    `count` gives them (else read from the start-up check's cache)."""
    b = cfg.batch_size
    if lengths is None or len(lengths) != len(source.shards):
        lengths = lengths_of(source)
    slots = world_size * max(cfg.data.num_workers, 1)
    if training and lengths is None and len(source.shards) < slots and rank == 0:
        _logger.warning("data.train has %d shards for %d (rank, worker) slots: some shards are "
                        "read by several slots, so samples repeat within an epoch; write more, "
                        "smaller shards (make_wds_shards.py --shard-size)", len(source.shards), slots)
    ds = ShardStream(source.shards, transform, rank=rank, world_size=world_size, lengths=lengths,
                     seed=cfg.seed, quota=batches * b if training else None, batch_size=b,
                     shuffle_buffer=cfg.data.shuffle_buffer if training else 0,
                     repeats=cfg.aug.repeated_aug if training else 1,
                     on_corrupt=cfg.data.on_corrupt)
    return ds, None, batches
