"""Train and validation never overlap in silence: `check_overlap` refuses two sources that
share files (the same tar, Parquet file or image, by real path) or samples (the same key with
the same image bytes: a tar member's key, an image file's name without its suffix; a Parquet
row's ``image.path``, which names the original file, is compared by itself), for every kind
of source. Only the images of keys found on both sides are read; remote shards are compared
by name only. Keys alone are not enough: this project's shards number each split's keys from
0, so equal keys in two splits are usually different images.
"""
import os
import tarfile
from typing import Dict, List, Optional, Set, Tuple

from webdataset.tariterators import base_plus_ext

from .source import DataError, Source, is_remote

__all__ = ["check_overlap", "files_of", "samples_of"]


def files_of(source: Source) -> List[str]:
    """The real paths of what the source reads (its tars or Parquet files, or its images)."""
    if source.kind == "folder":
        from .folder import files
        return files(source)
    return [s if is_remote(s) else os.path.realpath(s) for s in source.shards]


Locator = Optional[Tuple[str, Optional[str], int]]   # (file, tar member or None, bytes)


def _tar_images(shard: str) -> Dict[str, Locator]:
    from dcvit.schema import IMAGE_EXTENSIONS
    found: Dict[str, Locator] = {}
    try:
        with tarfile.open(shard) as tar:
            for member in tar:          # headers only: tarfile seeks over the data
                if member.isfile():
                    key, ext = base_plus_ext(member.name)
                    if key and ext and ext.lower() in IMAGE_EXTENSIONS:
                        found[key] = (shard, member.name, member.size)
    except (tarfile.TarError, OSError):
        pass                            # the start-up check names a broken shard
    return found


def samples_of(source: Source) -> Optional[Dict[str, Locator]]:
    """{key: where its image is}, or None where the keys cannot be read here (remote shards);
    a None locator (Parquet) means the key alone identifies the sample."""
    if source.kind == "folder":
        from .folder import keys, files
        return {k: (p, None, os.path.getsize(p)) for k, p in zip(keys(source), files(source))}
    if source.kind == "parquet":
        from .parquet import keys
        return dict.fromkeys(keys(source))
    if any(is_remote(s) for s in source.shards):
        return None
    out: Dict[str, Locator] = {}
    for shard in source.shards:
        out.update(_tar_images(shard))
    return out


def _read(where: Tuple[str, Optional[str], int]) -> bytes:
    path, member, _ = where
    if member is None:
        with open(path, "rb") as f:
            return f.read()
    with tarfile.open(path) as tar:
        return tar.extractfile(member).read()


def _same(a: Locator, b: Locator) -> bool:
    if a is None or b is None:
        return True
    if a[2] != b[2]:
        return False
    try:
        return _read(a) == _read(b)
    except (OSError, tarfile.TarError, KeyError, AttributeError):
        return False


def _examples(items: Set[str]) -> str:
    shown = sorted(items)[:3]
    return ", ".join(map(repr, shown)) + (f" and {len(items) - 3} more" if len(items) > 3 else "")


def check_overlap(train: Source, val: Source, train_spec: str, val_spec: str) -> None:
    """Raises DataError naming what `train` and `val` share."""
    fix = ("point data.val at the validation split (docs/data.md: the same folder for both "
           "keys gives its train and validation splits)")
    shared = set(files_of(train)) & set(files_of(val))
    if shared:
        raise DataError(f"data.train={train_spec!r} ({train.split}) and data.val={val_spec!r} "
                        f"({val.split}) share {len(shared)} files ({_examples(shared)}): the "
                        f"validation metric would be measured on training data; {fix}")
    a, b = samples_of(train), samples_of(val)
    if a is None or b is None:
        return
    same = {k for k in a.keys() & b.keys() if _same(a[k], b[k])}
    if same:
        raise DataError(f"data.train={train_spec!r} ({train.split}) and data.val={val_spec!r} "
                        f"({val.split}) hold {len(same)} of the same samples (keys "
                        f"{_examples(same)}): the validation metric would be measured on "
                        f"training data; {fix}")
