"""The labels-file formats: class names (``classes.json``, one name a line), the names a
labels file's integers refer to (a devkit ``meta.mat``, or a names file), and the labels
of a flat image folder (``filename label`` rows, CSV with a header, ``LOC_val_solution.csv``,
one label a line in sorted filename order). Shared by the converter and the trainer.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from dcvit.cli import did_you_mean

from .source import DataError

__all__ = ["LabelsError", "read_class_names", "read_label_names", "read_labels", "parse_label"]


class LabelsError(DataError):
    """A labels or class-names file that cannot be used; the message names the file, the
    line and the fix."""


WNID = re.compile(r"n[0-9]{8}")


def read_class_names(path: Path) -> list[str]:
    """Class names in index order from a JSON list (``classes.json``), a text file with one
    name a line, or Kaggle's ``LOC_synset_mapping.txt`` (``n01440764 tench, Tinca tinca``:
    every line a WNID and its words; the WNID is the name)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise LabelsError(f"cannot read class names file {path}: {e.strerror}") from None
    if path.suffix == ".json":
        try:
            names = json.loads(text)
        except json.JSONDecodeError as e:
            raise LabelsError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); "
                                  "expected a list of class names") from None
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
        wnids = [name.split(None, 1)[0] for name in names]
        if names and all(WNID.fullmatch(w) for w in wnids):  # LOC_synset_mapping.txt
            names = wnids
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise LabelsError(f"{path}: expected a non-empty list of class names")
    dupes = [n for n, c in Counter(names).items() if c > 1]
    if dupes:
        raise LabelsError(f"{path}: class names repeat: {dupes[:5]}")
    return names


def read_label_names(path: Path) -> list[str]:
    """Names the integer labels of a labels file refer to, in their order.

    A devkit ``meta.mat`` (ILSVRC2012): the WNIDs of the 1000 leaf synsets ordered by
    ``ILSVRC2012_ID``, so 1-based ground truth ``k`` (``--label-offset 1``) names ``names[k - 1]``.
    Anything else: like ``--classes`` (JSON list or one name a line).
    """
    if path.suffix != ".mat":
        return read_class_names(path)
    try:
        from scipy.io import loadmat
    except ImportError:
        raise LabelsError(f"reading the ILSVRC devkit's {path.name} needs scipy, which is not installed: "
                          "pip install 'dcvit[devkit]'") from None
    try:
        synsets = loadmat(str(path), squeeze_me=True)["synsets"]
        leaves = sorted((int(s["ILSVRC2012_ID"]), str(s["WNID"])) for s in synsets if int(s["num_children"]) == 0)
    except Exception as e:
        raise LabelsError(f"cannot read ILSVRC devkit synsets from {path} ({type(e).__name__}: {e}); "
                              "expected ILSVRC2012_devkit_t12/data/meta.mat") from None
    return [wnid for _, wnid in leaves]


def parse_label(token: str, index: dict[str, int], offset: int, where: str,
                 names: list[str] | None = None) -> int:
    if re.fullmatch(r"[+-]?\d+", token):
        label = int(token) - offset
        span = len(index) if names is None else len(names)
        if not 0 <= label < span:
            raise LabelsError(
                f"{where}: label {token} gives index {label} (after --label-offset {offset}), "
                f"out of range [0, {span}); 1-based ILSVRC ground truth needs --label-offset 1")
        if names is None:
            return label
        token = names[label]
    if token in index:
        return index[token]
    raise LabelsError(f"{where}: class '{token}' is not in --classes{did_you_mean(token, index, n=1)}")


def read_labels(path: Path, images: list[Path], classes: list[str], offset: int,
                names: list[str] | None = None) -> list[int]:
    """Labels of ``images`` (sorted) from ``path``.

    Accepted line formats (blank lines and ``#`` comments skipped, ``,`` or whitespace separated):
      ``filename label``: label is a class index (minus ``offset``) or a class name; filename
        with or without its extension; extra columns (e.g. boxes in ``LOC_val_solution.csv``,
        whose label column is ``n01751748 x y x y ...``) are ignored; a CSV header is skipped;
      ``label``: one label per line in sorted filename order.
    Integer labels minus ``offset`` are class indices, or, with ``names``, positions in
    ``names`` whose entry is looked up in ``classes`` (ILSVRC2012_validation_ground_truth.txt:
    1-based devkit ids, ``offset=1`` and ``names`` from the devkit's meta.mat).
    """
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise LabelsError(f"cannot read labels file {path}: {getattr(e, 'strerror', None) or e}") from None
    rows = [(n, re.split(r"[\s,]+", line.strip())) for n, line in enumerate(lines, 1)
            if line.strip() and not line.lstrip().startswith("#")]
    if not rows:
        raise LabelsError(f"labels file {path} holds no labels")
    index = {name: i for i, name in enumerate(classes)}
    if all(len(cols) == 1 for _, cols in rows):
        if len(rows) != len(images):
            raise LabelsError(f"{path} has {len(rows)} labels, one a line, for {len(images)} images; "
                                  "a one-column labels file needs one line per image in sorted filename order")
        return [parse_label(cols[0], index, offset, f"{path}:{n}", names) for n, cols in rows]
    if rows[0][1][0].lower() in ("imageid", "image", "filename", "file", "name", "id"):
        rows = rows[1:]  # CSV header, e.g. "ImageId,PredictionString"
    by_name: dict[str, tuple[str, str]] = {}
    for n, cols in rows:
        if len(cols) < 2:
            raise LabelsError(f"{path}:{n}: expected 'filename label', got {lines[n - 1]!r}")
        by_name[cols[0]] = (cols[1], f"{path}:{n}")
    labels, missing = [], []
    for image in images:
        entry = by_name.get(image.name) or by_name.get(image.stem)
        if entry is None:
            missing.append(image.name)
            continue
        labels.append(parse_label(entry[0], index, offset, entry[1], names))
    if missing:
        raise LabelsError(f"{path} has no label for {len(missing)} image(s), e.g. {missing[:3]}")
    return labels
