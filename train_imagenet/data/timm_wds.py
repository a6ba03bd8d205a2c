"""timm's WebDataset release (``timm/imagenet-1k-wds`` on the Hugging Face Hub): tars named
``imagenet1k-<split>-<n>.tar`` holding ``<key>.jpg``, ``<key>.cls`` and ``<key>.json``, and
``_info.json``/``_info.yaml`` giving each split's shard names, shard lengths and sample count.

The splits, files and counts come from ``_info`` without reading a tar (as timm's own
``create_dataset('wds/...')`` reads them); without ``_info`` the ``-<split>-`` part of the
tar names decides. ``_info`` is never a split. The samples are read as this project's shards
are (`shards`): webdataset's tar reader, the ``.cls`` member as the label, other members
(``.json``) ignored.
"""
import json
import os
import re
from typing import Any, Callable, Dict, List

import braceexpand

from .source import DataError, Source

__all__ = ["INFO_NAMES", "is_timm", "read_info", "resolve"]

INFO_NAMES = ("_info.json", "_info.yaml")
_NAMED = re.compile(r"^(?P<prefix>.+)-(?P<split>[A-Za-z0-9_]+)-\d+\.tar$")


def is_timm(folder: str, tars: List[str]) -> bool:
    """Whether `folder` (holding `tars`) is laid out as timm's release."""
    return any(os.path.isfile(os.path.join(folder, n)) for n in INFO_NAMES) or (
        bool(tars) and all(_NAMED.match(t) for t in tars))


def read_info(folder: str) -> Dict[str, Any]:
    """The ``splits`` of ``_info.json`` (or ``_info.yaml``): {split: {'filenames',
    'shard_lengths', 'num_samples'}}; {} when there is neither file."""
    for name in INFO_NAMES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                if name.endswith(".json"):
                    info = json.load(f)
                else:
                    import yaml
                    info = yaml.safe_load(f)
            splits = info["splits"]
            for entry in splits.values():
                entry["filenames"]  # noqa: B018 - every split names its files
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(f"{path} cannot be read as timm's dataset info ({type(e).__name__}: "
                            f"{e}); expected {{'splits': {{name: {{'filenames': [...], "
                            f"'shard_lengths': [...]}}}}}}: fix or remove it") from None
        except Exception as e:  # yaml's errors
            raise DataError(f"{path} is not valid YAML ({e}); fix or remove it") from None
        return splits
    return {}


def resolve(folder: str, key: str, choose: Callable[[List[str]], str]) -> Source:
    """The split `choose` picks among the folder's splits, as a `Source` of kind 'wds'."""
    splits = read_info(folder)
    if splits:
        split = choose(sorted(splits))
        if split not in splits:
            raise DataError(f"{key}={folder!r}: its _info lists the splits {sorted(splits)}, not "
                            f"{split!r}; set {key}_split to one of them")
        entry = splits[split]
        names = [n for pattern in entry["filenames"] for n in braceexpand.braceexpand(pattern)]
        files = [os.path.join(folder, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise DataError(f"{key}={folder!r}: {len(missing)} of the {len(files)} {split} shards "
                            f"its _info lists are missing ({', '.join(missing[:3])}); download "
                            f"them or remove _info.json/_info.yaml")
        lengths = entry.get("shard_lengths")
        known = list(map(int, lengths)) if lengths and len(lengths) == len(files) else None
        return Source("wds", shards=files, layout="timm-wds", split=split,
                      num_samples=sum(known) if known else None, shard_lengths=known)
    by_split: Dict[str, List[str]] = {}
    for name in sorted(os.listdir(folder)):
        m = _NAMED.match(name)
        if m:
            by_split.setdefault(m.group("split"), []).append(os.path.join(folder, name))
    split = choose(sorted(by_split))
    if split not in by_split:
        raise DataError(f"{key}={folder!r} holds the shards of the splits {sorted(by_split)} "
                        f"(by their names), not {split!r}; set {key}_split to one of them")
    return Source("wds", shards=by_split[split], layout="timm-wds", split=split)
