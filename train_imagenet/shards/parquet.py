"""The Hugging Face Parquet release of ImageNet (``ILSVRC/imagenet-1k``) as a source.

``ROOT/data/{train,validation,test}-NNNNN-of-NNNNN.parquet`` with columns ``image``
(``{bytes, path}``) and ``label``; the class names are in the dataset card
(``ROOT/README.md``, ``dataset_info.features`` of ``label``); the test split's labels are
all -1. Files are read in place with pyarrow (the ``parquet`` extra): the listing reads the
``label`` and ``image.path`` columns only, and the writers read the image bytes of each row
group their shard needs, once per shard.
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from .plan import ConversionError

# our split name -> the file prefix of the release
SPLIT_FILES = {"train": "train", "val": "validation", "test": "test"}


def _pq():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConversionError("reading Parquet files needs pyarrow, which is not installed: "
                              "pip install 'dcvit[parquet]'") from None
    return pq


def parquet_files(root: Path) -> list[Path]:
    """The ``.parquet`` files of a release folder (``ROOT/data/`` or ``ROOT`` itself)."""
    folder = root / "data" if (root / "data").is_dir() else root
    return sorted(folder.glob("*.parquet"))


def split_files(root: Path, split: str) -> list[Path]:
    """The files of ``split`` (``val`` reads ``validation-*.parquet``)."""
    files = parquet_files(root)
    prefix = SPLIT_FILES.get(split, split)
    chosen = [f for f in files if f.name.startswith(prefix + "-")]
    if not chosen:
        have = sorted({f.name.split("-", 1)[0] for f in files})
        raise ConversionError(f"{root} has no {prefix}-*.parquet files for --split {split} "
                              f"(it has {have}); pass --split with one of {have}")
    return chosen


def card_class_names(root: Path) -> list[str] | None:
    """The class names of ``label`` in the dataset card's ``dataset_info``, or None."""
    card = root / "README.md"
    if not card.is_file():
        return None
    match = re.match(r"---\n(.*?)\n---", card.read_text(encoding="utf-8"), re.S)
    if not match:
        return None
    try:
        info = yaml.safe_load(match.group(1)).get("dataset_info", {})
    except (yaml.YAMLError, AttributeError) as e:
        raise ConversionError(f"{card}: its front matter is not valid YAML ({e}); pass --classes FILE") from None
    for features in ([info] if isinstance(info, dict) else info):
        for feature in features.get("features", []):
            names = feature.get("dtype", {}).get("class_label", {}).get("names") \
                if feature.get("name") == "label" and isinstance(feature.get("dtype"), dict) else None
            if isinstance(names, dict):
                return [str(names[k]) for k in sorted(names, key=int)]
            if isinstance(names, list):
                return [str(n) for n in names]
    return None


def parquet_members(files: list[Path]) -> list[tuple]:
    """(relative path, label, file, 0, (row group, row)) for every row of ``files``."""
    pq = _pq()
    found = []
    for path in files:
        try:
            pf = pq.ParquetFile(path)
            schema = pf.schema_arrow
            if "label" not in schema.names or "image" not in schema.names:
                raise ConversionError(f"{path} has columns {schema.names}; expected 'image' "
                                      "({bytes, path}) and 'label' (the Hugging Face ImageNet release)")
            for group in range(pf.num_row_groups):
                table = pf.read_row_group(group, columns=["label", "image.path"])
                labels = table.column("label").to_pylist()
                names = table.column("image").combine_chunks().field("path").to_pylist()
                for row, (label, name) in enumerate(zip(labels, names)):
                    rel = name or f"{path.stem}_{group}_{row}"
                    found.append((rel, label, str(path), 0, (group, row)))
        except ConversionError:
            raise
        except Exception as e:
            raise ConversionError(f"cannot read {path} as Parquet ({type(e).__name__}: {e})") from None
    unlabelled = sum(1 for f in found if f[1] is None or f[1] < 0)
    if unlabelled == len(found):
        raise ConversionError(f"{files[0].parent}: every label of {files[0].name.split('-')[0]} is -1 or "
                              "missing (the test split has no labels); convert the train or validation split")
    if unlabelled:
        raise ConversionError(f"{unlabelled} of {len(found)} rows of {files[0].parent} have no label (-1); "
                              "a split needs a label for every image")
    return found


def read_rows(path: str, group: int, rows: list[int]) -> dict[int, bytes]:
    """{row: image bytes} of ``rows`` in row group ``group`` of ``path``."""
    pq = _pq()
    try:
        images = pq.ParquetFile(path).read_row_group(group, columns=["image"]).column("image").combine_chunks()
        data = images.field("bytes").take(rows).to_pylist()
    except Exception as e:
        raise ConversionError(f"cannot read images of {path} (row group {group}: {type(e).__name__}: {e})") from None
    missing = [r for r, d in zip(rows, data) if d is None]
    if missing:
        raise ConversionError(f"{path}: row {missing[0]} of row group {group} holds no image bytes")
    return dict(zip(rows, data))
