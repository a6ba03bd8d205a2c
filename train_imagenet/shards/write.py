"""Writing a split: image bytes into shards by worker processes, then moved in atomically.

The conversion holds ``DIR/.lock`` (the trainer's `RunLock`: one conversion per folder),
writes the shards into a hidden staging folder and moves them in only when all are
written, metadata last: an interrupted or failed run leaves the previous split as it was. A
split made from another source is replaced only with ``overwrite``.

JPEG and PNG bytes are stored unchanged (the member extension follows the content, so
``.JPEG`` becomes ``.jpg``); other formats are re-encoded to PNG, or refused. An image
inside an archive is read from its byte range of the tar (``Sample.at``), a Parquet image
from its row, the row groups a shard needs read once per shard.
"""
from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import uuid
from collections import defaultdict
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Iterable, Sequence

from dcvit.io import write_json
from dcvit.schema import CLASSES_FILE, LABEL_EXTENSION, ShardMeta, shard_name, split_names
from train_imagenet.run_lock import RunDirError, RunLock

from .plan import ConversionError, Sample, brace_pattern, plan_shards

SHARD_MTIME = 0  # fixed integer mtime: identical shard bytes, and no PAX header per member


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


# ----------------------------------------------------------------------------- image bytes
def _sniff(head: bytes) -> str | None:
    if head.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    return None


def encode_bytes(data: bytes, where: str, other_formats: str) -> tuple[str, bytes, bool]:
    """(extension, bytes, re-encoded?): JPEG/PNG bytes unchanged, other images as PNG."""
    ext = _sniff(data[:8])
    if ext is not None:
        return ext, data, False
    if other_formats == "error":
        raise ConversionError(f"{where} is neither JPEG nor PNG; convert it or pass --other-formats png")
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            if im.mode not in ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"):
                im = im.convert("RGB")  # e.g. CMYK: PNG cannot hold it
            buf = io.BytesIO()
            im.save(buf, format="PNG")
    except Exception as e:
        raise ConversionError(f"cannot read image {where}: {e}") from None
    return "png", buf.getvalue(), True


def encode_image(path: str, other_formats: str) -> tuple[str, bytes, bool]:
    """`encode_bytes` of an image file."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConversionError(f"cannot read {path} ({e.strerror or e}); make it readable or move "
                              f"it out of --src, then re-run") from None
    return encode_bytes(data, path, other_formats)


def _member_bytes(s: Sample, files: dict) -> bytes:
    """The ``s.size`` bytes at ``s.at[0]`` of the tar ``s.path`` (its files kept open in ``files``)."""
    try:
        f = files.get(s.path) or files.setdefault(s.path, open(s.path, "rb"))
        data = os.pread(f.fileno(), s.size, s.at[0])
    except OSError as e:
        raise ConversionError(f"cannot read {s.path} ({e.strerror or e}); make it readable, then re-run") from None
    if len(data) != s.size:
        raise ConversionError(f"{s.path} ends inside sample {s.key} (read {len(data)} of {s.size} bytes): "
                              "the archive changed or is truncated since it was listed; re-run")
    return data


def _parquet_images(samples: Sequence[Sample]) -> dict:
    """{(path, row group, row): image bytes} for the Parquet samples of one shard."""
    from .parquet import read_rows
    wanted: dict = defaultdict(set)
    for s in samples:
        if len(s.at) == 2:
            wanted[s.path, s.at[0]].add(s.at[1])
    found = {}
    for (path, group), rows in wanted.items():
        for row, data in read_rows(path, group, sorted(rows)).items():
            found[path, group, row] = data
    return found


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
    rows = _parquet_images(samples)
    files: dict = {}
    try:
        with open(path, "wb") as f:
            with TarWriter(f, encoder=False, mtime=SHARD_MTIME) as sink:
                for s in samples:
                    if not s.at:
                        ext, data, converted = encode_image(s.path, other_formats)
                    else:
                        data = rows[(s.path, *s.at)] if len(s.at) == 2 else _member_bytes(s, files)
                        ext, data, converted = encode_bytes(data, f"{s.path} (sample {s.key})", other_formats)
                    reencoded += converted
                    sink.write({"__key__": s.key, ext: data, LABEL_EXTENSION: str(s.label).encode("ascii")})
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    return index, len(samples), path.stat().st_size, reencoded


# ----------------------------------------------------------------------------- processes
def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the workers too: the parent acts


def _pool(workers: int):
    import webdataset  # noqa: F401  (slow import, torch included: once here, inherited by forked workers)

    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else None).Pool(workers, initializer=_ignore_sigint)


def run_tasks(fn, tasks: list, workers: int) -> Iterable:
    """Results of ``fn`` over ``tasks`` as they complete (in-process when ``workers == 1``)."""
    if workers <= 1 or len(tasks) <= 1:
        yield from map(fn, tasks)
        return
    with _pool(min(workers, len(tasks))) as pool:
        yield from pool.imap_unordered(fn, tasks)


# ----------------------------------------------------------------------------- the output folder
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


def write_split(samples: list[Sample], classes: list[str], out: Path, split: str, source: str, *,
                shard_size: int, max_shard_bytes: int | None, shuffled: bool, seed: int,
                workers: int, other_formats: str, overwrite: bool, progress: bool) -> dict:
    """Writes ``samples`` (already in their final order) as ``split`` of ``out``; returns its metadata."""
    plan = plan_shards(samples, shard_size, max_shard_bytes)
    lock = _lock(out)
    try:
        _check_replace(out, split, source, classes, overwrite)
        for stale in out.glob(f".{split}.tmp-*"):  # staging of a killed run (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        stage = out / f".{split}.tmp-{uuid.uuid4().hex[:8]}"
        stage.mkdir()
        tasks = [(str(stage), split, i, group, other_formats) for i, group in enumerate(plan)]
        counts, sizes, reencoded = [0] * len(plan), [0] * len(plan), 0
        from tqdm import tqdm
        try:
            with tqdm(total=len(samples), unit="img", desc=f"{split} -> {out}", disable=not progress,
                      mininterval=1.0) as bar, closing(run_tasks(write_shard, tasks, workers)) as done:
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
            shuffled=shuffled, seed=seed if shuffled else None, reencoded_to_png=reencoded,
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
