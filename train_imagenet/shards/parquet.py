"""The rows of a Hugging Face Parquet release (``ILSVRC/imagenet-1k``) as samples to convert.

The split's files and the dataset card's class names are found as the trainer finds them
(`train_imagenet.data.parquet`). Files are read in place with pyarrow (the ``parquet``
extra): the listing reads the ``label`` and ``image.path`` columns only, and the writers
read the image bytes of each row group their shard needs, once per shard. A split whose
labels are all -1 (the test split) is refused.
"""
from __future__ import annotations

from pathlib import Path

from train_imagenet.data.parquet import EXTRA

from .plan import ConversionError


def _pq():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConversionError(f"reading Parquet files needs pyarrow, which is not installed: {EXTRA}") from None
    return pq


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
