"""Saving and loading model weights: safetensors for publishing, `.pth` read safely.

Every way weights reach a model goes through timm's loader conventions and one adapter,
`dcvit.models.checkpoint_filter_fn` (timm's ``filter_fn``):

* ``timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=...))``: timm's
  loader with the adapter as the model's ``pretrained_filter_fn``; a big_vision ``.npz`` goes to
  the model's ``load_pretrained`` (`dcvit.bigvision_npz`), as timm sends ``.npz`` files;
* `load_weights`: a file into a model you have built (or converted), the same adapter; ``.npz``
  to ``load_pretrained`` as above;
* the trainer's ``checkpoint=``/``resume=`` read their own files and adapt them with
  `dcvit.conversion.fit_state_dict`, the DCMHA part of the adapter.
"""
import os
from pathlib import Path
from typing import Any, Dict, Union

import torch
from safetensors.torch import load_file, save_file
from timm.models import clean_state_dict
from torch import nn

from .io import atomic_write
from .models import checkpoint_filter_fn

__all__ = ["save_weights", "load_weights", "read_state_dict"]

PathLike = Union[str, os.PathLike]


def save_weights(model: nn.Module, path: PathLike) -> Path:
    """Write ``model``'s state dict as safetensors, atomically (temp file + rename).

    ``path`` must end in ``.safetensors`` (another name would hide the format from readers).
    """
    if Path(path).suffix != ".safetensors":
        raise ValueError(f"save_weights writes safetensors: name the file "
                         f"{str(Path(path).with_suffix('.safetensors'))!r}, not {str(path)!r} "
                         f"(for a .pth use torch.save(model.state_dict(), path))")
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def _is_safetensors(path: Path) -> bool:
    """A safetensors file begins with its header's length (8 bytes, little-endian) and '{'."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return 0 < int.from_bytes(head[:8], "little") <= path.stat().st_size - 8


def read_state_dict(path: PathLike) -> Dict[str, Any]:
    """What a weights or checkpoint file holds, read safely: a ``.safetensors`` file (by its
    name or its content) or a ``.pth``/``.pt`` file (``torch.load(weights_only=True)``; a
    training checkpoint comes back whole, its ``model``/``ema``/``arch`` entries included).

    timm's ``load_state_dict`` recognises safetensors by the name only and returns the
    weights alone; this is for files whose other entries are wanted (`load_weights` loads).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    if path.suffix == ".safetensors" or _is_safetensors(path):
        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{str(path)!r} does not hold a state dict (got {type(state).__name__})")
    return state


def _weights(checkpoint: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The model weights of a file's content, as timm's ``load_state_dict`` takes them (the
    ``state_dict`` or ``model`` entry, DDP/compile prefixes removed), without its EMA choice."""
    for key in ("state_dict", "model"):
        if isinstance(checkpoint.get(key), dict):
            checkpoint = checkpoint[key]
            break
    return clean_state_dict(checkpoint)


def load_weights(model: nn.Module, path: PathLike) -> nn.Module:
    """Load a weights file into ``model`` (strictly, after `checkpoint_filter_fn`).

    ``model`` is a DCViT or ViT, or a model converted with `dcvit.convert`. The file is
    safetensors (recognised by its content whatever the name), a ``.pth`` state dict or
    training checkpoint (``weights_only=True``), or a big_vision ``.npz`` (read by the model's
    ``load_pretrained``, as timm's ``load_checkpoint`` does). DCMHA tensors a plain model's
    checkpoint lacks keep their initialisation and are listed in a log message; a checkpoint
    of another size raises ``ValueError``.
    """
    if Path(path).suffix.lower() in (".npz", ".npy"):
        if not hasattr(model, "load_pretrained"):
            raise ValueError(f"{str(path)!r} is a numpy checkpoint; {type(model).__name__} has no "
                             "load_pretrained to read it (big_vision .npz files load into *_bv_224 models)")
        model.load_pretrained(str(path))
        return model
    state = _weights(read_state_dict(path))
    model.load_state_dict(checkpoint_filter_fn(state, model, source=repr(str(path))), strict=True)
    return model
