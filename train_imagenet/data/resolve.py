"""From `data.train`/`data.val` to a `Source`: the layout from what is on disk (or
``data.kind``), the split from the key (or ``data.train_split``/``data.val_split``).

What a directory holds decides its layout, in this order:

- ``_info.json``/``_info.yaml``, or tars named ``<name>-<split>-<n>.tar``: timm's WebDataset
  release (`timm_wds`);
- ``*.parquet`` files, in it or in its ``data/``: a Hugging Face Parquet release (`parquet`);
- tars named ``<split>-<n>.tar``: this project's shards;
- ``meta.bin`` beside ``train/`` and ``val/``: a torchvision-prepared ImageNet root, whose
  ``<split>/`` is an ImageFolder;
- class sub-folders: an ImageFolder;
- images and ``data.<key>_labels``: a flat image folder with a labels file (`folder`).

A brace pattern (``DIR/train-{000000..000099}.tar``) or a single file is read as shards.
A folder that holds several splits gives each key its own: ``train`` for ``data.train``,
``validation`` or ``val`` for ``data.val``. A split named for the other key is refused
(``data.val`` given train shards, ``data.train_split=validation``), and so is a split the
folder does not hold, naming those it does.
"""
import os
import re
from typing import Dict, List, Optional

import braceexpand

from dcvit.schema import split_of

from . import parquet, timm_wds
from .source import DataError, Source, is_remote

__all__ = ["resolve_source", "wanted_split", "TAR_SPLIT"]

# Split names that belong to one key and never to the other.
_FOREIGN_SPLITS = {"train": ("val", "validation", "test"), "val": ("train",)}
TAR_SPLIT = re.compile(r"^(?:(?P<prefix>.+)-)?(?P<split>[A-Za-z0-9_]+)-\d+\.tar$")
_KIND_NAMES = {"shards": "this project's shards", "timm-wds": "timm's WebDataset release",
               "parquet": "a Hugging Face Parquet folder", "imagefolder": "an ImageFolder",
               "torchvision": "a torchvision ImageNet root", "flat": "a flat image folder"}


def wanted_split(key: str, choices: List[str], given: str = "") -> str:
    """The split `key` reads among `choices` (the splits a folder holds): `given`, else
    'train' for data.train and 'validation' or 'val' for data.val."""
    role = key.rsplit(".", 1)[-1]
    if given:
        _refuse_foreign(role, given, key, f"{key}_split={given}")
        return given
    if role == "train":
        return "train"
    return next((s for s in ("validation", "val") if s in choices), "val")


def _refuse_foreign(role: str, split: str, key: str, what: str) -> None:
    if split in _FOREIGN_SPLITS.get(role, ()):
        other = "data.val" if role == "train" else "data.train"
        raise DataError(f"{what} names the {split} split, which is {other}'s; give {key} its "
                        f"own split ({'train' if role == 'train' else 'validation or val'})")


def _is_image(name: str) -> bool:
    from dcvit.schema import IMAGE_EXTENSIONS
    return not name.startswith(".") and name.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS


def _kind_of(spec: str, labels: str) -> str:
    names = os.listdir(spec)
    tars = [n for n in names if n.endswith(".tar")]
    if timm_wds.is_timm(spec, tars):
        return "timm-wds"
    if parquet.files_of(spec):
        return "parquet"
    if tars:
        return "shards"
    if "meta.bin" in names and os.path.isdir(os.path.join(spec, "train")):
        return "torchvision"
    if labels:
        return "flat"
    if any(os.path.isdir(os.path.join(spec, n)) and not n.startswith(".") for n in names):
        return "imagefolder"
    if any(_is_image(n) for n in names):
        return "flat"        # its labels file is read by build_data (data.<key>_labels)
    raise DataError(f"{{key}}={spec!r} is a directory with neither .tar shards, .parquet files, "
                    f"class sub-folders nor images; see docs/data.md (what you have -> what "
                    f"to type)")


def resolve_source(spec: str, key: str, split: str = "", labels: str = "", kind: str = "",
                   label_offset: int = 0, label_names: str = "",
                   classes: Optional[List[str]] = None, num_classes: int = 0) -> Source:
    """Turns `data.train`/`data.val` (`key`) into a `Source`. `split`, `labels` and `kind` are
    the key's ``data.*_split``, ``data.*_labels`` and ``data.kind``; `classes` the train
    split's class names (a flat folder's labels are looked up in them)."""
    role = key.rsplit(".", 1)[-1]
    if not spec:
        raise DataError(f"{key} is empty; set {key}=DIR (shards, timm's WebDataset or Parquet "
                        f"folder, an ImageFolder; docs/data.md) or "
                        f"{key}=DIR/train-{{000000..000009}}.tar")
    if split:
        _refuse_foreign(role, split, key, f"{key}_split={split}")
    if not os.path.isdir(spec):
        if kind and kind != "shards":
            raise DataError(f"{key}={spec!r} is not a directory; data.kind={kind} reads a folder")
        return _pattern(spec, key, role, split)
    try:
        found = kind or _kind_of(spec, labels)
    except DataError as e:
        raise DataError(str(e).replace("{key}", key)) from None
    if found == "timm-wds":
        return timm_wds.resolve(spec, key, lambda choices: wanted_split(key, choices, split))
    if found == "parquet":
        return parquet.resolve(spec, key, lambda choices: wanted_split(key, choices, split))
    if found == "shards":
        return _shard_folder(spec, key, role, split)
    if found == "torchvision":
        splits = sorted(n for n in ("train", "val") if os.path.isdir(os.path.join(spec, n)))
        chosen = wanted_split(key, splits, split)
        if chosen not in splits:
            raise DataError(f"{key}={spec!r}: a torchvision ImageNet root holds {splits}, not "
                            f"{chosen!r}; set {key}_split to one of them")
        return Source("folder", root=os.path.join(spec, chosen), layout="torchvision",
                      split=chosen)
    if split and found in ("flat", "imagefolder"):
        raise DataError(f"{key}={spec!r} ({_KIND_NAMES[found]}) holds one split, not {split!r} "
                        f"of several; leave {key}_split unset")
    if found == "flat":
        from .folder import flat_source
        if not labels:   # counted as images; build_data asks for the labels file
            return Source("folder", root=spec, layout="flat", split=split or role)
        return flat_source(spec, labels, key, classes, label_offset, label_names, num_classes,
                           split or role)
    return Source("folder", root=spec, split=split or role)


def _shard_folder(spec: str, key: str, role: str, split: str) -> Source:
    """This project's shards: ``DIR/<split>-NNNNNN.tar`` (every tar when no name says a split)."""
    tars = sorted(os.path.join(spec, n) for n in os.listdir(spec) if n.endswith(".tar"))
    by_split: Dict[str, List[str]] = {}
    for t in tars:
        by_split.setdefault(split_of(t), []).append(t)
    chosen = wanted_split(key, list(by_split), split)
    if chosen in by_split:
        return Source("wds", shards=by_split[chosen], split=chosen)
    if split:
        raise DataError(f"{key}={spec!r} has no {split}-*.tar shards (it holds "
                        f"{sorted(by_split)}); set {key}_split to one of them")
    return Source("wds", shards=_check_split(tars, key, spec), split=chosen)


def _pattern(spec: str, key: str, role: str, split: str) -> Source:
    shards = list(braceexpand.braceexpand(spec))
    if any(is_remote(s) for s in shards):  # counts: data.*_samples
        return Source("wds", shards=_check_split(shards, key, spec), split=split or role)
    missing = [s for s in shards if not os.path.isfile(s)]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise DataError(f"{key}={spec!r}: {len(missing)} of {len(shards)} shards are missing "
                        f"({', '.join(missing[:3])}{more}); check the path and the brace range")
    named = {m.group("split") for m in map(TAR_SPLIT.match, map(os.path.basename, shards)) if m}
    layout = "timm-wds" if any(m and m.group("prefix") for m in
                               map(TAR_SPLIT.match, map(os.path.basename, shards))) else "shards"
    return Source("wds", shards=_check_split(shards, key, spec), layout=layout,
                  split=split or (named.pop() if len(named) == 1 else role))


def _check_split(shards: List[str], key: str, spec: str) -> List[str]:
    """Refuses shards whose names say they belong to another split (e.g. data.val=DIR where
    DIR holds only train-*.tar): the result would be reported for the wrong split."""
    role = key.rsplit(".", 1)[-1]
    for shard in shards:
        m = TAR_SPLIT.match(os.path.basename(shard))
        prefix = m.group("split") if m else split_of(shard)
        if prefix in _FOREIGN_SPLITS.get(role, ()):
            raise DataError(f"{key}={spec!r} gives {prefix} shards ({shard!r}), not {role} "
                            f"shards; point {key} at the {role}-*.tar files (make_wds_shards.py "
                            f"--split {role})")
    return shards
