"""Saving and loading model weights: safetensors for publishing, `.pth` read safely."""
import os
from pathlib import Path
from typing import Dict, Union

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .io import atomic_write
from .conversion import fit_state_dict
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


def read_state_dict(path: PathLike) -> Dict[str, torch.Tensor]:
    """Read a ``.safetensors`` file (by its name or its content) or a ``.pth``/``.pt`` file
    (``weights_only=True``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    if path.suffix == ".safetensors" or _is_safetensors(path):
        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{str(path)!r} does not hold a state dict (got {type(state).__name__})")
    return state


def load_weights(model: nn.Module, path: PathLike) -> nn.Module:
    """Load a ViT or DCViT checkpoint into a DCViT (or ViT) model, or a converted one.

    DCMHA tensors a plain ViT checkpoint lacks keep their initialisation and are listed
    in a log message; a checkpoint of another size raises ``ValueError``.
    """
    state = checkpoint_filter_fn(fit_state_dict(model, read_state_dict(path), repr(str(path))), model)
    model.load_state_dict(state, strict=True)
    return model
