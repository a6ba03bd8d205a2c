"""From `data.train`/`data.val` to a `Source`: the kind from what is on disk, the split
from the key.

A spec is a brace pattern (``DIR/train-{000000..000099}.tar``), a directory of ``.tar``
files (only its ``train-*.tar`` / ``val-*.tar`` when present), or a single file. A directory
without ``.tar`` files is read as an ImageFolder. Shards named for another split
(``data.val`` given ``train-*.tar``) are refused.
"""
import os
from typing import List

import braceexpand

from dcvit.schema import split_of

from .source import DataError, Source, is_remote

__all__ = ["resolve_source"]


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
            return Source("wds", shards=_check_split(tars, key, spec), split=split)
        if any(os.path.isdir(os.path.join(spec, n)) for n in os.listdir(spec)):
            return Source("folder", root=spec, split=split)
        raise DataError(f"{key}={spec!r} is a directory with neither .tar shards nor class "
                        f"sub-folders; write shards with scripts/make_wds_shards.py")
    shards = list(braceexpand.braceexpand(spec))
    split = key.rsplit(".", 1)[-1]
    if any(is_remote(s) for s in shards):
        return Source("wds", shards=_check_split(shards, key, spec), split=split)  # counts: data.*_samples
    missing = [s for s in shards if not os.path.isfile(s)]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise DataError(f"{key}={spec!r}: {len(missing)} of {len(shards)} shards are missing "
                        f"({', '.join(missing[:3])}{more}); check the path and the brace range")
    return Source("wds", shards=_check_split(shards, key, spec), split=split)


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
