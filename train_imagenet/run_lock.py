"""One run per output directory: rank 0 holds a lock on ``output_dir/.lock`` while it runs.

The lock is a POSIX record lock (``fcntl.lockf``): the kernel drops it when the holding
process exits, however it exits (SIGKILL, OOM, a node reboot for local disks), so a lock
left behind by a dead run is never in the way; a second live run is refused with the
holder's process id, host and start time. A file system without locks (some network mounts)
gives a warning and no lock.
"""
import errno
import fcntl
import glob
import json
import logging
import os
import socket
import time
from typing import List, Optional

from dcvit.io import unwritable_dir

__all__ = ["RunDirError", "RunLock", "prepare_run_dir"]

LOCK_NAME = ".lock"
RUN_FILES = ("config.yaml", "eval_config.yaml", "log.jsonl", "summary.csv", "eval.json",
             "eval_ema.json")                   # what a run writes in its output_dir
_logger = logging.getLogger(__name__)


class RunDirError(ValueError):
    """The output directory cannot be used: not a directory, not writable, or in use."""


class RunLock:
    """The lock of one run directory; `release()` (or process exit) frees it."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise RunDirError(f"output_dir={os.path.dirname(self.path)!r} is in use by another "
                                  f"run ({self.holder()}); wait for it to end or stop it, or set "
                                  f"another output_dir") from None
            _logger.warning("cannot lock %s (%s): this file system has no locks, so nothing stops "
                            "a second run in the same output_dir", self.path, e)
            return self
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode())
        os.fsync(fd)
        self.fd = fd
        return self

    def holder(self) -> str:
        """Who holds the lock, in words: the process id, host and start time the holder
        wrote (read from the file; call it after `acquire` failed, never while holding)."""
        try:
            with open(self.path) as f:  # only read when not holding: closing drops our own lock
                info = json.load(f)
            return f"pid {info['pid']} on {info['host']}, started {info['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "its process id is not recorded yet"

    def release(self) -> None:
        if self.fd is not None:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def prepare_run_dir(run_dir: str) -> RunLock:
    """Creates `run_dir`, checks it can be written (a directory in the place of a file the run
    writes is refused too), takes its lock and removes the temporary
    files of writes a killed run left behind (``.NAME.XXXX.tmp``, see ``dcvit.io``)."""
    problem = unwritable_dir(run_dir, "output_dir")
    if problem:
        raise RunDirError(problem)
    in_place = [name for name in RUN_FILES if os.path.isdir(os.path.join(run_dir, name))]
    if in_place:
        raise RunDirError(f"output_dir {run_dir!r} has a directory named {in_place[0]}, where the "
                          f"run writes its file of that name; remove or rename that directory")
    try:
        os.makedirs(run_dir, exist_ok=True)
        lock = RunLock(run_dir).acquire()
    except OSError as e:
        raise RunDirError(f"output_dir {run_dir!r} cannot be written ({type(e).__name__}: "
                          f"{e.strerror or e}); give a writable directory") from None
    removed = remove_stale_temporaries(run_dir)
    if removed:
        _logger.warning("removed %d temporary file(s) of interrupted writes in %s: %s",
                        len(removed), run_dir, ", ".join(os.path.basename(p) for p in removed))
    return lock


def remove_stale_temporaries(run_dir: str) -> List[str]:
    """Deletes ``.*.tmp`` files (only safe while holding the run directory's lock)."""
    removed = []
    for path in glob.glob(os.path.join(run_dir, ".*.tmp")):
        try:
            os.remove(path)
            removed.append(path)
        except OSError:
            pass
    return removed
