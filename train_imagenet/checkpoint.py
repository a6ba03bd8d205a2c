"""Checkpoints: atomic saves, checksums, `resume=auto` discovery, RNG states, architecture checks.

A checkpoint is one ``torch.save`` dict (loadable with ``weights_only=True``):
``model``, ``ema``, ``optimizer``, ``scheduler``, ``scaler`` state dicts; ``epoch`` and
``batch`` (the next batch to run: (e, 0) at an epoch boundary), ``update`` (optimizer updates
so far), ``rng`` (one entry per rank), ``config`` and ``arch`` ({model, model_kwargs,
num_classes}); ``position`` (what ``batch`` means: the train data's identity, the global
batch and the world size, see `start.position_of`; and, as ``data_order``, the settings the
order of an epoch depends on: ``seed``, ``data.num_workers``, ``data.shuffle_buffer``,
``aug.repeated_aug``, see `start.data_order_of`; a checkpoint saved before they were recorded
lacks it and still loads), ``totals`` (the epoch's running sums
for its log record, mid-epoch) and ``record`` (the train record of the epoch just finished,
at an epoch boundary, logged once its evaluation is done). Files are
``ckpt-e{epoch}-u{update}.pth`` in the run directory, written to a temporary name, synced,
renamed and its folder synced (POSIX durability: after a power loss the new name is there
with its bytes), so a crash never leaves a half-written checkpoint under a real name, and a write
that fails (a full disk, a file over ``ulimit -f``, a run directory made unwritable) leaves the
previous checkpoints as they were and is a `CheckpointError` saying so (`refused_writes`, also
for the run's logs and results).

Every checkpoint carries ``checksum``: the SHA-256 of its content (each tensor's dtype, shape
and bytes, every other value's type and repr, in order), checked whenever it is loaded, so
bytes altered on disk are found even where the file still unpickles. `load_latest` walks
back from the newest checkpoint past damaged ones, renaming each to ``*.pth.corrupt`` (kept
for inspection, out of the rotation) with a warning that names it.
"""
import errno
import glob
import hashlib
import logging
import os
import pickle
import random
import re
import resource
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from dcvit.io import atomic_write

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "load_latest",
           "list_checkpoints", "capture_rng", "restore_rng", "seed_all", "check_arch", "load_model_weights",
           "content_digest", "load_error", "refused_writes", "write_refused"]

_NAME = re.compile(r"ckpt-e(\d+)-u(\d+)\.pth$")
RESUME = "resume=auto"          # what continues a run whose write was refused (`write_refused`)
_logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why and what to do."""


def capture_rng() -> Dict[str, Any]:
    """Python, NumPy, torch (and CUDA) RNG states as plain tensors/lists (weights_only-safe)."""
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": [version, list(state), gauss],
           "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                     "has_gauss": int(has_gauss), "cached": float(cached)},
           "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def seed_all(seed: int) -> None:
    """Seeds Python's, NumPy's and torch's generators (torch's with `seed` modulo 2**64, as it
    takes a negative seed, so that a seed derived from a large `seed` config value fits)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**64)


def restore_rng(state: Dict[str, Any]) -> None:
    version, s, gauss = state["python"]
    random.setstate((version, tuple(s), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _feed(h: "hashlib._Hash", obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for k, v in obj.items():            # insertion order, which torch.save/load keep
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            _feed(h, v)
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def content_digest(state: Dict[str, Any]) -> str:
    """SHA-256 of a checkpoint's content, its ``checksum`` entry left out."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != "checksum"})
    return h.hexdigest()


def save_checkpoint(state: Dict[str, Any], run_dir: str, keep: int = 2) -> str:
    """Writes `state` (with its checksum) atomically as ckpt-e{epoch}-u{update}.pth; keeps
    the newest `keep`."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, f"ckpt-e{state['epoch']:04d}-u{state['update']:08d}.pth")
    state = {**state, "checksum": {"sha256": content_digest(state)}}
    with refused_writes(path, run_dir, "the checkpoints already there are intact"):
        atomic_write(path, lambda tmp: _save(state, tmp))
    for old in list_checkpoints(run_dir)[:-keep]:
        try:
            os.remove(old)
        except OSError as e:          # the new one is written; the next save reports the folder
            _logger.warning("cannot remove the old checkpoint %s (%s); it is kept", old, e.strerror)
    return path


def _cause(e: Optional[BaseException], errnos: Tuple[int, ...]) -> Optional[OSError]:
    """The OSError in `e`'s chain whose errno is one of `errnos`, or None (torch's writer
    raises a RuntimeError while closing the file, from the OSError of the write)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in errnos:
            return e
        e = e.__cause__ or e.__context__
    return None


def write_refused(e: BaseException, path: str, run_dir: str, kept: str,
                  then: str = RESUME) -> Optional[CheckpointError]:
    """The CheckpointError for a write of `path` in the run directory `run_dir` that the file
    system refused, or None for any other error: no space (ENOSPC; EDQUOT: a quota), a file
    larger than the process may write (EFBIG: ``ulimit -f``), no access (EACCES, EPERM;
    EROFS: mounted read-only) or a directory in the file's place (EISDIR), each found also
    where torch wraps it. `kept` says what is intact; the message ends with the fix, then
    `then`: what runs again (`RESUME`, resume=auto, after which the newest checkpoint, the
    one it continues from, is named)."""
    found = _cause(e, (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM,
                       errno.EROFS, errno.EISDIR))
    if found is None:
        return None
    if then == RESUME:
        kept = f"{kept} (the newest: {(list_checkpoints(run_dir) or ['none was saved yet'])[-1]})"
    path = found.filename2 or found.filename or path    # EISDIR of a rename names the folder second
    if found.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointError(
            f"no space left on {_device_of(run_dir)} writing {path}; {kept}. Free space there (or "
            f"set output_dir elsewhere and copy the run), then {then}")
    if found.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        return CheckpointError(
            f"cannot write {path}: it is larger than this process may write (ulimit -f: "
            f"{'unlimited' if limit == resource.RLIM_INFINITY else f'{limit} bytes'}, or the "
            f"file system's largest file); {kept}. Raise the limit (ulimit -f unlimited in the "
            f"job script), then {then}")
    if found.errno == errno.EISDIR:
        return CheckpointError(f"cannot write {path}: a directory is in its place; {kept}. Remove "
                               f"or rename that directory, then {then}")
    return CheckpointError(
        f"cannot write {path} ({found.strerror}): output_dir {run_dir} is no longer writable; "
        f"{kept}. Make it writable again (or copy the run to a writable output_dir), then "
        f"{then}")


@contextmanager
def refused_writes(path: str, run_dir: str, kept: str, then: str = RESUME) -> Iterator[None]:
    """``with refused_writes(path, run_dir, kept):`` a write of `path` that the file system
    refuses is raised as `write_refused`'s CheckpointError (exit 2, one line)."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        refused = write_refused(e, path, run_dir, kept, then)
        if refused is None:
            raise
        raise refused from e


def _save(state: Dict[str, Any], tmp: str) -> None:
    """torch.save through a Python file, so a failed write raises the OSError (with its errno)
    rather than the C++ writer's generic error."""
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _device_of(path: str) -> str:
    """The device (as /proc/mounts names it) and mount point of the file system of `path`."""
    mount = os.path.realpath(path)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    try:
        with open("/proc/mounts") as f:
            devices = {fields[1]: fields[0] for fields in (ln.split() for ln in f) if len(fields) > 1}
    except OSError:
        devices = {}
    return f"{devices[mount]} (mounted on {mount})" if mount in devices else mount


def list_checkpoints(run_dir: str) -> List[str]:
    """Checkpoints in `run_dir`, oldest first (by epoch, then update count: a run resumed at
    an epoch boundary with fewer updates per epoch counts on from a lower update)."""
    found = [(int(m.group(1)), int(m.group(2)), p)
             for p in glob.glob(os.path.join(glob.escape(run_dir), "ckpt-*.pth"))
             if (m := _NAME.search(os.path.basename(p)))]
    return [p for _, _, p in sorted(found)]


def load_error(path: str, e: Exception, what: str = "checkpoint") -> CheckpointError:
    """The CheckpointError for a file that does not load: a pickle refused by the weights-only
    loader is named as not safe (never with torch's advice to load it unsafely), a damaged
    .safetensors or zip as unreadable. `what` names the file's role: 'checkpoint' or a key
    such as 'checkpoint='."""
    name = f"{what}{path!r}" if what.endswith("=") else f"{what} {path!r}"
    if isinstance(e, pickle.UnpicklingError):
        found = re.search(r"WeightsUnpickler error:\s*(.*?)\s*(?:\n\n|$)", str(e), re.S)
        reason = f" ({found.group(1).strip()})" if found else ""
        timm = ("; a checkpoint of timm's train.py holds its argparse.Namespace: timm's "
                "clean_checkpoint.py writes its weights alone" if "argparse.Namespace" in str(e) else "")
        return CheckpointError(
            f"{name} is not a safe checkpoint: it is a pickle holding more than tensors "
            f"and plain values{reason}, and such a file is never unpickled (it could run code). "
            f"Use a checkpoint of this package, a .safetensors file (dcvit.save_weights) or a "
            f"torch.save'd state dict of tensors{timm}")
    return CheckpointError(f"{name} cannot be read: it is truncated or damaged "
                           f"({type(e).__name__}: {' '.join(str(e).split())[:300]})")


def load_checkpoint(path: str) -> Dict[str, Any]:
    """The dict in `path` (``weights_only=True``), its checksum verified when it has one."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise load_error(path, e) from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path!r} holds a {type(state).__name__}, not a dict")
    saved = state.get("checksum")
    if isinstance(saved, dict) and "sha256" in saved:
        if content_digest(state) != saved["sha256"]:
            raise CheckpointError(f"checkpoint {path!r} is damaged: its content does not match "
                                  f"the checksum saved with it (bytes changed on disk); use an "
                                  f"earlier checkpoint (resume=auto falls back to one)")
    elif isinstance(state.get("arch"), dict):
        _logger.warning("checkpoint %r has no checksum (saved by an older version of "
                        "train_imagenet): not verified", path)
    elif "arch" in state or "state_dict" in state:
        _logger.warning("checkpoint %r was written elsewhere (%s), not by python -m train_imagenet: "
                        "it has no checksum to verify; its weights are read as a state dict",
                        path, _written_by(state))
    return state


def _written_by(state: Dict[str, Any]) -> str:
    """What wrote a checkpoint of another program, as far as its keys tell."""
    arch, epoch = state.get("arch"), state.get("epoch")
    if isinstance(arch, str) and "state_dict" in state:   # timm's CheckpointSaver
        return f"timm's train.py: arch {arch!r}" + (f", epoch {epoch}" if isinstance(epoch, int) else "")
    return f"arch {arch!r}" if isinstance(arch, str) else "keys " + ", ".join(map(str, list(state)[:5]))


def load_latest(run_dir: str, set_aside: bool = True) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """The newest checkpoint of `run_dir` that loads and verifies, and its content; damaged
    newer ones are skipped with a warning naming them (and, with `set_aside`, renamed
    ``*.corrupt``). (None, None) if there is none."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as e:
            bad = path + ".corrupt" if set_aside else path
            try:
                os.replace(path, bad)
            except OSError:
                bad = path
            _logger.warning("skipping damaged checkpoint %s (kept as %s): %s; falling back to "
                            "the checkpoint before it", path, bad, e)
    return None, None


def check_arch(state: Dict[str, Any], arch: Dict[str, Any], path: str) -> None:
    """Fails when the checkpoint was saved from another model than `arch` describes."""
    saved = state.get("arch")
    if saved is None:
        return
    diff = [k for k in ("model", "model_kwargs", "num_classes") if saved.get(k) != arch.get(k)]
    if diff:
        raise CheckpointError(
            f"checkpoint {path!r} is a {saved.get('model')!r} with model_kwargs="
            f"{saved.get('model_kwargs')} and num_classes={saved.get('num_classes')}, but this run "
            f"builds {arch.get('model')!r} with model_kwargs={arch.get('model_kwargs')} and "
            f"num_classes={arch.get('num_classes')} (differs in: {', '.join(diff)}); set the "
            f"same model/model_kwargs/data.num_classes or choose another checkpoint")


def load_model_weights(model: torch.nn.Module, weights: Dict[str, torch.Tensor], path: str,
                       what: str = "model") -> None:
    """`load_state_dict(strict=True)` with an error that names the mismatching keys.

    Weights of the model before its conversion to DCMHA load with the DCMHA tensors at their
    initialisation (logged); weights of a converted model into an unconverted one fail."""
    from dcvit.conversion import fit_state_dict
    try:
        weights = fit_state_dict(model, weights, f"{what} weights in {path!r}")
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        own = model.state_dict()
        missing = sorted(set(own) - set(weights))
        unexpected = sorted(set(weights) - set(own))
        shapes = [k for k in set(own) & set(weights) if own[k].shape != weights[k].shape]
        raise CheckpointError(
            f"{what} weights in {path!r} do not fit this architecture: {len(missing)} missing "
            f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}), "
            f"{len(shapes)} of another shape (e.g. {shapes[:3]}); the checkpoint comes from "
            f"another model or model_kwargs") from e
