#!/usr/bin/env python
"""Convert an image classification folder into WebDataset shards, and verify shards.

Two source layouts:

* class folders (torchvision ``ImageFolder``): ``SRC/<class_name>/**/<image>``; class index =
  position of the folder name in the sorted list of folder names (torchvision's convention);
* flat folder (the ImageNet val layout): ``SRC/<image>`` plus ``--labels FILE`` and
  ``--classes`` (train's ``classes.json``) so train and val share one index.

Output, for ``--split train``::

    DIR/train-000000.tar, DIR/train-000001.tar, ...   samples <key>.jpg|png + <key>.cls
    DIR/train.json      {"num_samples", "num_classes", "shards", "samples_per_shard", ...}
    DIR/classes.json    class names in index order

JPEG and PNG files are stored byte for byte (the extension follows the content, so ``.JPEG``
becomes ``.jpg``); other formats are re-encoded to PNG (or rejected with
``--other-formats error``). The shard plan (which sample goes into which shard, in which
order) is made in the parent process from the sorted file list and ``--seed``, so the shards
are byte-identical whatever ``--workers`` is. Each shard is written under a hidden temporary
name and renamed when complete.

Examples::

    python scripts/make_wds_shards.py --src imagenet/train --out shards --split train --workers 16
    python scripts/make_wds_shards.py --src imagenet/val --out shards --split val \\
        --labels LOC_val_solution.csv --classes shards/classes.json
    python scripts/make_wds_shards.py --verify shards
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import io
import json
import multiprocessing as mp
import os
import random
import re
import sys
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from dcvit.io import write_json
from dcvit.schema import CLASSES_FILE, IMAGE_EXTENSIONS, LABEL_EXTENSION, ShardMeta, check_split, shard_name

# Files with other suffixes are not images and are ignored (dcvit.schema: torchvision's list).
IMG_EXTENSIONS = tuple("." + ext for ext in IMAGE_EXTENSIONS)
TAR_BLOCK = 512
TAR_RECORD = 20 * TAR_BLOCK
MAX_KEY_CHARS = 90  # ustar names hold 100 characters; leave room for ".jpg"
SHARD_MTIME = 0  # fixed integer mtime: identical shard bytes, and no PAX header per member


class ConversionError(Exception):
    """A bad input or option; the message names the value and the fix."""


@dataclass(frozen=True)
class Sample:
    path: str   # absolute source file
    key: str    # WebDataset key: unique, no dots or slashes
    label: int  # class index
    size: int   # source bytes (for --max-shard-bytes planning)


# ----------------------------------------------------------------------------- source scan
def _is_image(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS) and not name.startswith(".")


def _images_below(folder: Path) -> list[Path]:
    """Image files under ``folder`` (recursively, symlinks followed, hidden skipped), sorted."""
    found = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(Path(root) / f for f in files if _is_image(f))
    return sorted(found)


def read_class_names(path: Path) -> list[str]:
    """Class names in index order from a JSON list (``classes.json``) or a text file, one a line."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConversionError(f"cannot read class names file {path}: {e.strerror}") from None
    if path.suffix == ".json":
        try:
            names = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConversionError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); "
                                  "expected a list of class names") from None
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ConversionError(f"{path}: expected a non-empty list of class names")
    dupes = [n for n, c in Counter(names).items() if c > 1]
    if dupes:
        raise ConversionError(f"{path}: class names repeat: {dupes[:5]}")
    return names


def _check_source(src: Path) -> None:
    if not src.exists():
        raise ConversionError(f"source folder {src} does not exist; pass --src IMAGEFOLDER_ROOT")
    if not src.is_dir():
        raise ConversionError(f"--src {src} is a file; pass the folder that holds the images")
    if not any(p for p in src.iterdir() if not p.name.startswith(".")):
        raise ConversionError(f"source folder {src} is empty")


def scan_class_folders(src: Path, classes: list[str] | None) -> tuple[list[str], list[tuple[Path, int]]]:
    """(class names, [(file, label)]) for ``SRC/<class>/**/<image>``."""
    folders = sorted(p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith("."))
    loose = [p.name for p in src.iterdir() if p.is_file() and _is_image(p.name)]
    if not folders:
        hint = (f" ({len(loose)} images lie directly in it: for the flat ImageNet val layout "
                "pass --labels FILE and --classes classes.json)") if loose else ""
        raise ConversionError(f"no class folders in {src}{hint}; expected SRC/<class_name>/<image>")
    if loose:
        _warn(f"ignoring {len(loose)} images directly in {src} (not in a class folder)")
    if classes is None:
        classes = folders
    else:
        unknown = [f for f in folders if f not in set(classes)]
        if unknown:
            raise ConversionError(f"class folder(s) {unknown[:5]} of {src} are not in --classes "
                                  f"({len(classes)} names); use the classes.json of the same dataset")
    index = {name: i for i, name in enumerate(classes)}
    items: list[tuple[Path, int]] = []
    for name in folders:
        files = _images_below(src / name)
        if not files:
            _warn(f"class folder {src / name} holds no images (extensions {', '.join(IMG_EXTENSIONS)})")
        items.extend((f, index[name]) for f in files)
    if not items:
        raise ConversionError(f"no images found under {src} (looked for {', '.join(IMG_EXTENSIONS)})")
    return classes, items


def read_label_names(path: Path) -> list[str]:
    """Names the integer labels of a labels file refer to, in their order.

    A devkit ``meta.mat`` (ILSVRC2012): the WNIDs of the 1000 leaf synsets ordered by
    ``ILSVRC2012_ID``, so 1-based ground truth ``k`` (``--label-offset 1``) names ``names[k - 1]``.
    Anything else: like ``--classes`` (JSON list or one name a line).
    """
    if path.suffix != ".mat":
        return read_class_names(path)
    from scipy.io import loadmat
    try:
        synsets = loadmat(str(path), squeeze_me=True)["synsets"]
        leaves = sorted((int(s["ILSVRC2012_ID"]), str(s["WNID"])) for s in synsets if int(s["num_children"]) == 0)
    except Exception as e:
        raise ConversionError(f"cannot read ILSVRC devkit synsets from {path} ({type(e).__name__}: {e}); "
                              "expected ILSVRC2012_devkit_t12/data/meta.mat") from None
    return [wnid for _, wnid in leaves]


def _parse_label(token: str, index: dict[str, int], offset: int, where: str,
                 names: list[str] | None = None) -> int:
    if re.fullmatch(r"[+-]?\d+", token):
        label = int(token) - offset
        span = len(index) if names is None else len(names)
        if not 0 <= label < span:
            raise ConversionError(
                f"{where}: label {token} gives index {label} (after --label-offset {offset}), "
                f"out of range [0, {span}); 1-based ILSVRC ground truth needs --label-offset 1")
        if names is None:
            return label
        token = names[label]
    if token in index:
        return index[token]
    close = difflib.get_close_matches(token, list(index), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ConversionError(f"{where}: class '{token}' is not in --classes{hint}")


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
        raise ConversionError(f"cannot read labels file {path}: {getattr(e, 'strerror', None) or e}") from None
    rows = [(n, re.split(r"[\s,]+", line.strip())) for n, line in enumerate(lines, 1)
            if line.strip() and not line.lstrip().startswith("#")]
    if not rows:
        raise ConversionError(f"labels file {path} holds no labels")
    index = {name: i for i, name in enumerate(classes)}
    if all(len(cols) == 1 for _, cols in rows):
        if len(rows) != len(images):
            raise ConversionError(f"{path} has {len(rows)} labels, one a line, for {len(images)} images; "
                                  "a one-column labels file needs one line per image in sorted filename order")
        return [_parse_label(cols[0], index, offset, f"{path}:{n}", names) for n, cols in rows]
    if rows[0][1][0].lower() in ("imageid", "image", "filename", "file", "name", "id"):
        rows = rows[1:]  # CSV header, e.g. "ImageId,PredictionString"
    by_name: dict[str, tuple[str, str]] = {}
    for n, cols in rows:
        if len(cols) < 2:
            raise ConversionError(f"{path}:{n}: expected 'filename label', got {lines[n - 1]!r}")
        by_name[cols[0]] = (cols[1], f"{path}:{n}")
    labels, missing = [], []
    for image in images:
        entry = by_name.get(image.name) or by_name.get(image.stem)
        if entry is None:
            missing.append(image.name)
            continue
        labels.append(_parse_label(entry[0], index, offset, entry[1], names))
    if missing:
        raise ConversionError(f"{path} has no label for {len(missing)} image(s), e.g. {missing[:3]}")
    return labels


def scan_flat(src: Path, labels_file: Path, classes: list[str], offset: int,
              names: list[str] | None = None) -> list[tuple[Path, int]]:
    images = sorted(p for p in src.iterdir() if p.is_file() and _is_image(p.name))
    if not images:
        raise ConversionError(f"no images found directly in {src} for the flat layout of --labels "
                              f"(looked for {', '.join(IMG_EXTENSIONS)})")
    return list(zip(images, read_labels(labels_file, images, classes, offset, names)))


def make_keys(relpaths: Sequence[str]) -> list[str]:
    """Unique, tar-safe WebDataset keys from relative paths: ``cls/img.JPEG`` -> ``cls__img``.

    WebDataset splits a member name at the first dot of its last component, so keys carry no
    dots or slashes; other odd characters become ``_``; a collision gets ``-1``, ``-2``, ...
    """
    keys, seen = [], set()
    for rel in relpaths:
        stem = rel.rsplit(".", 1)[0] if "." in Path(rel).name else rel
        key = re.sub(r"[^A-Za-z0-9_-]", "_", stem.replace("/", "__")).lstrip("_-") or "sample"
        if len(key) > MAX_KEY_CHARS:
            key = key[:MAX_KEY_CHARS - 9] + "-" + hashlib.sha1(rel.encode()).hexdigest()[:8]
        base, n = key, 0
        while key in seen:
            n += 1
            key = f"{base}-{n}"
        seen.add(key)
        keys.append(key)
    return keys


# ----------------------------------------------------------------------------- shard plan
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


# ----------------------------------------------------------------------------- writing
def _sniff(head: bytes) -> str | None:
    if head.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    return None


def encode_image(path: str, other_formats: str) -> tuple[str, bytes, bool]:
    """(extension, bytes, re-encoded?): JPEG/PNG bytes unchanged, other images as PNG."""
    data = Path(path).read_bytes()
    ext = _sniff(data[:8])
    if ext is not None:
        return ext, data, False
    if other_formats == "error":
        raise ConversionError(f"{path} is neither JPEG nor PNG; convert it or pass --other-formats png")
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            if im.mode not in ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"):
                im = im.convert("RGB")  # e.g. CMYK: PNG cannot hold it
            buf = io.BytesIO()
            im.save(buf, format="PNG")
    except Exception as e:
        raise ConversionError(f"cannot read image {path}: {e}") from None
    return "png", buf.getvalue(), True


def write_shard(task: tuple[str, str, int, list[Sample], str, str]) -> tuple[int, int, int, int]:
    """Write one shard under a temporary name, then rename. Returns (index, samples, bytes, re-encoded).

    Not `dcvit.io.atomic_write`: the shard is fsynced before the rename, and its temporary
    name ``.{shard}.tmp-{token}`` carries the run's token, so that `convert` can delete the
    leftovers of a killed run (``.{split}-*.tar.tmp-*``) and of its own stopped workers.
    """
    from webdataset import TarWriter

    out, split, index, samples, other_formats, token = task
    final = Path(out) / shard_name(split, index)
    tmp = Path(out) / f".{final.name}.tmp-{token}"
    reencoded = 0
    try:
        with open(tmp, "wb") as f:
            with TarWriter(f, encoder=False, mtime=SHARD_MTIME) as sink:
                for s in samples:
                    ext, data, converted = encode_image(s.path, other_formats)
                    reencoded += converted
                    sink.write({"__key__": s.key, ext: data, "cls": str(s.label).encode("ascii")})
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return index, len(samples), final.stat().st_size, reencoded


def _pool(workers: int):
    import webdataset  # noqa: F401  (slow import, torch included: once here, inherited by forked workers)

    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else None).Pool(workers)


def _run_tasks(fn, tasks: list, workers: int) -> Iterable:
    """Results of ``fn`` over ``tasks`` as they complete (in-process when ``workers == 1``)."""
    if workers <= 1 or len(tasks) <= 1:
        yield from map(fn, tasks)
        return
    with _pool(min(workers, len(tasks))) as pool:
        yield from pool.imap_unordered(fn, tasks)


def brace_pattern(out: Path, split: str, num_shards: int) -> str:
    if num_shards == 1:
        return str(out / shard_name(split, 0))
    return str(out / f"{split}-{{{0:06d}..{num_shards - 1:06d}}}.tar")


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def convert(args: argparse.Namespace) -> dict:
    src, out, split = Path(args.src), Path(args.out), args.split
    _check_source(src)
    classes = read_class_names(Path(args.classes)) if args.classes else None
    if args.label_names and not args.labels:
        raise ConversionError("--label-names only applies to the labels of --labels FILE")
    if args.labels:
        if classes is None:
            raise ConversionError("the flat layout (--labels) needs --classes: pass the classes.json "
                                  "written for the train split so both splits share class indices")
        names = read_label_names(Path(args.label_names)) if args.label_names else None
        items = scan_flat(src, Path(args.labels), classes, args.label_offset, names)
    else:
        if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
            raise ConversionError(f"--out {out} lies inside --src {src}, where it would be read as a class "
                                  "folder; write the shards outside the image tree")
        classes, items = scan_class_folders(src, classes)
    keys = make_keys([p.relative_to(src).as_posix() for p, _ in items])
    samples = [Sample(str(p.resolve()), k, label, p.stat().st_size) for (p, label), k in zip(items, keys)]
    shuffle = split == "train" if args.shuffle is None else args.shuffle
    if shuffle:
        random.Random(args.seed).shuffle(samples)
    plan = plan_shards(samples, args.shard_size, args.max_shard_bytes)

    out.mkdir(parents=True, exist_ok=True)
    classes_path = out / CLASSES_FILE
    if classes_path.exists():
        try:
            old = json.loads(classes_path.read_text())
        except json.JSONDecodeError:
            old = None
        others = [p.stem for p in out.glob("*.json") if p.stem not in (split, "classes")]
        if old != classes and others:
            raise ConversionError(
                f"{classes_path} lists other classes than {src} (used by split(s) {others}); "
                f"pass --classes {classes_path} to reuse them, or write to another --out")
    # Leftovers of an interrupted run and the old metadata go first: until the new metadata
    # is written, the split reads as incomplete rather than as a mix of old and new shards.
    for stale in out.glob(f".{split}-*.tar.tmp-*"):
        stale.unlink()
    (out / f"{split}.json").unlink(missing_ok=True)

    token = uuid.uuid4().hex[:8]
    tasks = [(str(out), split, i, group, args.other_formats, token) for i, group in enumerate(plan)]
    counts, sizes, reencoded = [0] * len(plan), [0] * len(plan), 0
    from tqdm import tqdm
    try:
        with tqdm(total=len(samples), unit="img", desc=f"{split} -> {out}", disable=not args.progress,
                  mininterval=1.0) as bar:
            for index, n, nbytes, conv in _run_tasks(write_shard, tasks, args.workers):
                counts[index], sizes[index], reencoded = n, nbytes, reencoded + conv
                bar.update(n)
    except BaseException:
        for tmp in out.glob(f".{split}-*.tar.tmp-{token}"):  # workers stopped mid-shard
            tmp.unlink(missing_ok=True)
        raise
    names = [shard_name(split, i) for i in range(len(plan))]
    for old_shard in out.glob(f"{split}-*.tar"):
        if old_shard.name not in names:
            old_shard.unlink()  # from an earlier run with more shards
    meta = ShardMeta(
        num_samples=len(samples), num_classes=len(classes), shards=names,
        samples_per_shard=counts, shard_bytes=sizes, split=split,
        pattern=brace_pattern(Path("."), split, len(plan)), classes=CLASSES_FILE,
        shuffled=shuffle, seed=args.seed if shuffle else None, reencoded_to_png=reencoded,
    ).to_dict()
    write_json(classes_path, classes)
    write_json(out / f"{split}.json", meta)
    seen = len({s.label for s in samples})
    print(f"{split}: {len(samples)} samples of {seen}/{len(classes)} classes in {len(plan)} shards "
          f"({sum(sizes) / 2**20:.1f} MiB); {reencoded} re-encoded to PNG")
    print(f"{split} shards: {brace_pattern(out, split, len(plan))}")
    return meta


# ----------------------------------------------------------------------------- verification
def verify_shard(task: tuple[str, int]) -> dict:
    """Read one shard with webdataset: count samples and labels, decode every image."""
    import webdataset as wds
    from PIL import Image

    path, num_classes = task
    name = Path(path).name
    result = {"shard": name, "count": 0, "labels": Counter(), "keys": [], "problems": []}
    problems = result["problems"]
    last = None
    try:
        for sample in wds.WebDataset(path, shardshuffle=False, empty_check=False):
            key = last = sample["__key__"]
            result["count"] += 1
            result["keys"].append(key)
            exts = sorted(k for k in sample if not k.startswith("__"))
            images = [e for e in exts if e in IMAGE_EXTENSIONS]
            if len(images) != 1 or LABEL_EXTENSION not in exts or len(exts) != 2:
                problems.append(f"{name}: key '{key}' holds {exts}; expected one image "
                                f"({'/'.join(IMAGE_EXTENSIONS)}) and {LABEL_EXTENSION}")
                continue
            try:
                label = int(sample["cls"].decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                problems.append(f"{name}: key '{key}': cls {sample['cls'][:20]!r} is not an integer")
                continue
            if not 0 <= label < num_classes:
                problems.append(f"{name}: key '{key}': label {label} out of range [0, {num_classes})")
            result["labels"][label] += 1
            try:
                with Image.open(io.BytesIO(sample[images[0]])) as im:
                    im.load()
            except Exception as e:
                problems.append(f"{name}: key '{key}': {images[0]} does not decode ({type(e).__name__}: {e})")
    except Exception as e:
        where = f"after key '{last}'" if last else "at the start"
        problems.append(f"{name}: unreadable {where} ({type(e).__name__}: {e})")
    return result


def verify(out: Path, splits: Sequence[str] | None, workers: int, progress: bool = True) -> list[str]:
    """Problems found in the shards of ``out`` (every split with metadata unless ``splits``),
    printed; a missing folder is a ConversionError (bad input, exit status 2)."""
    if not out.is_dir():
        raise ConversionError(f"--verify {out}: no such folder; give the --out folder of the shards")
    if splits is None:
        splits = sorted(p.stem for p in out.glob("*.json") if p.stem != "classes")
        if not splits:  # empty, or a conversion stopped before writing its metadata
            problem = (f"no split metadata (<split>.json) in {out}: write shards with --src/--out "
                       f"first (an interrupted conversion leaves none: re-run it)")
            print(f"verify: {problem}", file=sys.stderr)
            return [problem]
    problems: list[str] = []
    classes = None
    if (out / CLASSES_FILE).exists():
        try:
            classes = read_class_names(out / CLASSES_FILE)
        except ConversionError as e:
            problems.append(str(e))
    from tqdm import tqdm
    for split in splits:
        meta_path = out / f"{split}.json"
        try:
            meta = json.loads(meta_path.read_text())
            shards, per_shard = meta["shards"], meta["samples_per_shard"]
            num_samples, num_classes = int(meta["num_samples"]), int(meta["num_classes"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{meta_path}: missing or incomplete metadata ({type(e).__name__}: {e}); "
                            "an interrupted conversion leaves none: re-run it")
            continue
        split_problems = []
        if classes is not None and len(classes) != num_classes:
            split_problems.append(f"{meta_path}: num_classes {num_classes} but classes.json lists {len(classes)}")
        if len(per_shard) != len(shards):
            split_problems.append(f"{meta_path}: {len(shards)} shards but {len(per_shard)} samples_per_shard entries")
        present = [s for s in shards if (out / s).is_file()]
        split_problems += [f"{split}: shard {s} listed in {meta_path.name} is missing" for s in shards
                           if s not in present]
        extra = sorted(p.name for p in out.glob(f"{split}-*.tar") if p.name not in shards)
        if extra:
            split_problems.append(f"{split}: shard(s) {extra[:5]} are not listed in {meta_path.name}")
        expected = dict(zip(shards, per_shard))
        labels, keys, total = Counter(), Counter(), 0
        tasks = [(str(out / s), num_classes) for s in present]
        with tqdm(total=len(tasks), unit="shard", desc=f"verify {split}", disable=not progress) as bar:
            for r in _run_tasks(verify_shard, tasks, workers):
                bar.update(1)
                total += r["count"]
                labels.update(r["labels"])
                keys.update(r["keys"])
                split_problems += r["problems"]
                if r["count"] != expected.get(r["shard"]):
                    split_problems.append(f"{split}: shard {r['shard']} holds {r['count']} samples, "
                                          f"metadata says {expected.get(r['shard'])}")
        if total != num_samples:
            split_problems.append(f"{split}: read {total} samples, metadata says num_samples={num_samples}")
        dupes = [k for k, c in keys.items() if c > 1]
        if dupes:
            split_problems.append(f"{split}: {len(dupes)} key(s) repeat, e.g. {dupes[:3]}")
        status = "OK" if not split_problems else f"{len(split_problems)} problem(s)"
        print(f"verify {split}: {len(present)}/{len(shards)} shards, {total} samples, "
              f"{len(labels)}/{num_classes} classes present: {status}")
        problems += split_problems
    for p in problems:
        print(f"  {p}", file=sys.stderr)
    return problems


# ----------------------------------------------------------------------------- command line
def _positive(text: str) -> int:
    value = int(float(text)) if re.fullmatch(r"\d+(\.\d+)?(e\d+)?", text) else -1
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See docs/data.md for the ImageNet recipe.")
    p.add_argument("--src", help="ImageFolder root (SRC/<class>/<image>) or flat folder with --labels")
    p.add_argument("--out", help="output folder for <split>-NNNNNN.tar, <split>.json, classes.json")
    p.add_argument("--split", default=None, help="shard name prefix (default: train)")
    p.add_argument("--shard-size", type=_positive, default=1000, help="max samples per shard (default 1000)")
    p.add_argument("--max-shard-bytes", type=_positive, default=None,
                   help="also close a shard before it exceeds this many bytes, e.g. 1e9")
    p.add_argument("--workers", type=_positive, default=max(1, min(8, os.cpu_count() or 1)),
                   help="processes writing (and verifying) shards in parallel")
    p.add_argument("--labels", help="labels file for the flat layout: 'filename label' lines, or "
                                    "one label a line in sorted filename order")
    p.add_argument("--label-offset", type=int, default=0,
                   help="subtracted from integer labels: 1 for 1-based files (ILSVRC ground truth)")
    p.add_argument("--label-names", help="what integer labels of --labels refer to: names in order "
                                         "(JSON list or one a line) or the ILSVRC devkit meta.mat")
    p.add_argument("--classes", help="class names in index order (classes.json or one a line); "
                                     "required with --labels; reuses train's indices")
    p.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=None,
                   help="shuffle samples across shards (default: on for the train split only)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    p.add_argument("--other-formats", choices=("png", "error"), default="png",
                   help="non-JPEG/PNG images: re-encode to PNG (default) or stop with an error")
    p.add_argument("--verify", nargs="?", const=True, default=None, metavar="DIR",
                   help="check shards: alone with DIR, or after writing when given without DIR")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 success, 1 verification found problems, 2 bad input or options."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # No '-': readers find DIR/<split>.json from the text before the first '-' of a shard name.
    if args.split is not None and check_split(args.split):
        parser.error(f"--split {check_split(args.split)}")
    try:
        if args.src is None and args.out is None:
            if not isinstance(args.verify, str):
                parser.error("pass --src SRC --out DIR to write shards, or --verify DIR to check them")
            splits = [args.split] if args.split else None
            return 1 if verify(Path(args.verify), splits, args.workers, args.progress) else 0
        if args.src is None or args.out is None:
            parser.error("writing shards needs both --src and --out")
        if isinstance(args.verify, str) and Path(args.verify).resolve() != Path(args.out).resolve():
            parser.error(f"--verify {args.verify} differs from --out {args.out}; "
                         "use --verify alone to check what was just written")
        args.split = args.split or "train"
        convert(args)
        if args.verify:
            return 1 if verify(Path(args.out), [args.split], args.workers, args.progress) else 0
        return 0
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
