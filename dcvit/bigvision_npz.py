"""Load a big_vision ``.npz`` checkpoint into a `dcvit.bigvision.BigVisionViT`.

The file is big_vision's flattened flax parameter tree, names joined with '/', with or
without the ``params/`` prefix of a training checkpoint (other top-level entries, such as
optimizer state, are ignored). Two attention layouts are read:

* the authors' ``MultiHeadDotProductAttention`` (github Lisennlp/big_vision):
  ``query_dense``, ``key_dense``, ``value_dense``, ``o_dense``; with DC also ``query_ln``,
  ``key_ln``, ``dyn_w_proj/{dw1/kernel, qkw, dd/kernel}``, ``pre_proj/w``, ``post_proj/w``;
* flax's ``nn.MultiHeadDotProductAttention`` of upstream big_vision: ``query``, ``key``,
  ``value``, ``out``.

Blocks may be separate (``encoderblock_0`` ...) or stacked by ``nn.scan``
(``encoderblock``). Every tensor of the file is converted to the model's layout and checked
before anything is copied: a missing, extra or misshapen tensor, a head count or model
family that differs from the file, or an unreadable (e.g. truncated) file raises one
``ValueError`` naming it, and the model is left untouched.
"""
import re
import zipfile
from pathlib import Path
from typing import Dict, List, Tuple, Union

import numpy as np
import torch
from torch import nn

__all__ = ["read_npz", "bigvision_state_dict", "load_bigvision_npz"]

_ATTN = "MultiHeadDotProductAttention_0"
_SIZE_HINT = ("the file holds a model of another size: pass the matching sizes to "
              "timm.create_model (embed_dim, depth, num_heads, patch_size, img_size, num_classes)")


def read_npz(path: Union[str, Path]) -> Dict[str, np.ndarray]:
    """All arrays of a big_vision ``.npz`` by name, without the ``params/`` prefix."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"big_vision checkpoint {str(path)!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: np.asarray(z[name]) for name in z.files}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError) as e:
        raise ValueError(f"big_vision checkpoint {str(path)!r} is not a readable .npz (truncated or "
                         f"corrupt?): {type(e).__name__}: {e}") from e
    if any(n.startswith("params/") for n in arrays):
        arrays = {n[len("params/"):]: a for n, a in arrays.items() if n.startswith("params/")}
    if not arrays:
        raise ValueError(f"big_vision checkpoint {str(path)!r} holds no parameters")
    return arrays


def _unstack_scan(arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """``Transformer/encoderblock/...`` (stacked by nn.scan) -> ``encoderblock_{i}/...``."""
    stacked = "Transformer/encoderblock/"
    if not any(n.startswith(stacked) for n in arrays):
        return arrays
    out = {}
    for name, a in arrays.items():
        if name.startswith(stacked):
            for i in range(a.shape[0]):
                out[f"Transformer/encoderblock_{i}/{name[len(stacked):]}"] = a[i]
        else:
            out[name] = a
    return out


class _Converter:
    """Moves named arrays from the file into torch tensors named as in the model."""

    def __init__(self, arrays: Dict[str, np.ndarray]) -> None:
        self.arrays = arrays
        self.used: set = set()
        self.out: Dict[str, torch.Tensor] = {}
        self.source: Dict[str, str] = {}                 # torch name -> file name(s)

    def has(self, name: str) -> bool:
        return name in self.arrays

    def take(self, name: str) -> np.ndarray:
        self.used.add(name)
        return np.asarray(self.arrays[name], dtype=np.float32)

    def put(self, key: str, value: np.ndarray, source: str) -> None:
        self.out[key] = torch.from_numpy(np.ascontiguousarray(value))
        self.source[key] = source

    def linear(self, src: str, dst: str) -> None:
        """flax Dense ``kernel`` (in, out) and ``bias`` -> torch Linear ``weight`` (out, in)."""
        if self.has(f"{src}/kernel"):
            self.put(f"{dst}.weight", self.take(f"{src}/kernel").T, f"{src}/kernel")
        if self.has(f"{src}/bias"):
            self.put(f"{dst}.bias", self.take(f"{src}/bias"), f"{src}/bias")

    def norm(self, src: str, dst: str) -> None:
        if self.has(f"{src}/scale"):
            self.put(f"{dst}.weight", self.take(f"{src}/scale"), f"{src}/scale")
        if self.has(f"{src}/bias"):
            self.put(f"{dst}.bias", self.take(f"{src}/bias"), f"{src}/bias")


def _attention(cv: _Converter, src: str, dst: str) -> int:
    """One attention layer; returns the file's number of heads (0 if none was found)."""
    names = (("query_dense", "key_dense", "value_dense") if cv.has(f"{src}/query_dense/kernel")
             else ("query", "key", "value"))
    if not all(cv.has(f"{src}/{n}/kernel") for n in names):
        return 0
    kernels = [cv.take(f"{src}/{n}/kernel") for n in names]                  # (C, H, D) each
    if any(k.ndim != 3 for k in kernels):
        raise ValueError(f"big_vision tensor {src}/{names[0]}/kernel has shape {kernels[0].shape}, "
                         "expected (width, heads, head_dim)")
    c, h, d = kernels[0].shape
    joined = "|".join(f"{src}/{n}/kernel" for n in names)
    cv.put(f"{dst}.qkv.weight", np.concatenate([k.reshape(c, h * d).T for k in kernels], 0), joined)
    if all(cv.has(f"{src}/{n}/bias") for n in names):
        biases = [cv.take(f"{src}/{n}/bias").reshape(-1) for n in names]
        cv.put(f"{dst}.qkv.bias", np.concatenate(biases), "|".join(f"{src}/{n}/bias" for n in names))
    if cv.has(f"{src}/o_dense/kernel"):                                      # authors: Dense (H·D, C)
        cv.linear(f"{src}/o_dense", f"{dst}.proj")
    elif cv.has(f"{src}/out/kernel"):                                        # flax: (H, D, C)
        out = cv.take(f"{src}/out/kernel")
        cv.put(f"{dst}.proj.weight", out.reshape(-1, out.shape[-1]).T, f"{src}/out/kernel")
        if cv.has(f"{src}/out/bias"):
            cv.put(f"{dst}.proj.bias", cv.take(f"{src}/out/bias"), f"{src}/out/bias")
    cv.norm(f"{src}/query_ln", f"{dst}.q_norm")
    cv.norm(f"{src}/key_ln", f"{dst}.k_norm")
    dyn = f"{src}/dyn_w_proj"
    if cv.has(f"{dyn}/dw1/kernel"):
        dw1 = cv.take(f"{dyn}/dw1/kernel")                                   # (C, G=1, 4, K)
        _groups(dw1.shape[1], f"{dyn}/dw1/kernel")
        cv.put(f"{dst}.core.dynamic_weights.dw1", dw1[:, 0], f"{dyn}/dw1/kernel")
    if cv.has(f"{dyn}/qkw"):
        qkw = cv.take(f"{dyn}/qkw")                                          # (G=1, 4, K, 2R, H)
        _groups(qkw.shape[0], f"{dyn}/qkw")
        cv.put(f"{dst}.core.dynamic_weights.qkw", qkw[0], f"{dyn}/qkw")
    if cv.has(f"{dyn}/dd/kernel"):
        dd = cv.take(f"{dyn}/dd/kernel")                                     # (C, G=1, 4H)
        _groups(dd.shape[1], f"{dyn}/dd/kernel")
        cv.put(f"{dst}.core.dynamic_weights.dd_w", dd[:, 0], f"{dyn}/dd/kernel")
    for stage in ("pre", "post"):
        if cv.has(f"{src}/{stage}_proj/w"):
            w = cv.take(f"{src}/{stage}_proj/w")                             # (G=1, H, H)
            _groups(w.shape[0], f"{src}/{stage}_proj/w")
            cv.put(f"{dst}.core.{stage}_compose.static", w[0], f"{src}/{stage}_proj/w")
    return h


def _groups(g: int, name: str) -> None:
    if g != 1:
        raise ValueError(f"big_vision tensor {name} has {g} head groups; only num_groups=1 "
                         "(the authors' configs) is supported")


def bigvision_state_dict(arrays: Dict[str, np.ndarray]) -> Tuple[Dict[str, torch.Tensor],
                                                                Dict[str, str], List[str], Dict[int, int]]:
    """Convert big_vision arrays to `BigVisionViT` names.

    Returns ``(state_dict, source, unused, heads)``: ``source`` maps each state-dict key to
    the file name(s) it came from, ``unused`` lists the file's names nothing read, ``heads``
    the number of heads of each block's attention.
    """
    arrays = _unstack_scan(arrays)
    cv = _Converter(arrays)
    if cv.has("embedding/kernel"):
        k = cv.take("embedding/kernel")                                      # (ph, pw, in, C)
        cv.put("patch_embed.proj.weight", k.transpose(3, 2, 0, 1), "embedding/kernel")
    if cv.has("embedding/bias"):
        cv.put("patch_embed.proj.bias", cv.take("embedding/bias"), "embedding/bias")
    heads: Dict[int, int] = {}
    blocks = sorted({int(m.group(1)) for n in arrays
                     for m in [re.match(r"Transformer/encoderblock_(\d+)/", n)] if m})
    for i in blocks:
        src, dst = f"Transformer/encoderblock_{i}", f"blocks.{i}"
        cv.norm(f"{src}/LayerNorm_0", f"{dst}.norm1")
        cv.norm(f"{src}/LayerNorm_1", f"{dst}.norm2")
        cv.linear(f"{src}/MlpBlock_0/Dense_0", f"{dst}.mlp.fc1")
        cv.linear(f"{src}/MlpBlock_0/Dense_1", f"{dst}.mlp.fc2")
        heads[i] = _attention(cv, f"{src}/{_ATTN}", f"{dst}.attn")
    cv.norm("Transformer/encoder_norm", "norm")
    cv.linear("pre_logits", "pre_logits.fc")
    cv.linear("head", "head")
    unused = sorted(set(arrays) - cv.used)
    return cv.out, cv.source, unused, heads


def _describe(model: nn.Module) -> str:
    from .attention import DCMHA
    dc = any(isinstance(b.attn, DCMHA) for b in model.blocks)
    return (f"{'a DC' if dc else 'a baseline'} model with embed_dim={model.embed_dim}, "
            f"depth={len(model.blocks)}, num_heads={model.blocks[0].attn.num_heads}")


@torch.no_grad()
def load_bigvision_npz(model: nn.Module, path: Union[str, Path]) -> None:
    """Copy the parameters of a big_vision ``.npz`` into ``model``, all or nothing.

    Raises ``ValueError`` naming the first problem (unreadable file, tensors the model does
    not have, tensors the file lacks, shape or head-count mismatch); nothing is copied then.
    """
    arrays = read_npz(path)
    state, source, unused, heads = bigvision_state_dict(arrays)
    own = {k: v for k, v in model.state_dict().items()}
    where = f"big_vision checkpoint {str(path)!r} does not fit {_describe(model)}"
    if unused:
        learned = [n for n in unused if n in ("pos_embedding", "cls") or "MAPHead" in n]
        if learned:
            raise ValueError(f"{where}: it has {learned} (a learned position embedding, class token "
                             "or attention pooling); the _bv models are posemb='sincos2d', pool_type='gap'")
        raise ValueError(f"{where}: {len(unused)} file tensor(s) have no place in the model, e.g. "
                         f"{unused[:4]} (a DC checkpoint needs a dcvit_*_bv model and a baseline a "
                         f"vit_*_bv model; a file with more blocks needs depth=)")
    extra = [k for k in state if k not in own]
    if extra:
        names = [source[k] for k in extra[:4]]
        hint = ("a DC checkpoint needs a dcvit_*_bv model with its DC options on"
                if any("dyn_w_proj" in n or "_proj/w" in n or "_ln/" in n for n in names) else _SIZE_HINT)
        raise ValueError(f"{where}: {len(extra)} file tensor(s) have no place in the model, e.g. "
                         f"{names}; {hint}")
    missing = [k for k in own if k not in state]
    if missing:
        hint = ("a baseline checkpoint needs a vit_*_bv model"
                if any(".dynamic_weights." in k or "_compose." in k or "_norm." in k for k in missing)
                else "rep_size=False for a model without pre_logits, num_classes=0 for one without a head"
                if any(k.startswith(("pre_logits", "head")) for k in missing) else _SIZE_HINT)
        raise ValueError(f"{where}: the file lacks {len(missing)} tensor(s) the model needs, e.g. "
                         f"{missing[:4]}; {hint}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"{where}: file tensor {source[k]} gives {k} of shape {tuple(v.shape)}, the "
                             f"model has {tuple(own[k].shape)}; {_SIZE_HINT}")
    for i, block in enumerate(model.blocks):
        if heads.get(i) != block.attn.num_heads:
            raise ValueError(f"{where}: block {i} of the file has {heads.get(i)} heads, the model "
                             f"{block.attn.num_heads}; pass num_heads={heads.get(i)}")
    missing_keys, unexpected = model.load_state_dict(
        {k: v.to(own[k].dtype) for k, v in state.items()}, strict=True)
    assert not missing_keys and not unexpected
