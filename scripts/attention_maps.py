#!/usr/bin/env python
"""Per-head attention maps of one image, before and after DCMHA's post-compose, as a PNG.

    python scripts/attention_maps.py --model dcvit_tiny --out maps.png
    python scripts/attention_maps.py --checkpoint runs/quickstart/dcvit_tiny --digit 7 --out maps.png
    python scripts/attention_maps.py --model dcvit_small --image cat.jpg --layer 5 --query 0 --out maps.png

Rows of the figure: the attention weights of one query token (default: CLS) over the patch
tokens, reshaped to the patch grid, per head, before post-compose (plain softmax weights),
after it (what DCMHA actually uses), and their difference. The first column is the input.

Without ``--image`` the input is a scikit-learn digit (``--digit INDEX``), upscaled.
``--checkpoint`` takes a weights file or a training run directory (its newest
``ckpt-e*-u*.pth``). With a checkpoint the model name and ``model_kwargs`` come from a ``config.yaml`` beside the
checkpoint when present (as written by ``python -m train_imagenet``; else from the
checkpoint's own ``arch`` entry); ``--model`` and ``--model-kwargs key=value ...`` override
them. ``num_classes`` defaults to the size of the checkpoint's classifier, the input
normalisation to the run's ``data.mean``/``data.std``; ``--ema`` takes a training
checkpoint's EMA weights. Weights load with ``dcvit.load_weights`` (``.safetensors``, or
``.pth`` read with ``weights_only=True``); a plain ViT checkpoint loads too, its DCMHA
weights left at their initialisation.
"""
import argparse
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import yaml
from PIL import Image

import timm
import dcvit
import dcvit.weights
from dcvit.cli import parse_kwargs
from dcvit.io import atomic_write

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prepare_digits import digit_image  # noqa: E402

__all__ = ["find_checkpoint", "read_run_config", "resolve_model", "build_model", "load_image", "query_maps",
           "plot_maps", "figure_size", "main"]

CELL_INCHES = 1.7
DPI = 100


def _unwrap(state: Dict[str, Any]) -> Dict[str, Any]:
    for key in ("model", "state_dict"):
        if isinstance(state.get(key), dict):
            state = state[key]
    return state


_CKPT = re.compile(r"ckpt-e(\d+)-u(\d+)\.pth$")


def find_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a file; for a run directory its newest training checkpoint
    (``ckpt-e{epoch}-u{update}.pth``, highest update), else its only ``*.safetensors``."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    found = sorted((int(m.group(2)), p) for p in path.glob("ckpt-*.pth") if (m := _CKPT.search(p.name)))
    if found:
        return found[-1][1]
    weights = sorted(path.glob("*.safetensors"))
    if len(weights) == 1:
        return weights[0]
    raise FileNotFoundError(f"run directory {str(path)!r} has no ckpt-e*-u*.pth and "
                            f"{len(weights)} .safetensors files; pass the weights file itself")


def read_run_config(checkpoint: Path, state: Dict[str, Any]) -> Dict[str, Any]:
    """What the run that wrote ``checkpoint`` says about its model and input normalisation.

    From ``config.yaml`` beside the checkpoint (``model``, ``model_kwargs``,
    ``data.num_classes``, ``data.mean``, ``data.std``), else from the checkpoint's ``arch``
    entry (``python -m train_imagenet`` writes both); ``{}`` when there is neither.
    """
    config = checkpoint.parent / "config.yaml"
    if config.is_file():
        cfg = yaml.safe_load(config.read_text()) or {}
        if not isinstance(cfg, dict):
            raise ValueError(f"{config} does not hold a YAML mapping")
        data = cfg.get("data") or {}
        convert = cfg.get("convert") or {}
        out = {"source": str(config), "model": cfg.get("model"),
               "model_kwargs": dict(cfg.get("model_kwargs") or {}),
               "num_classes": data.get("num_classes"), "mean": data.get("mean"), "std": data.get("std"),
               "convert": ({"layers": convert.get("layers"), "options": convert.get("options") or {}}
                           if convert.get("enabled") else None)}
    elif isinstance(state.get("arch"), dict):
        arch = state["arch"]
        out = {"source": f"{checkpoint} (arch)", "model": arch.get("model"),
               "model_kwargs": dict(arch.get("model_kwargs") or {}), "num_classes": arch.get("num_classes"),
               "convert": arch.get("convert")}
    else:
        return {}
    return {k: v for k, v in out.items() if v is not None}


def resolve_model(model: Optional[str], model_kwargs: Dict[str, Any], checkpoint: Optional[Path],
                  state: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
    """The timm name and kwargs: the run's config (`read_run_config`), then the flags.

    ``num_classes`` defaults to the size of the checkpoint's classifier.
    """
    name, kwargs = None, {}
    if checkpoint is not None:
        state = dcvit.weights.read_state_dict(checkpoint) if state is None else state
        run = read_run_config(checkpoint, state)
        name, kwargs = run.get("model"), dict(run.get("model_kwargs", {}))
        if "num_classes" in run:
            kwargs.setdefault("num_classes", run["num_classes"])
        head = _unwrap(state).get("head.weight")
        if head is not None:
            kwargs.setdefault("num_classes", int(head.shape[0]))
        if run:
            print(f"model from {run['source']}: {name} {kwargs}")
    name = model or name or "dcvit_tiny"
    return name, {**kwargs, **model_kwargs}


def build_model(name: str, kwargs: Dict[str, Any], checkpoint: Optional[Path], ema: bool = False,
                state: Optional[Dict[str, Any]] = None,
                convert: Optional[Dict[str, Any]] = None) -> torch.nn.Module:
    """``timm.create_model(name, **kwargs)`` with the checkpoint's weights (its EMA weights
    with ``ema``), in eval mode; with ``convert`` (a converted run's ``{"layers", "options"}``)
    converted to DCMHA before the weights load."""
    torch.manual_seed(0)  # an untrained model is the same on every run
    model = timm.create_model(name, **kwargs)
    if convert:
        dcvit.convert(model, layers=convert.get("layers"), **(convert.get("options") or {}))
    if checkpoint is not None:
        if not ema:
            dcvit.load_weights(model, checkpoint)
        else:
            state = dcvit.weights.read_state_dict(checkpoint) if state is None else state
            weights = state.get("ema")
            if not isinstance(weights, dict):
                raise ValueError(f"{checkpoint} holds no EMA weights (its 'ema' entry is "
                                 f"{type(weights).__name__}); drop --ema")
            model.load_state_dict(dcvit.models.checkpoint_filter_fn(weights, model), strict=True)
        print(f"loaded {checkpoint}{' (EMA weights)' if ema else ''}")
    return model.eval()


def load_image(model: torch.nn.Module, image: Optional[Path], digit: int,
               mean: Optional[List[float]] = None,
               std: Optional[List[float]] = None) -> Tuple[Image.Image, torch.Tensor]:
    """The picture (RGB, model input size) and its normalised tensor (1, 3, H, W).

    Normalised with ``mean``/``std`` when given (the training run's), else the model's
    pretrained config."""
    height, width = model.patch_embed.img_size
    if image is not None:
        pic = Image.open(image).convert("RGB")
    else:
        from dcvit.optional import require
        images = require("sklearn.datasets", "--digit (scikit-learn's digits)").load_digits().images
        if not 0 <= digit < len(images):
            raise ValueError(f"--digit {digit} is not an index of the {len(images)} digits")
        pic = digit_image(images[digit], 32)
    pic = pic.resize((width, height), Image.Resampling.BICUBIC)
    cfg = timm.data.resolve_model_data_config(model)
    x = torch.from_numpy(np.asarray(pic, dtype=np.float32) / 255.0).permute(2, 0, 1)   # (3, H, W)
    m = torch.tensor(mean if mean is not None else cfg["mean"], dtype=torch.float32).view(3, 1, 1)
    s = torch.tensor(std if std is not None else cfg["std"], dtype=torch.float32).view(3, 1, 1)
    return pic, ((x - m) / s).unsqueeze(0)                                         # (1, 3, H, W)


def query_maps(model: torch.nn.Module, x: torch.Tensor, layer: int,
               query: Optional[int]) -> Dict[str, Any]:
    """Attention of one query over the patch grid, per head, before/after post-compose.

    Returns ``{"name", "query", "prefix", "grid", "before", "after", "stage"}``: the layer,
    the query token index, the number of prefix tokens (CLS, registers), the patch grid
    (grid_h, grid_w) and the maps (H, grid_h, grid_w). Layers without post-compose show softmax of the scores before and
    after pre-compose instead (``stage`` says which).
    """
    records = dcvit.attention_maps(model, x)
    depth = len(model.blocks)
    if not -depth <= layer < depth:
        raise ValueError(f"--layer {layer} is not a block index in [0, {depth}) "
                         "(negative counts from the end)")
    want = f"blocks.{layer % depth}.attn"
    by_name = {r["name"]: r for r in records}
    if want not in by_name:
        dcmha_blocks = [int(n.split(".")[1]) for n in by_name]
        raise ValueError(f"block {layer % depth} has no DCMHA (it is plain attention); "
                         f"DCMHA blocks: {dcmha_blocks}")
    rec = by_name[want]
    if "weights_before" in rec:
        before, after, stage = rec["weights_before"], rec["weights_after"], "post-compose"
    else:
        before, after = rec["scores_before"].softmax(-1), rec["scores_after"].softmax(-1)
        stage = "pre-compose (softmax of scores)"
    prefix = model.num_prefix_tokens
    grid_h, grid_w = model.patch_embed.grid_size
    tokens = before.shape[-1]
    if query is None:
        query = 0 if prefix else grid_h // 2 * grid_w + grid_w // 2
    if not 0 <= query < tokens:
        raise ValueError(f"--query {query} is not a token index in [0, {tokens}) "
                         f"({prefix} prefix token(s), then {grid_h}x{grid_w} patches)")

    def to_grid(a: torch.Tensor) -> np.ndarray:
        return a[0, :, query, prefix:].reshape(-1, grid_h, grid_w).numpy()          # (H, gh, gw)

    return {"name": want, "query": query, "prefix": prefix, "grid": (grid_h, grid_w),
            "before": to_grid(before), "after": to_grid(after), "stage": stage}


def figure_size(num_heads: int) -> Tuple[int, int]:
    """Pixel size (width, height) of the PNG: (1 + heads) columns, 3 rows."""
    return round((num_heads + 1) * CELL_INCHES * DPI), round(3 * CELL_INCHES * DPI)


def plot_maps(pic: Image.Image, maps: Dict[str, Any], title: str, out: Path) -> Path:
    from dcvit.optional import require
    require("matplotlib", "the attention-map figure").use("Agg")
    import matplotlib.pyplot as plt

    before, after = maps["before"], maps["after"]                                 # (H, gh, gw)
    heads = before.shape[0]
    width, height = figure_size(heads)
    # A quarter pixel over: matplotlib before 3.11 truncates the pixel size (5.1 in x 100 dpi
    # is 509.99.. px), later releases round it.
    fig, axes = plt.subplots(3, heads + 1, figsize=((width + 0.25) / DPI, (height + 0.25) / DPI),
                             dpi=DPI, squeeze=False, layout="constrained")
    vmin, vmax = min(before.min(), after.min()), max(before.max(), after.max())
    diff = after - before
    dmax = max(float(np.abs(diff).max()), 1e-12)
    rows = [("before", before, dict(cmap="viridis", vmin=vmin, vmax=vmax)),
            ("after", after, dict(cmap="viridis", vmin=vmin, vmax=vmax)),
            ("after - before", diff, dict(cmap="RdBu_r", vmin=-dmax, vmax=dmax))]
    gh, gw = maps["grid"]
    q_patch = maps["query"] - maps["prefix"]
    for r, (label, data, style) in enumerate(rows):
        ax = axes[r, 0]
        ax.imshow(pic)
        if q_patch >= 0:
            ph, pw = pic.height / gh, pic.width / gw
            ax.add_patch(plt.Rectangle(((q_patch % gw) * pw, (q_patch // gw) * ph), pw, ph,
                                       fill=False, edgecolor="red", linewidth=1.5))
        ax.set_ylabel(label, fontsize=9)
        for h in range(heads):
            im = axes[r, h + 1].imshow(data[h], interpolation="nearest", **style)
            if r == 0:
                axes[r, h + 1].set_title(f"head {h}", fontsize=9)
        fig.colorbar(im, ax=axes[r, 1:].tolist(), shrink=0.9)
    for ax in axes.ravel():
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title, fontsize=9)
    try:
        return atomic_write(out, lambda tmp: fig.savefig(tmp, format="png", dpi=DPI))
    finally:
        plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--model", default=None,
                        help="timm model name (default: from config.yaml beside --checkpoint, "
                             "else dcvit_tiny)")
    parser.add_argument("--model-kwargs", nargs="*", default=[], metavar="KEY=VALUE",
                        help="timm.create_model kwargs, e.g. img_size=32 patch_size=4")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help=".safetensors or .pth weights (ViT or DCViT), or a training run "
                             "directory (its newest ckpt-*.pth)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--image", type=Path, default=None, help="an image file")
    source.add_argument("--digit", type=int, default=0,
                        help="index of a scikit-learn digit to use when no --image (default 0)")
    parser.add_argument("--layer", type=int, default=-1, help="block index (default: last)")
    parser.add_argument("--query", type=int, default=None,
                        help="query token index (default: 0 = CLS; centre patch without prefix tokens)")
    parser.add_argument("--ema", action="store_true",
                        help="use the EMA weights of a training checkpoint (its 'ema' entry)")
    parser.add_argument("--out", type=Path, required=True, help="output PNG")
    args = parser.parse_args(argv)

    try:
        if args.checkpoint is not None:
            args.checkpoint = find_checkpoint(args.checkpoint)
        state = dcvit.weights.read_state_dict(args.checkpoint) if args.checkpoint is not None else None
        run = read_run_config(args.checkpoint, state) if args.checkpoint is not None else {}
        name, kwargs = resolve_model(args.model, parse_kwargs(args.model_kwargs),
                                     args.checkpoint, state)
        model = build_model(name, kwargs, args.checkpoint, args.ema, state, run.get("convert"))
        pic, x = load_image(model, args.image, args.digit, run.get("mean"), run.get("std"))
        maps = query_maps(model, x, args.layer, args.query)
    except (ValueError, FileNotFoundError, TypeError) as e:
        parser.error(str(e))
    with torch.no_grad():
        pred = int(model(x).argmax(-1))
    source = str(args.image) if args.image is not None else f"digit #{args.digit}"
    query = "CLS" if maps["query"] < maps["prefix"] else f"patch {maps['query'] - maps['prefix']}"
    title = (f"{name} {maps['name']}: attention of {query} over patches, before/after {maps['stage']}"
             f"\n{source}, predicted class {pred}")
    plot_maps(pic, maps, title, args.out)
    change = np.abs(maps["after"] - maps["before"]).max(axis=(1, 2))
    print(f"{maps['name']} ({maps['stage']}), query {query}: max |after - before| per head "
          + " ".join(f"{c:.2e}" for c in change))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
