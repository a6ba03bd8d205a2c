"""Classify images with a trained model: top-k classes, with their names, to CSV or JSON.

    python -m train_imagenet.predict runs/digits/ckpt-e0010-u00000450.pth photos/ --out preds.csv
    python -m train_imagenet.predict runs/digits photos/ --out preds.json --top-k 3 --ema
    python -m train_imagenet.predict runs/digits 'shards/val-{000000..000003}.tar' --out preds.csv

The model is a training checkpoint of ``python -m train_imagenet`` (a ``ckpt-*.pth`` file, or
its run directory for the newest valid one) or a folder written by ``dcvit.save_pretrained`` /
``timm.models.save_for_hf`` (``config.json`` + weights). Each image goes through the
checkpoint's own evaluation preprocessing: for a training checkpoint, the trainer's
(``data.img_size``, ``data.interpolation``, ``data.crop_pct``, ``data.mean``/``data.std`` of
the config saved in it, timm's ``create_transform``); for a folder, the ``pretrained_cfg`` of
its ``config.json`` (timm's ``resolve_model_data_config``).

The images are a folder (every file with an image extension, sub-folders included, in path
order, walked by the converter's rule, `train_imagenet.images.image_files`: linked
sub-folders are read, a link that would read a file twice or leads nowhere is refused) or a
WebDataset shard set (a ``.tar``, a brace pattern, or a directory of ``.tar`` files; samples
as ``scripts/make_wds_shards.py`` writes them, their label kept in the output). Each image is
decoded by `train_imagenet.images.open_image`: the 8-bit RGB picture it shows (16-bit and
float images scaled, transparency on white, EXIF orientation applied, a pixel limit).

Class names, first found: ``--classes FILE`` (a JSON list, one name per class, e.g. a shard
set's ``classes.json``); the ``classes.json`` beside the shards the checkpoint was trained on
(``data.train``/``data.val`` of its config; the class sub-folders for an ImageFolder); the
``label_names`` of a folder's ``config.json``; the ``classes.json`` of the shard set being
classified. Without any, the output has the class indices only.

An image that cannot be decoded is skipped and counted (``--on-corrupt skip``, the default):
it is named on stderr and listed under ``skipped`` in JSON output, and the others are
classified. ``--on-corrupt fail`` stops at the first one. A wrong or damaged checkpoint, no
images, class names that do not match the model and a corrupt image under ``fail`` exit with
status 2 and a message naming the fix; nothing is written then.

CSV: one row per image, ``image`` (its path relative to the folder, or ``SHARD/KEY``),
``label`` (shards only), then ``class_i``, ``name_i``, ``prob_i`` for i = 1..k, in UTF-8 (a
file name whose bytes are not UTF-8 has them as ``\\xNN``, `csv_name`, and stderr notes it). JSON:
``{"checkpoint", "classes" (the file the names came from, or null), "top_k", "skipped",
"predictions": [{"image", "label"?, "top": [{"class", "name", "prob"}, ...]}, ...]}``.
Probabilities are the softmax of the logits. ``--device auto`` runs on CUDA when available.
"""
import argparse
import csv
import io
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import yaml
from PIL import Image

from dcvit.io import atomic_write, unwritable_dir, write_json
from dcvit.schema import CLASSES_FILE, IMAGE_EXTENSIONS, LABEL_EXTENSION

from .checkpoint import CheckpointError, load_checkpoint, load_latest, load_model_weights
from .config import ConfigError, load_config
from .data import DataError, build_transform, resolve_source
from .images import FolderError, ImageError, image_files, open_image
from .model import build_model, input_norm

__all__ = ["PredictError", "Predictor", "load_predictor", "list_images", "predict", "csv_name", "main"]


class PredictError(ValueError):
    """A wrong checkpoint, input or option; the message names the fix (exit status 2)."""


@dataclass
class Predictor:
    """A model in eval mode, its evaluation transform, and its class names (None if unknown)."""
    model: torch.nn.Module
    transform: Callable[[Image.Image], torch.Tensor]
    classes: Optional[List[str]]
    classes_from: Optional[str]     # where the names were read
    source: str                     # the checkpoint file or folder read


# ------------------------------------------------------------------------------ checkpoints
_RUN_KEYS = ("model", "model_kwargs", "convert", "data")   # what rebuilds the model and its input


def _config_of(state: Dict[str, Any], path: str):
    """The training config saved in a checkpoint, as far as it rebuilds the model and its input."""
    saved = state.get("config")
    if not isinstance(saved, dict) or "model" not in saved:
        raise PredictError(f"{path!r} is not a training checkpoint of python -m train_imagenet "
                           f"(it has no 'config'); pass a run's ckpt-*.pth, its run directory, or a "
                           f"folder written by dcvit.save_pretrained")
    overrides = [f"{k}={yaml.safe_dump(saved[k], default_flow_style=True).strip()}"
                 for k in _RUN_KEYS if k in saved]
    try:
        return load_config(None, overrides)
    except ConfigError as e:
        raise PredictError(f"the config saved in {path!r} does not load: {e}") from e


def _training_classes(cfg) -> Tuple[Optional[List[str]], Optional[str]]:
    """The class names of the data a run was trained on and where they were read:
    ``classes.json`` beside its shards, or the class sub-folders of its ImageFolder
    (torchvision's order)."""
    for key in ("train", "val"):
        spec = getattr(cfg.data, key)
        try:
            source = resolve_source(spec, f"data.{key}")
        except (DataError, OSError):
            continue                  # the data is not on this machine
        if source.kind == "folder":
            from torchvision.datasets.folder import find_classes
            return find_classes(source.root)[0], f"the class folders of {source.root}"
        names, path = _classes_beside(source.shards)
        if names is not None:
            return names, path
    return None, None


def _classes_beside(shards: Sequence[str]) -> Tuple[Optional[List[str]], Optional[str]]:
    path = os.path.join(os.path.dirname(shards[0]), CLASSES_FILE) if shards else ""
    return (_read_classes(path), path) if os.path.isfile(path) else (None, None)


def _read_classes(path: str) -> List[str]:
    try:
        with open(path) as f:
            names = json.load(f)
    except (OSError, ValueError) as e:
        raise PredictError(f"class names {path!r} cannot be read ({e}); give a JSON list of names") from e
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise PredictError(f"class names {path!r} must be a JSON list of strings (like a shard "
                           f"set's {CLASSES_FILE})")
    return names


def _from_training_checkpoint(path: str, state: Dict[str, Any], ema: bool) -> Predictor:
    cfg = _config_of(state, path)
    weights = state.get("ema") if ema else state.get("model")
    if not isinstance(weights, dict):
        raise PredictError(f"{path!r} has no EMA weights (the run had ema.enabled=false); drop --ema"
                           if ema else f"{path!r} has no model weights")
    try:
        model = build_model(cfg, pretrained=False)
        load_model_weights(model, weights, path, what="EMA" if ema else "model")
    except (ConfigError, CheckpointError) as e:
        raise PredictError(str(e)) from e
    transform = build_transform(cfg, training=False, norm=input_norm(cfg, model))
    return Predictor(model.eval(), transform, *_training_classes(cfg), path)


def _from_hub_folder(folder: str) -> Predictor:
    import timm
    from timm.data import create_transform, resolve_model_data_config
    try:
        model = timm.create_model(f"local-dir:{folder}", pretrained=True)
    except Exception as e:        # timm raises RuntimeError, KeyError, OSError, ... for a bad folder
        raise PredictError(f"{folder!r} does not load as a timm model folder ({type(e).__name__}: "
                           f"{e}); write it with dcvit.save_pretrained") from e
    names = model.pretrained_cfg.get("label_names")
    transform = create_transform(**resolve_model_data_config(model))
    return Predictor(model.eval(), transform, list(names) if names else None,
                     os.path.join(folder, "config.json") if names else None, folder)


def load_predictor(checkpoint: str, ema: bool = False) -> Predictor:
    """The model of a training checkpoint (file or run directory) or a timm model folder."""
    import dcvit  # noqa: F401  (registers the DCViT models with timm)
    if os.path.isdir(checkpoint):
        if os.path.isfile(os.path.join(checkpoint, "config.json")):
            if ema:
                raise PredictError(f"{checkpoint!r} is a model folder, which holds one set of weights; drop --ema")
            return _from_hub_folder(checkpoint)
        path, state = load_latest(checkpoint, set_aside=False)
        if path is None:
            raise PredictError(f"{checkpoint!r} holds no valid ckpt-*.pth and no config.json; pass a "
                               f"training run directory, a checkpoint file or a dcvit.save_pretrained folder")
    elif os.path.isfile(checkpoint):
        if checkpoint.endswith(".safetensors"):
            raise PredictError(f"{checkpoint!r} holds weights without their architecture; pass the "
                               f"folder dcvit.save_pretrained wrote (config.json + model.safetensors) "
                               f"or a training checkpoint")
        path = checkpoint
        try:
            state = load_checkpoint(path)
        except CheckpointError as e:
            raise PredictError(str(e)) from e
    else:
        raise PredictError(f"checkpoint {checkpoint!r} does not exist")
    return _from_training_checkpoint(path, state, ema)


# ----------------------------------------------------------------------------------- images
Item = Tuple[str, Optional[int], Callable[[], Image.Image]]   # (name, label, open)


def list_images(spec: str) -> Tuple[List[Item], Tuple[Optional[List[str]], Optional[str]]]:
    """The images of a folder or a shard set, in order, each with its name, label (shards) and
    a function that decodes it; and the shard set's class names and their file when a
    classes.json is beside it."""
    if os.path.isdir(spec) and not any(n.endswith(".tar") for n in os.listdir(spec)):
        root = Path(spec)
        try:
            files = image_files(root)
        except FolderError as e:
            raise PredictError(str(e)) from e
        items = [(str(p.relative_to(root)), None, lambda p=p, n=str(p.relative_to(root)): open_image(p, n))
                 for p, _ in files]
        return items, (None, None)
    try:
        source = resolve_source(spec, "images")
    except DataError as e:
        raise PredictError(str(e).replace("images=", "the images ")) from e
    return list(_shard_items(source.shards)), _classes_beside(source.shards)


def _shard_items(shards: Sequence[str]) -> Iterator[Item]:
    from webdataset.tariterators import tarfile_samples
    for shard in shards:
        try:
            samples = list(tarfile_samples([{"url": shard}]))
        except Exception as e:    # tarfile.ReadError, OSError
            raise PredictError(f"shard {shard!r} cannot be read ({type(e).__name__}: {e})") from e
        for s in samples:
            ext = next((e for e in IMAGE_EXTENSIONS if e in s), None)
            label = s.get(LABEL_EXTENSION)
            name = f"{os.path.basename(shard)}/{s['__key__']}"
            data = s[ext] if ext else None
            yield (name, int(label) if label is not None else None,
                   lambda data=data, name=name: open_image(data, name) if data is not None else _no_image(name))


def _no_image(name: str) -> Image.Image:
    raise ImageError(f"no image member ({'/'.join(IMAGE_EXTENSIONS)}) in the sample", name)


# ------------------------------------------------------------------------------- prediction
def predict(predictor: Predictor, items: Sequence[Item], top_k: int = 5, batch_size: int = 32,
            on_corrupt: str = "skip", progress: Optional[bool] = None, device: str = "cpu"
            ) -> Tuple[List[Dict[str, Any]], List[Dict[str, str]]]:
    """(predictions, skipped): for each readable image its top-k classes, names and
    probabilities; each unreadable one with the reason (``on_corrupt='fail'`` raises instead)."""
    from tqdm import tqdm
    k = min(top_k, predictor.model.num_classes)
    names = predictor.classes
    out, skipped, batch = [], [], []

    def flush() -> None:
        with torch.inference_mode():
            x = torch.stack([x for _, _, x in batch]).to(device)
            probs = predictor.model(x).float().softmax(-1).cpu()
        top_p, top_i = probs.topk(k, dim=-1)
        for (name, label, _), ps, cs in zip(batch, top_p.tolist(), top_i.tolist()):
            row = {"image": name, **({"label": label} if label is not None else {}),
                   "top": [{"class": c, "name": names[c] if names else None, "prob": p}
                           for c, p in zip(cs, ps)]}
            out.append(row)
        batch.clear()

    # progress=None: a bar when stderr is a terminal (tqdm's own test), none in logs
    with tqdm(items, desc="classifying", unit="img", file=sys.stderr,
              disable=None if progress is None else not progress) as bar:
        for name, label, opener in bar:
            try:
                image = opener()
            except ImageError as e:
                if on_corrupt == "fail":
                    raise PredictError(f"image {name!r}: {e.reason}; remove it, or pass "
                                       f"--on-corrupt skip to skip and count such images") from e
                skipped.append({"image": name, "error": e.reason})
                continue
            batch.append((name, label, predictor.transform(image)))
            if len(batch) == batch_size:
                flush()
        if batch:
            flush()
    return out, skipped


def csv_name(name: str) -> str:
    """An image name as a CSV cell in UTF-8: the name itself, or, for a file name whose bytes
    are not UTF-8 (held by Python as ``os.fsdecode``'s surrogate escapes), those bytes as
    ``\\xNN`` (so ``b"caf\\xe9.png"`` is written ``caf\\xe9.png``)."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        return os.fsencode(name).decode("utf-8", "backslashreplace")


def _csv(rows: List[Dict[str, Any]], k: int) -> str:
    labelled = any("label" in r for r in rows)
    header = ["image"] + (["label"] if labelled else []) + [
        f"{col}_{i}" for i in range(1, k + 1) for col in ("class", "name", "prob")]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    for r in rows:
        cells = [csv_name(r["image"])] + ([r.get("label", "")] if labelled else [])
        for t in r["top"]:
            cells += [t["class"], "" if t["name"] is None else t["name"], f"{t['prob']:.6g}"]
        writer.writerow(cells)
    return buf.getvalue()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train_imagenet.predict",
                                description="Classify a folder or shard set of images with a trained "
                                            "model; write the top-k classes with names to CSV or JSON.")
    p.add_argument("checkpoint", help="a ckpt-*.pth of python -m train_imagenet, its run directory "
                                      "(newest valid checkpoint), or a dcvit.save_pretrained folder")
    p.add_argument("images", help="a folder of images (sub-folders included), or WebDataset shards: "
                                  "a .tar, a brace pattern, or a directory of .tar files")
    p.add_argument("--out", required=True, help="output file: .csv or .json")
    p.add_argument("--top-k", type=int, default=5, help="classes per image (default 5)")
    p.add_argument("--classes", help=f"class names, a JSON list (e.g. a shard set's {CLASSES_FILE})")
    p.add_argument("--ema", action="store_true", help="the training checkpoint's EMA weights")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--on-corrupt", choices=("skip", "fail"), default="skip",
                   help="an image that cannot be decoded: skip and count it (default), or stop")
    p.add_argument("--device", default="auto", help="'auto' (CUDA when available), 'cpu', 'cuda', 'cuda:1', ...")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except PredictError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    fmt = os.path.splitext(args.out)[1].lower()
    if os.path.isdir(args.out):
        raise PredictError(f"--out {args.out!r} is a directory; name the .csv or .json file to "
                           f"write, e.g. --out {os.path.join(args.out, 'predictions.csv')}")
    if fmt not in (".csv", ".json"):
        raise PredictError(f"--out {args.out!r}: name a .csv or a .json file")
    if args.top_k < 1 or args.batch_size < 1:
        raise PredictError("--top-k and --batch-size must be >= 1")
    problem = unwritable_dir(os.path.dirname(os.path.abspath(args.out)))
    if problem:
        raise PredictError(problem.replace("--out", "the folder of --out"))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        raise PredictError(f"--device {args.device}: {e}; use --device cpu") from e
    items, (input_classes, input_classes_from) = list_images(args.images)
    if not items:
        raise PredictError(f"no images in {args.images!r} (image files: "
                           f"{', '.join(IMAGE_EXTENSIONS)}; or .tar shards)")
    predictor = load_predictor(args.checkpoint, ema=args.ema)
    n = predictor.model.num_classes
    if args.classes:
        predictor.classes, predictor.classes_from = _read_classes(args.classes), args.classes
    elif predictor.classes is None and input_classes is not None and len(input_classes) == n:
        predictor.classes, predictor.classes_from = input_classes, input_classes_from
    if predictor.classes is not None and len(predictor.classes) != n:
        raise PredictError(f"{len(predictor.classes)} class names ({predictor.classes_from}) for a model "
                           f"with {n} classes; pass --classes with the names of the classes it was trained on")
    if predictor.classes is None:
        print(f"note: no class names found; the output has class indices only (pass --classes "
              f"{CLASSES_FILE})", file=sys.stderr)
    predictor.model.to(device)
    rows, skipped = predict(predictor, items, args.top_k, args.batch_size, args.on_corrupt, device=device)
    for s in skipped:
        print(f"skipped {s['image']}: {s['error']}", file=sys.stderr)
    if not rows:
        raise PredictError(f"none of the {len(items)} images could be decoded; nothing written")
    k = len(rows[0]["top"])
    escaped = [r["image"] for r in rows if csv_name(r["image"]) != r["image"]]
    if fmt == ".csv" and escaped:
        print(f"note: {len(escaped)} image name(s) are not valid UTF-8, e.g. {escaped[0]!r}; the CSV "
              f"writes their other bytes as \\xNN (JSON output keeps them as \\udcNN escapes)",
              file=sys.stderr)
    if fmt == ".csv":
        text = _csv(rows, k)
        atomic_write(args.out, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    else:
        write_json(args.out, {"checkpoint": predictor.source, "classes": predictor.classes_from,
                              "top_k": k, "skipped": skipped, "predictions": rows})
    print(f"{len(rows)} images classified, {len(skipped)} skipped (cannot be decoded) -> {args.out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
