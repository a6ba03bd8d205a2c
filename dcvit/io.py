"""Atomic file writes: a reader never sees a half-written file under the final name."""
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Union

__all__ = ["atomic_write", "write_text", "write_json", "unwritable_dir"]

PathLike = Union[str, os.PathLike]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: PathLike, write: Callable[[str], Any]) -> Path:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, then rename it to ``path``.

    The temporary file is removed if ``write`` raises; the final file gets the usual
    permissions (``0o666`` less the umask), not ``mkstemp``'s private ``0o600``. The folder is
    synced after the rename, so the new name survives a power loss once this returns (for the
    bytes too, ``write`` syncs its file, as checkpoints do).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:   # a failed write names no file
            e.filename = str(path)
        raise
    _sync_dir(path.parent)
    return path


def _sync_dir(folder: Path) -> None:
    """fsync of `folder` (the renames in it made durable); a file system that cannot sync a
    folder (EINVAL on some network mounts) is passed over."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text(path: PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def write_json(path: PathLike, obj: Any, indent: int = 2) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically."""
    return write_text(path, json.dumps(obj, indent=indent) + "\n")


def unwritable_dir(path: PathLike, key: str = "--out") -> Optional[str]:
    """None when ``path`` is a directory a file can be written to, or can be created as one,
    else why not, as a message naming ``key`` and the fix. Creates nothing (a probe file is
    made and removed in the nearest existing folder); meant to run before long work."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{key} {str(path)!r} is a file, not a directory; give a directory path"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{str(existing)!r} is a file")
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".write-test.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return (f"{key} {str(path)!r} cannot be written ({type(e).__name__}: {e.strerror or e}); "
                f"give a writable directory")
    return None
