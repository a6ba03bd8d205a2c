"""A Hugging Face Parquet release (``ILSVRC/imagenet-1k``): ``ROOT/data/<split>-NNNNN-of-
NNNNN.parquet`` with the columns ``image`` (``{bytes, path}``) and ``label``, and the class
names in the dataset card (``ROOT/README.md``, its ``dataset_info`` front matter).

The files are read in place with pyarrow (the ``parquet`` extra): each row group is a unit of
a `SampleStream` (counts from the files' metadata, no scan), the image bytes decoded as a
shard's are, the label taken from ``label``. A split whose labels are -1 (the release's test
split has none) is refused for training and evaluation.
"""
import os
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .source import DataError, Source
from .stream import SampleStream

__all__ = ["files_of", "resolve", "count", "dataset", "keys", "card_classes"]

_NAME = re.compile(r"^(?P<split>[A-Za-z0-9_]+)-\d+-of-\d+\.parquet$")
EXTRA = "pip install 'dcvit[parquet]' (pyarrow)"


def _pq() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading Parquet files needs pyarrow: {EXTRA}") from None
    return pq


def _why(e: Exception) -> str:
    """pyarrow's error in one printable line (a damaged page header's message spans lines and
    holds the bytes it could not read)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: " + "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def files_of(folder: str) -> List[str]:
    """The .parquet files of `folder` or of its ``data/``, sorted."""
    for where in (folder, os.path.join(folder, "data")):
        if os.path.isdir(where):
            found = sorted(os.path.join(where, n) for n in os.listdir(where)
                           if n.endswith(".parquet") and not n.startswith("."))
            if found:
                return found
    return []


def _split_of(path: str) -> str:
    name = os.path.basename(path)
    m = _NAME.match(name)
    return m.group("split") if m else re.split(r"[-.]", name, maxsplit=1)[0]


def card_classes(folder: str) -> Optional[List[str]]:
    """The class names of the dataset card's ``label`` feature (``README.md`` front matter:
    ``dataset_info.features[name=label].dtype.class_label.names``), or None."""
    path = os.path.join(folder, "README.md")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    parts = text.split("---\n")
    if not text.startswith("---\n") or len(parts) < 3:
        return None
    import yaml
    try:
        meta = yaml.safe_load(parts[1]) or {}
    except yaml.YAMLError as e:
        raise DataError(f"{path}: its front matter is not valid YAML ({e}); fix it or remove "
                        f"the card (labels are then class indices only)") from None
    infos = meta.get("dataset_info") if isinstance(meta, dict) else None
    for info in infos if isinstance(infos, list) else [infos]:
        for feature in (info or {}).get("features", []) if isinstance(info, dict) else []:
            names = (((feature.get("dtype") or {}).get("class_label") or {}).get("names")
                     if isinstance(feature, dict) and feature.get("name") == "label" else None)
            if isinstance(names, dict):
                return [str(names[k]) for k in sorted(names, key=lambda k: int(k))]
            if isinstance(names, list):
                return [str(n) for n in names]
    return None


def resolve(folder: str, key: str, choose: Callable[[List[str]], str]) -> Source:
    by_split: Dict[str, List[str]] = {}
    for path in files_of(folder):
        by_split.setdefault(_split_of(path), []).append(path)
    split = choose(sorted(by_split))
    if split not in by_split:
        raise DataError(f"{key}={folder!r} holds the Parquet files of the splits "
                        f"{sorted(by_split)}, not {split!r}; set {key}_split to one of them")
    return Source("parquet", shards=by_split[split], root=folder, layout="parquet", split=split,
                  classes=card_classes(folder))


def _units(source: Source) -> Tuple[List[Tuple[str, int]], List[int]]:
    """(file, row group) of every row group, and its rows, from the files' metadata."""
    pq = _pq()
    units, lengths = [], []
    for path in source.shards:
        try:
            meta = pq.ParquetFile(path).metadata
        except Exception as e:  # pyarrow.lib.ArrowInvalid, OSError
            raise DataError(f"{path!r} cannot be read as Parquet ({_why(e)}); "
                            f"download it again") from None
        for g in range(meta.num_row_groups):
            units.append((path, g))
            lengths.append(meta.row_group(g).num_rows)
    return units, lengths


def count(source: Source, key: str = "data", num_classes: Optional[int] = None,
          cache_dir: Optional[str] = None) -> Dict[str, Any]:
    """Rows from the metadata; the ``label`` column is read to refuse a split without labels
    (-1, the test split) and to find the label range."""
    pq = _pq()
    units, lengths = _units(source)
    low, high, unlabelled = None, -1, 0
    for path in source.shards:
        try:
            column = pq.read_table(path, columns=["label"]).column("label").to_pylist()
        except KeyError:
            raise DataError(f"{key}: {path!r} has no 'label' column; a Hugging Face image "
                            f"classification release has 'image' and 'label'") from None
        except Exception as e:  # pyarrow.lib.ArrowInvalid, OSError: damaged pages
            raise DataError(f"{key}: {path!r} has no readable 'label' column ({_why(e)}): its "
                            f"data pages are damaged; download it again") from None
        unlabelled += sum(1 for v in column if v is None or v < 0)
        known = [v for v in column if v is not None and v >= 0]
        if known:
            low = min(known) if low is None else min(low, min(known))
            high = max(high, max(known))
    total = sum(lengths)
    if unlabelled:
        what = "all its" if unlabelled == total else f"{unlabelled} of its {total}"
        raise DataError(f"{key}: split {source.split!r} of {source.root!r} has no labels for "
                        f"{what} samples (label -1: the release's test split is unlabelled); "
                        f"train and evaluate on labelled splits (train, validation)")
    classes = len(source.classes) if source.classes else high + 1
    return {"num_samples": total, "num_classes": classes, "classes_exact": int(bool(source.classes)),
            "lengths": lengths}


def read_row_group(unit: Tuple[str, int]) -> Iterator[Dict[str, Any]]:
    """The rows of one row group as raw samples (the image bytes as 'jpg': PIL reads any
    format by its content)."""
    path, group = unit
    try:
        table = _pq().ParquetFile(path).read_row_group(group, columns=["image", "label"])
    except DataError:
        raise
    except Exception as e:  # pyarrow.lib.ArrowInvalid, OSError
        raise DataError(f"{path!r} cannot be read (row group {group}: {_why(e)}): its data pages "
                        f"are damaged (the start-up check reads its metadata, labels and image "
                        f"names), or it changed or its storage failed since the start; download "
                        f"it again") from None
    images, labels = table.column("image").to_pylist(), table.column("label").to_pylist()
    for i, (image, label) in enumerate(zip(images, labels)):
        image = image or {}
        yield {"__key__": image.get("path") or f"{group}:{i}", "__url__": path,
               "jpg": image.get("bytes") or b"", "cls": label}


def dataset(source: Source, transform: Callable, cfg: Any, training: bool, rank: int,
            world_size: int, batches: int,
            lengths: Optional[List[int]] = None) -> Tuple[SampleStream, None, int]:
    units, lengths = _units(source)
    b = cfg.batch_size
    ds = SampleStream(units, read_row_group, transform, rank=rank, world_size=world_size,
                      seed=cfg.seed, lengths=lengths, quota=batches * b if training else None,
                      batch_size=b, shuffle_buffer=cfg.data.shuffle_buffer if training else 0,
                      repeats=cfg.aug.repeated_aug if training else 1,
                      on_corrupt=cfg.data.on_corrupt)
    return ds, None, batches


def keys(source: Source) -> List[str]:
    """The ``image.path`` of every row (the original file names; only that field is read)."""
    pq = _pq()
    out: List[str] = []
    for path in source.shards:
        try:
            out += pq.read_table(path, columns=["image.path"]).column(0).to_pylist()
        except Exception as e:  # pyarrow.lib.ArrowInvalid, OSError: damaged pages
            raise DataError(f"{path!r} cannot be read (its image names, the column image.path: "
                            f"{_why(e)}): its data pages are damaged; download it again") from None
    return [k for k in out if k]
