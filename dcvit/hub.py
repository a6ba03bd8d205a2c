"""Sharing a DCViT through timm's Hugging Face Hub format (docs/deploying.md#sharing).

``timm.models.save_for_hf(model, DIR, model_args=...)`` / ``push_to_hf_hub`` write the weights
and a ``config.json`` whose ``model_args`` rebuild the model:
``timm.create_model("local-dir:DIR", pretrained=True)`` or ``"hf-hub:ORG/NAME"``.
`model_args` reads what a DCViT needs there from the model itself: its sizes, the DCMHA
options and which blocks have DCMHA (``dcmha_layers``). (timm >= 1.0.31 also records the
arguments a model was created with; older versions rely on these alone.)

`save_pretrained` writes a folder that transformers' ``TimmWrapper`` loads as well
(``AutoModelForImageClassification``, ``AutoImageProcessor``, ``pipeline``), with the same
logits as timm, bit for bit: timm's config without ``num_classes`` in ``model_args``
(transformers passes it itself), weights laid out so that memory-mapping them gives aligned
tensors, and a model card that says ``import dcvit`` comes first.
"""
import json
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Union

import torch
from torch import nn

from .attention import DCMHA

__all__ = ["model_args", "save_pretrained"]


def model_args(model: nn.Module) -> Dict[str, Any]:
    """The keyword arguments of ``timm.create_model`` that rebuild ``model``'s architecture.

    The sizes (``img_size``, ``patch_size``, ``embed_dim``, ``depth``, ``num_heads``), the
    options of its DCMHA layers (they share one set) and ``dcmha_layers``, the indices of the
    blocks that have one. JSON-serialisable, for timm's
    ``save_for_hf(model, DIR, model_args=model_args(model))`` and ``push_to_hf_hub``.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(f"model_args expects a DCViT (a VisionTransformer with .blocks), "
                        f"got {type(model).__name__}")
    layers = {i: b.attn for i, b in enumerate(blocks) if isinstance(getattr(b, "attn", None), DCMHA)}
    options = [layer.options.as_dict() for layer in layers.values()]
    if any(o != options[0] for o in options[1:]):
        raise ValueError("the model's DCMHA layers have different options; timm's create_model "
                         "builds one set for all layers, so this model cannot be rebuilt from model_args")
    embed = model.patch_embed
    sizes = dict(img_size=list(embed.img_size) if embed.img_size is not None else None,
                 patch_size=list(embed.patch_size), embed_dim=model.embed_dim, depth=len(blocks),
                 num_heads=blocks[0].attn.num_heads)
    return {**sizes, **(options[0] if options else {}), "dcmha_layers": sorted(layers)}


# safetensors' names of the dtypes a state dict holds.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_ALIGN = 64  # bytes: the alignment torch's CPU allocator gives every tensor


def _save_aligned_safetensors(tensors: Dict[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` as a safetensors file whose data a memory map leaves 64-byte aligned.

    transformers memory-maps the file and computes with the tensors in place; a matrix-vector
    product (the head at batch 1) on a misaligned weight takes another path through the BLAS
    and rounds differently in the last bit. ``safetensors.torch.save_file`` packs tensors in
    name order (``head.bias``, 4·num_classes bytes, then ``head.weight``), so here the header is
    padded to end on a 64-byte boundary and the tensors whose size is a multiple of 64 bytes
    come first (every weight matrix of a DCViT); the format allows any order without holes.
    """
    names = sorted(tensors, key=lambda n: (tensors[n].numel() * tensors[n].element_size() % _ALIGN != 0, n))
    header: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in names:
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors name here")
        blob = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)          # the format allows trailing spaces
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)


_CARD = """---
library_name: timm
license: {license}
pipeline_tag: image-classification
tags:
- image-classification
- timm
- transformers
- dcvit
---
# {name}

A DCViT: a timm vision transformer with Dynamically Composable Multi-Head Attention
(`{architecture}`, DCMHA in blocks {layers}).

**`import dcvit` first** (`pip install dcvit`): it registers the DCViT architectures with timm.
Without it timm says `Unknown model`, and transformers says the architecture "is not supported
in your version of timm ... Please upgrade timm"; upgrading timm does not help, `import dcvit`
does.

```python
import dcvit  # registers the DCViT architectures with timm
import timm
model = timm.create_model("hf-hub:ORG/NAME", pretrained=True)   # or "local-dir:FOLDER"

from transformers import pipeline
classify = pipeline("image-classification", model="ORG/NAME")  # or the folder
```
"""


def save_pretrained(model: nn.Module, directory: Union[str, Path], *,
                    label_names: Optional[Sequence[str]] = None,
                    data_config: Optional[Dict[str, Any]] = None) -> Path:
    """Save a DCViT to ``directory`` for timm and for transformers' ``TimmWrapper``.

    Writes ``model.safetensors``, ``config.json`` (timm's, with `model_args`) and a
    ``README.md`` model card; upload the folder as it is (``huggingface_hub.upload_folder``)
    to publish it. Both ``timm.create_model("local-dir:DIR", pretrained=True)`` and
    ``AutoModelForImageClassification.from_pretrained(DIR)`` (``AutoImageProcessor``,
    ``pipeline("image-classification", model=DIR)``) load it, after ``import dcvit``, and give
    the same logits bit for bit.

    ``label_names``: one name per class (``config.json``'s ``label_names``: timm's
    ``pretrained_cfg``, transformers' ``id2label`` and the pipeline's labels).
    ``data_config``: the preprocessing to record, as timm's ``save_for_hf`` takes it
    (default: the model's own input size, mean, std, crop and interpolation).
    """
    from timm.models import save_for_hf

    args = model_args(model)   # checks that this is a DCViT
    if label_names is not None and len(label_names) != model.num_classes:
        raise ValueError(f"label_names has {len(label_names)} names for a model with "
                         f"{model.num_classes} classes")
    directory = Path(directory)
    save_for_hf(model, directory, model_args=args, data_config=data_config, safe_serialization=True,
                model_config={"label_names": list(label_names)} if label_names is not None else None)
    _save_aligned_safetensors(model.state_dict(), directory / "model.safetensors")   # replaces timm's
    config_path = directory / "config.json"
    # timm writes num_classes into model_args too; transformers' TimmWrapper passes its own
    # (the root num_classes, which timm's local-dir loading reads as well) and would fail with
    # "got multiple values for keyword argument 'num_classes'".
    config = json.loads(config_path.read_text())
    config["model_args"].pop("num_classes", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (directory / "README.md").write_text(_CARD.format(
        name=directory.resolve().name, architecture=config["architecture"],
        layers=", ".join(map(str, args["dcmha_layers"])) or "none",
        license=config["pretrained_cfg"].get("license", "apache-2.0")))
    return directory
