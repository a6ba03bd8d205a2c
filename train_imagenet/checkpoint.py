"""Checkpoints: atomic saves, `resume=auto` discovery, RNG state capture, architecture checks.

A checkpoint is one ``torch.save`` dict (loadable with ``weights_only=True``):
``model``, ``ema``, ``optimizer``, ``scheduler``, ``scaler`` state dicts; ``epoch`` and
``batch`` (the next batch to run: (e, 0) at an epoch boundary), ``update`` (optimizer updates
so far), ``rng`` (one entry per rank), ``config`` and ``arch`` ({model, model_kwargs,
num_classes}). Files are ``ckpt-e{epoch}-u{update}.pth`` in the run directory, written to a
temporary name and renamed, so a crash never leaves a half-written checkpoint under a real name.
"""
import glob
import logging
import os
import random
import re
import zipfile
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from dcvit.io import atomic_write

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "find_latest",
           "list_checkpoints", "capture_rng", "restore_rng", "check_arch", "load_model_weights"]

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


def restore_rng(state: Dict[str, Any]) -> None:
    version, s, gauss = state["python"]
    random.setstate((version, tuple(s), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(state: Dict[str, Any], run_dir: str, keep: int = 2) -> str:
    """Writes `state` atomically as ckpt-e{epoch}-u{update}.pth; keeps the newest `keep`."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, f"ckpt-e{state['epoch']:04d}-u{state['update']:08d}.pth")
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
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path!r} cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path!r} holds a {type(state).__name__}, not a dict")
    return state


def find_latest(run_dir: str) -> Optional[str]:
    """The newest checkpoint in `run_dir` by name (update count) whose archive opens; None if none.

    Only the zip directory at the end of each file is read, newest first, so this is cheap
    however large the checkpoints are; one that does not open (truncated, not a torch.save
    file) is skipped with a warning naming it and the error.
    """
    for path in reversed(list_checkpoints(run_dir)):
        try:
            with zipfile.ZipFile(path) as archive:
                if not any(n.endswith("data.pkl") for n in archive.namelist()):
                    raise ValueError("no data.pkl member: not a torch.save file")
        except (OSError, ValueError, zipfile.BadZipFile) as e:
            _logger.warning("skipping checkpoint %r: it cannot be read (%s: %s); delete it or "
                            "pass resume=PATH", path, type(e).__name__, e)
            continue
        return path
    return None


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
