"""What a conversion writes before it reads any image: the samples, their keys and the shard plan.

A `Sample` names where its image bytes lie: a whole file, a byte range of an uncompressed
tar (an image-net.org archive, a WebDataset shard), or a row of a Parquet file. The plan
(which sample goes into which shard, in which order) is made from the sorted sample list
and the seed, in the parent process, so the shards are the same bytes whatever the number
of writing processes.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Sequence

from dcvit.schema import shard_name

TAR_BLOCK = 512
TAR_RECORD = 20 * TAR_BLOCK
MAX_KEY_CHARS = 90  # ustar names hold 100 characters; leave room for ".jpg" and a "-N" suffix


class ConversionError(Exception):
    """A bad input or option; the message names the value and the fix."""


@dataclass(frozen=True, slots=True)
class Sample:
    path: str        # the file holding the image: an image file, a tar, a Parquet file
    key: str         # WebDataset key: unique, no dots or slashes
    label: int       # class index
    size: int        # image bytes (for --max-shard-bytes planning; 0 when unknown)
    at: tuple = ()   # () the whole file; (offset,) a tar member's bytes; (row_group, row) Parquet


def make_keys(relpaths: Sequence[str]) -> list[str]:
    """Unique, tar-safe WebDataset keys from relative paths: ``cls/img.JPEG`` -> ``cls__img``.

    WebDataset splits a member name at the first dot of its last component, so keys carry no
    dots or slashes; other odd characters (bytes of a file name that is not UTF-8 included)
    become ``_``; a key longer than `MAX_KEY_CHARS` is cut and ends with a hash of the whole
    path; a collision gets ``-1``, ``-2``, ...
    """
    keys, seen = [], set()
    for rel in relpaths:
        stem = rel.rsplit(".", 1)[0] if "." in PurePosixPath(rel).name else rel
        key = re.sub(r"[^A-Za-z0-9_-]", "_", stem.replace("/", "__")).lstrip("_-") or "sample"
        if len(key) > MAX_KEY_CHARS:
            # os.fsencode's surrogateescape gives a file name's own bytes, UTF-8 or not
            digest = hashlib.sha1(rel.encode("utf-8", "surrogateescape")).hexdigest()[:8]
            key = key[:MAX_KEY_CHARS - 9] + "-" + digest
        base, n = key, 0
        while key in seen:
            n += 1
            key = f"{base}-{n}"
        seen.add(key)
        keys.append(key)
    return keys


def _tar_bytes(payload: int) -> int:
    """Bytes one tar member of ``payload`` bytes takes: header block + data padded to blocks."""
    return TAR_BLOCK + -(-payload // TAR_BLOCK) * TAR_BLOCK


def plan_shards(samples: Sequence[Sample], shard_size: int, max_bytes: int | None) -> list[list[Sample]]:
    """Consecutive groups of at most ``shard_size`` samples and ``max_bytes`` bytes of tar.

    The byte count is exact for JPEG/PNG sources (stored unchanged) and an estimate for images
    re-encoded to PNG; a single sample larger than ``max_bytes`` gets a shard of its own.
    """
    def tar_size(members: int) -> int:  # + end-of-archive blocks, padded to whole records
        return -(-(members + 2 * TAR_BLOCK) // TAR_RECORD) * TAR_RECORD

    shards: list[list[Sample]] = []
    current: list[Sample] = []
    members = 0
    for s in samples:
        need = _tar_bytes(s.size) + _tar_bytes(len(str(s.label)))
        full = len(current) >= shard_size or (
            max_bytes is not None and current and tar_size(members + need) > max_bytes)
        if full:
            shards.append(current)
            current, members = [], 0
        current.append(s)
        members += need
    if current:
        shards.append(current)
    return shards


def brace_pattern(out, split: str, num_shards: int) -> str:
    """The shard names of a split as one brace pattern (a single name for one shard)."""
    if num_shards == 1:
        return str(out / shard_name(split, 0))
    return str(out / f"{split}-{{{0:06d}..{num_shards - 1:06d}}}.tar")


# Folder names that say which split a source holds (a word of the name: ILSVRC2012_img_val).
SPLIT_WORDS = {"train": "train", "training": "train", "val": "val", "valid": "val",
               "validation": "val", "test": "test", "testing": "test"}


def infer_split(name: str) -> str | None:
    """The split a source's name says (``val``, ``ILSVRC2012_img_val.tar`` -> val), or None."""
    words = re.split(r"[^a-z0-9]+", name.lower())
    found = {SPLIT_WORDS[w] for w in words if w in SPLIT_WORDS}
    if len(found) > 1:
        raise ConversionError(f"the name of --src {name} says {sorted(found)}; pass --split NAME")
    return found.pop() if found else None
