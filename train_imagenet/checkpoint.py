"""Checkpoints: atomic saves, checksums, `resume=auto` discovery, RNG states, architecture checks.

A checkpoint is one ``torch.save`` dict (loadable with ``weights_only=True``):
``model``, ``ema``, ``optimizer``, ``scheduler``, ``scaler`` state dicts; ``epoch`` and
``batch`` (the next batch to run: (e, 0) at an epoch boundary), ``update`` (optimizer updates
so far), ``rng`` (one entry per rank), ``config`` and ``arch`` ({model, model_kwargs,
num_classes}). Files are ``ckpt-e{epoch}-u{update}.pth`` in the run directory, written to a
temporary name and renamed, so a crash never leaves a half-written checkpoint under a real name.

Every checkpoint carries ``checksum``: the SHA-256 of its content (each tensor's dtype, shape
and bytes, every other value's type and repr, in order), checked whenever it is loaded, so
bytes altered on disk are found even where the file still unpickles. `load_latest` walks
back from the newest checkpoint past damaged ones, renaming each to ``*.pth.corrupt`` (kept
for inspection, out of the rotation) with a warning that names it.
"""
import glob
import hashlib
import logging
import os
import random
import re
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from dcvit.io import atomic_write

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "load_latest",
           "list_checkpoints", "capture_rng", "restore_rng", "seed_all", "check_arch", "load_model_weights",
           "content_digest"]

_NAME = re.compile(r"ckpt-e(\d+)-u(\d+)\.pth$")
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
    """Seeds Python's, NumPy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
    atomic_write(path, lambda tmp: torch.save(state, tmp))
    for old in list_checkpoints(run_dir)[:-keep]:
        os.remove(old)
    return path


def list_checkpoints(run_dir: str) -> List[str]:
    """Checkpoints in `run_dir`, oldest first (by update count)."""
    found = [(int(m.group(2)), p) for p in glob.glob(os.path.join(run_dir, "ckpt-*.pth"))
             if (m := _NAME.search(os.path.basename(p)))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: str) -> Dict[str, Any]:
    """The dict in `path` (``weights_only=True``), its checksum verified when it has one."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path!r} cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path!r} holds a {type(state).__name__}, not a dict")
    saved = state.get("checksum")
    if isinstance(saved, dict) and "sha256" in saved:
        if content_digest(state) != saved["sha256"]:
            raise CheckpointError(f"checkpoint {path!r} is damaged: its content does not match "
                                  f"the checksum saved with it (bytes changed on disk); use an "
                                  f"earlier checkpoint (resume=auto falls back to one)")
    elif "arch" in state:
        _logger.warning("checkpoint %r has no checksum (saved by an older version): not verified",
                        path)
    return state


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
