#!/usr/bin/env python
"""Convert an image classification folder into WebDataset shards, and verify shards.

Two source layouts:

* class folders (torchvision ``ImageFolder``): ``SRC/<class_name>/**/<image>``; class index =
  position of the folder name in the sorted list of folder names (torchvision's convention);
  links are followed, but a link that would read a folder or file twice (a loop, a link into
  another class folder) or leads nowhere is refused, so each file is read once, labelled by
  the class folder it is listed in;
* flat folder (the ImageNet val layout): ``SRC/<image>`` plus ``--labels FILE`` and
  ``--classes`` (train's ``classes.json``) so train and val share one index.

Without ``--split`` the split comes from the name of ``--src`` (``val``, ``validation`` ->
val; ``test`` -> test; otherwise train). Output, for ``--split train``::

    DIR/train-000000.tar, DIR/train-000001.tar, ...   samples <key>.jpg|png + <key>.cls
    DIR/train.json      {"num_samples", "num_classes", "shards", "samples_per_shard", ...}
    DIR/classes.json    class names in index order

JPEG and PNG files are stored byte for byte (the extension follows the content, so ``.JPEG``
becomes ``.jpg``); other formats are re-encoded to PNG (or rejected with
``--other-formats error``). The shard plan (which sample goes into which shard, in which
order) is made in the parent process from the sorted file list and ``--seed``, so the shards
are byte-identical whatever ``--workers`` is. The conversion holds ``DIR/.lock`` (one
conversion per folder), writes the shards into a hidden staging folder and moves them in
only when all are written, metadata last: an interrupted or failed run leaves the previous
split as it was. A split made from another source folder is replaced only with
``--overwrite``. ``--verify`` checks each shard with the trainer's verifier
(`train_imagenet.data.verify.scan_shard`), decoding every image, and each split against its
metadata.

Examples::

    python scripts/make_wds_shards.py --src imagenet/train --out shards --split train --workers 16
    python scripts/make_wds_shards.py --src imagenet/val --out shards --split val \\
        --labels LOC_val_solution.csv --classes shards/classes.json
    python scripts/make_wds_shards.py --verify shards
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import sys
import threading
import uuid
from collections import Counter
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from dcvit.io import write_json
from dcvit.schema import (CLASSES_FILE, LABEL_EXTENSION, ShardMeta, check_split,
                          shard_name, split_names)
from train_imagenet.images import IMAGE_SUFFIXES, FolderError, ImageWalk, is_image_name, refuse
from train_imagenet.run_lock import RunDirError, RunLock
from train_imagenet.data.labels import LabelsError, read_class_names, read_label_names, read_labels
from train_imagenet.data.verify import scan_shard

# Files with other suffixes are not images and are ignored (dcvit.schema: torchvision's list).
IMG_EXTENSIONS = IMAGE_SUFFIXES
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
def _refuse_links(src: Path, problems: list[str]) -> None:
    try:
        refuse(src, problems, "--src")
    except FolderError as e:
        raise ConversionError(str(e)) from None


def _check_source(src: Path) -> None:
    if not src.exists():
        raise ConversionError(f"source folder {src} does not exist; pass --src IMAGEFOLDER_ROOT")
    if not src.is_dir():
        raise ConversionError(f"--src {src} is a file; pass the folder that holds the images")
    if not any(p for p in src.iterdir() if not p.name.startswith(".")):
        raise ConversionError(f"source folder {src} is empty")


def scan_class_folders(src: Path, classes: list[str] | None) -> tuple[list[str], list[tuple[Path, str, int]]]:
    """(class names, [(file, real path, label)]) for ``SRC/<class>/**/<image>``: the label is
    the class folder the file is listed in, and each real file is read once (`train_imagenet.images.ImageWalk`)."""
    folders = sorted(p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith("."))
    loose = [p.name for p in src.iterdir() if p.is_file() and is_image_name(p.name)]
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
    walk = ImageWalk()   # train_imagenet.images: the one rule for links, shared with the predictor
    walk.claim(src)
    walk.problems.extend(f"{p} -> {os.readlink(p)}: the link's target does not exist"
                         for p in sorted(src.iterdir())
                         if p.is_symlink() and not p.exists() and not p.name.startswith("."))
    for name in folders:  # every class folder is claimed before any is read
        walk.claim(src / name)
    items: list[tuple[Path, str, int]] = []
    for name in folders:
        files = walk.files(src / name)
        if not files and not walk.problems:
            _warn(f"class folder {src / name} holds no images (extensions {', '.join(IMG_EXTENSIONS)})")
        items.extend((path, real, index[name]) for path, real in files)
    walk.forget(src)  # its loose images are not read
    _refuse_links(src, walk.all_problems())
    if not items:
        raise ConversionError(f"no images found under {src} (looked for {', '.join(IMG_EXTENSIONS)})")
    return classes, items


def scan_flat(src: Path, labels_file: Path, classes: list[str], offset: int,
              names: list[str] | None = None) -> list[tuple[Path, str, int]]:
    """[(file, real path, label)] for the images directly in ``src``, labelled by ``labels_file``."""
    _refuse_links(src, [f"{p} -> {os.readlink(p)}: the link's target does not exist"
                        for p in sorted(src.iterdir()) if p.is_symlink() and not p.exists()])
    images = sorted(p for p in src.iterdir() if p.is_file() and is_image_name(p.name))
    if not images:
        raise ConversionError(f"no images found directly in {src} for the flat layout of --labels "
                              f"(looked for {', '.join(IMG_EXTENSIONS)})")
    labels = read_labels(labels_file, images, classes, offset, names)
    return [(p, os.path.realpath(p), label) for p, label in zip(images, labels)]


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
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConversionError(f"cannot read {path} ({e.strerror or e}); make it readable or move "
                              f"it out of --src, then re-run") from None
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


def write_shard(task: tuple[str, str, int, list[Sample], str]) -> tuple[int, int, int, int]:
    """Write one shard into the run's staging folder. Returns (index, samples, bytes, re-encoded).

    The staging folder (``DIR/.{split}.tmp-{token}``) is private to the run, so a shard is
    written under its final name there and fsynced; `convert` moves the finished shards into
    ``DIR`` together, or removes the folder.
    """
    from webdataset import TarWriter

    stage, split, index, samples, other_formats = task
    path = Path(stage) / shard_name(split, index)
    reencoded = 0
    with open(path, "wb") as f:
        with TarWriter(f, encoder=False, mtime=SHARD_MTIME) as sink:
            for s in samples:
                ext, data, converted = encode_image(s.path, other_formats)
                reencoded += converted
                sink.write({"__key__": s.key, ext: data, LABEL_EXTENSION: str(s.label).encode("ascii")})
        f.flush()
        os.fsync(f.fileno())
    return index, len(samples), path.stat().st_size, reencoded


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the workers too: the parent acts


def _pool(workers: int):
    import webdataset  # noqa: F401  (slow import, torch included: once here, inherited by forked workers)

    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else None).Pool(workers, initializer=_ignore_sigint)


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


# Folder names that say which split a source holds (a word of the name: ILSVRC2012_img_val).
SPLIT_WORDS = {"train": "train", "training": "train", "val": "val", "valid": "val",
               "validation": "val", "test": "test", "testing": "test"}


def infer_split(src: Path) -> str | None:
    """The split ``src``'s folder name says (``val``, ``ILSVRC2012_img_val`` -> val), or None."""
    words = re.split(r"[^a-z0-9]+", src.resolve().name.lower())
    found = {SPLIT_WORDS[w] for w in words if w in SPLIT_WORDS}
    if len(found) > 1:
        raise ConversionError(f"the name of --src {src} says {sorted(found)}; pass --split NAME")
    return found.pop() if found else None


def _lock(out: Path) -> RunLock:
    """The output folder's lock (the trainer's `RunLock`): one conversion per folder at a time."""
    if out.exists() and not out.is_dir():
        raise ConversionError(f"--out {out} is a file; give a folder for the shards")
    lock = RunLock(str(out))
    try:
        out.mkdir(parents=True, exist_ok=True)
        return lock.acquire()
    except RunDirError:
        raise ConversionError(f"--out {out} is in use by another conversion ({lock.holder()}); "
                              "wait for it to end, or write to another --out") from None
    except OSError as e:
        raise ConversionError(f"--out {out} cannot be written ({e.strerror or e}); "
                              "give a writable folder") from None


def _check_replace(out: Path, split: str, source: str, classes: list[str], overwrite: bool) -> None:
    """Refuses to replace a split made from another source (unless ``overwrite``), or to
    change the classes another split of ``out`` uses."""
    meta_path = out / f"{split}.json"
    if meta_path.exists() and not overwrite:
        try:
            old = json.loads(meta_path.read_text())
            old_source, old_count = old.get("source"), old.get("num_samples")
        except (OSError, ValueError, AttributeError):
            old_source, old_count = None, "?"
        if old_source != source:
            made = f"from {old_source}" if old_source else "from a source it does not record"
            raise ConversionError(
                f"{out} already holds a {split} split ({old_count} samples) made {made}; --src "
                f"{source} would replace it: pass --split NAME to write another split, another "
                f"--out, or --overwrite to replace it")
    orphans = sorted(p.name for p in out.glob(f"{split}-*.tar"))
    if orphans and not meta_path.exists() and not overwrite:
        raise ConversionError(
            f"{out} holds {len(orphans)} {split} shard(s) ({orphans[0]}, ...) without {meta_path.name} "
            "(written by another tool, or a conversion killed while moving its shards in); "
            "pass --overwrite to replace them")
    classes_path = out / CLASSES_FILE
    others = [n for n in split_names(str(out)) if n != split]
    if classes_path.exists() and others:
        try:
            old_classes = json.loads(classes_path.read_text())
        except (OSError, ValueError):
            old_classes = None
        if old_classes != classes:
            raise ConversionError(
                f"{classes_path} lists other classes than {source} (used by split(s) {others}); "
                f"pass --classes {classes_path} to reuse them, or write to another --out")


@contextmanager
def _signals_deferred():
    """Ctrl-C and SIGTERM received inside the block take effect when it ends (in the main
    thread, where Python runs signal handlers; elsewhere the block is unprotected)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {s: signal.signal(s, lambda num, frame: received.append(num))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if received:
            signal.raise_signal(received[0])


def _commit(out: Path, stage: Path, split: str, names: list[str], classes: list[str], meta: dict) -> None:
    """Moves the staged shards in, removes the split's other shards, writes the metadata last.

    Ctrl-C and SIGTERM wait until this is done (a few renames), so an interrupted run leaves
    either the previous split or the new one, never a mix of both."""
    with _signals_deferred():
        (out / f"{split}.json").unlink(missing_ok=True)
        for name in names:
            os.replace(stage / name, out / name)
        for old_shard in out.glob(f"{split}-*.tar"):
            if old_shard.name not in names:
                old_shard.unlink()  # from an earlier run with more shards
        write_json(out / CLASSES_FILE, classes)
        write_json(out / f"{split}.json", meta)
        stage.rmdir()


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
    keys = make_keys([p.relative_to(src).as_posix() for p, _, _ in items])
    samples = [Sample(real, k, label, os.stat(real).st_size) for (_, real, label), k in zip(items, keys)]
    shuffle = split == "train" if args.shuffle is None else args.shuffle
    if shuffle:
        random.Random(args.seed).shuffle(samples)
    plan = plan_shards(samples, args.shard_size, args.max_shard_bytes)
    source = str(src.resolve())

    lock = _lock(out)
    try:
        _check_replace(out, split, source, classes, args.overwrite)
        for stale in out.glob(f".{split}.tmp-*"):  # staging of a killed run (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        stage = out / f".{split}.tmp-{uuid.uuid4().hex[:8]}"
        stage.mkdir()
        tasks = [(str(stage), split, i, group, args.other_formats) for i, group in enumerate(plan)]
        counts, sizes, reencoded = [0] * len(plan), [0] * len(plan), 0
        from tqdm import tqdm
        try:
            with tqdm(total=len(samples), unit="img", desc=f"{split} -> {out}", disable=not args.progress,
                      mininterval=1.0) as bar, closing(_run_tasks(write_shard, tasks, args.workers)) as done:
                for index, n, nbytes, conv in done:
                    counts[index], sizes[index], reencoded = n, nbytes, reencoded + conv
                    bar.update(n)
        except BaseException:  # an unreadable file, Ctrl-C: the split in --out stays as it was
            shutil.rmtree(stage, ignore_errors=True)
            raise
        names = [shard_name(split, i) for i in range(len(plan))]
        meta = ShardMeta(
            num_samples=len(samples), num_classes=len(classes), shards=names,
            samples_per_shard=counts, shard_bytes=sizes, split=split,
            pattern=brace_pattern(Path("."), split, len(plan)), classes=CLASSES_FILE,
            shuffled=shuffle, seed=args.seed if shuffle else None, reencoded_to_png=reencoded,
            source=source,
        ).to_dict()
        _commit(out, stage, split, names, classes, meta)
    finally:
        lock.release()
    seen = len({s.label for s in samples})
    print(f"{split}: {len(samples)} samples of {seen}/{len(classes)} classes in {len(plan)} shards "
          f"({sum(sizes) / 2**20:.1f} MiB); {reencoded} re-encoded to PNG")
    print(f"{split} shards: {brace_pattern(out, split, len(plan))}")
    return meta


# ----------------------------------------------------------------------------- verification
def _scan(path: str) -> tuple[str, dict]:
    """(shard name, `scan_shard` with every image decoded): one task of `verify`."""
    return Path(path).name, scan_shard(path, decode=True)


def verify(out: Path, splits: Sequence[str] | None, workers: int, progress: bool = True) -> list[str]:
    """Problems found in the shards of ``out`` (every split with metadata unless ``splits``),
    printed; a missing folder is a ConversionError (bad input, exit status 2).

    Each shard is checked by the trainer's verifier (`train_imagenet.data.verify.scan_shard`,
    here also decoding every image); the split as a whole against its ``<split>.json``."""
    if not out.is_dir():
        raise ConversionError(f"--verify {out}: no such folder; give the --out folder of the shards")
    if splits is None:
        splits = split_names(str(out))
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
        except (ConversionError, LabelsError) as e:
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
        with tqdm(total=len(present), unit="shard", desc=f"verify {split}", disable=not progress) as bar, \
                closing(_run_tasks(_scan, [str(out / s) for s in present], workers)) as done:
            for name, r in done:
                bar.update(1)
                total += r["samples"]
                labels.update(r["labels"])
                keys.update(set(r["keys"]))  # a key repeated within a shard is one of its problems
                split_problems += [f"{name}: {p}" for p in r["problems"]]
                split_problems += [f"{name}: label {label} out of range [0, {num_classes})"
                                   for label in sorted(r["labels"]) if not 0 <= label < num_classes]
                if r["samples"] != expected.get(name):
                    split_problems.append(f"{split}: shard {name} holds {r['samples']} samples, "
                                          f"metadata says {expected.get(name)}")
        if total != num_samples:
            split_problems.append(f"{split}: read {total} samples, metadata says num_samples={num_samples}")
        dupes = [k for k, c in keys.items() if c > 1]
        if dupes:
            split_problems.append(f"{split}: {len(dupes)} key(s) occur in more than one shard, e.g. {dupes[:3]}")
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
    p.add_argument("--split", default=None,
                   help="shard name prefix (default: from --src's folder name, val for "
                        "'val'/'validation', test for 'test', else train)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a split of --out made from another source")
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
    """Exit status: 0 success, 1 verification found problems, 2 bad input or options,
    130 interrupted (Ctrl-C)."""
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
        if args.split is None:
            inferred = infer_split(Path(args.src))
            args.split = inferred or "train"
            print(f"--split {args.split} ({'from the name of --src' if inferred else 'the default'}; "
                  "pass --split to choose)", file=sys.stderr)
        convert(args)
        if args.verify:
            return 1 if verify(Path(args.out), [args.split], args.workers, args.progress) else 0
        return 0
    except (ConversionError, LabelsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; the shards being written were removed and every split of the "
              "folder is as it was or complete (<split>.json is written last): re-run the command",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
