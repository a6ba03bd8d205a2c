"""The files the library and the trainer exchange, described once: both sides import this module.

* ``eval.json`` (`EvalResult`): written by ``python -m train_imagenet`` after an evaluation,
  read by ``dcvit-report``.
* Shard metadata (`ShardMeta`, ``DIR/<split>.json``): written by
  ``scripts/make_wds_shards.py`` beside ``DIR/<split>-NNNNNN.tar``, read by
  ``train_imagenet.data`` to count samples without listing the tars.
* `IMAGE_EXTENSIONS`: the files taken as images, in a source folder and as members of a
  shard sample.

Only the standard library is imported here, so a reader of these files needs nothing else.
"""
import os
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional

__all__ = ["SchemaError", "EvalResult", "ShardMeta", "IMAGE_EXTENSIONS", "LABEL_EXTENSION",
           "CLASSES_FILE", "shard_name", "split_of", "metadata_path", "check_split", "split_names"]

# torchvision's IMG_EXTENSIONS without the dots (so a source folder holds the same images for
# ImageFolder and for the shard writer). The writer stores JPEG and PNG as they are and
# re-encodes the others to PNG; a reader decodes any of them with PIL.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp")
LABEL_EXTENSION = "cls"            # <key>.cls: the class index as ASCII digits
CLASSES_FILE = "classes.json"      # class names in index order, beside the shards


class SchemaError(ValueError):
    """A file's content does not match its schema; the message names the key and the value."""


def _check_type(where: str, key: str, value: Any, kinds: tuple, what: str) -> None:
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
        raise SchemaError(f"{where}: {key}={value!r} is not {what}")


# ---------------------------------------------------------------------------------- eval.json
@dataclass
class EvalResult:
    """One evaluation of one model (``eval.json``; ``eval_ema.json`` for EMA weights).

    ``model``, ``model_kwargs``, ``img_size`` and ``num_classes`` rebuild the evaluated
    configuration (``timm.create_model(model, img_size=..., num_classes=..., **model_kwargs)``);
    ``top1``/``top5`` are percentages over ``num_samples`` images of ``val``. A run that
    converted a pretrained model to DCMHA records the conversion in ``convert``
    (``{"layers": ..., "options": {...}}``, rebuilt by `dcvit.convert`); an evaluation during
    training (``eval-eNNNN.json``) records its ``epoch``. ``corrupt_skipped`` counts the
    samples of ``val`` that could not be decoded and were left out of ``num_samples`` (the
    split holds ``num_samples + corrupt_skipped``). Keys this
    class does not know are kept in ``extra`` and written back.
    """

    model: str
    top1: float
    top5: Optional[float] = None
    num_samples: Optional[int] = None
    loss: Optional[float] = None
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    img_size: Optional[int] = None
    num_classes: Optional[int] = None
    checkpoint: Optional[str] = None
    ema: Optional[bool] = None
    val: Optional[str] = None
    dataset: Optional[str] = None
    convert: Optional[Dict[str, Any]] = None
    epoch: Optional[int] = None
    corrupt_skipped: Optional[int] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    REQUIRED = ("model", "top1")

    def to_dict(self) -> Dict[str, Any]:
        """The JSON object: every field (None as null), then the ``extra`` keys."""
        return {**{k: v for k, v in asdict(self).items() if k != "extra"}, **self.extra}

    @classmethod
    def from_dict(cls, data: Any, where: str = "eval.json") -> "EvalResult":
        """Check ``data`` (a parsed ``eval.json``); `SchemaError` names the bad key and value."""
        if not isinstance(data, dict):
            raise SchemaError(f"{where} holds a {type(data).__name__}, expected an object "
                              '{"model": ..., "top1": ..., "top5": ..., "num_samples": ...}')
        missing = [k for k in cls.REQUIRED if k not in data]
        if missing:
            raise SchemaError(f"{where} lacks {missing}; it has keys {sorted(data)}")
        if not isinstance(data["model"], str):
            raise SchemaError(f"{where}: model={data['model']!r} is not a timm model name")
        for key in ("top1", "top5"):
            value = data.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 <= value <= 100):
                raise SchemaError(f"{where}: {key}={value!r} is not a percentage in [0, 100]")
        for key in ("model_kwargs", "convert"):
            if data.get(key) is not None and not isinstance(data[key], dict):
                raise SchemaError(f"{where}: {key} must be an object, got {data[key]!r}")
        for key in ("num_samples", "img_size", "num_classes", "epoch", "corrupt_skipped"):
            _check_type(where, key, data.get(key), (int,), "an integer")
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        known["model_kwargs"] = known.get("model_kwargs") or {}
        return cls(**known, extra={k: v for k, v in data.items() if k not in names})


# ---------------------------------------------------------------------------------- shards
def shard_name(split: str, index: int) -> str:
    """``train, 3`` -> ``train-000003.tar``."""
    return f"{split}-{index:06d}.tar"


def split_of(shard: str) -> str:
    """The split a shard belongs to: ``DIR/train-000003.tar`` -> ``train`` (split names hold no '-')."""
    return os.path.basename(shard.rstrip("/")).split("-")[0]


def metadata_path(shard: str) -> str:
    """Where the metadata of ``shard``'s split lives: ``DIR/train-000003.tar`` -> ``DIR/train.json``."""
    return os.path.join(os.path.dirname(shard), split_of(shard) + ".json")


def check_split(split: str) -> Optional[str]:
    """None if ``split`` can name a split, else the reason (letters, digits and '_' only)."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", split) or split == os.path.splitext(CLASSES_FILE)[0]:
        return f"{split!r}: use letters, digits and '_' only (and not 'classes')"
    return None


def split_names(folder: str) -> List[str]:
    """The splits with metadata in ``folder``: ``<split>.json`` files whose name can name a
    split (`check_split`), sorted. Hidden files such as the trainer's shard-check cache
    (``.dcvit-shard-check.json``) and ``classes.json`` are not splits."""
    names = [n[:-len(".json")] for n in os.listdir(folder) if n.endswith(".json")]
    return sorted(n for n in names if check_split(n) is None)


@dataclass
class ShardMeta:
    """``DIR/<split>.json``: what the shards of one split hold.

    ``shards`` are file names in ``DIR`` (`shard_name`), ``samples_per_shard`` and
    ``shard_bytes`` in the same order; ``pattern`` is their brace pattern relative to
    ``DIR``; ``classes`` names the class-name file. ``seed`` is the shuffle seed (None when
    the samples were not shuffled). ``source`` is the absolute path of the folder the
    samples came from (a conversion from another folder does not replace the split unless
    told to). Metadata written by other tools may hold only
    ``num_samples``; keys this class does not know are kept in ``extra``.
    """

    num_samples: int
    num_classes: Optional[int] = None
    shards: Optional[List[str]] = None
    samples_per_shard: Optional[List[int]] = None
    shard_bytes: Optional[List[int]] = None
    split: Optional[str] = None
    pattern: Optional[str] = None
    classes: Optional[str] = None
    shuffled: Optional[bool] = None
    seed: Optional[int] = None
    reencoded_to_png: Optional[int] = None
    source: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        """The JSON object: every field (None as null), then the ``extra`` keys."""
        return {**{k: v for k, v in asdict(self).items() if k != "extra"}, **self.extra}

    @classmethod
    def from_dict(cls, data: Any, where: str = "shard metadata") -> "ShardMeta":
        """Check ``data`` (a parsed ``<split>.json``); `SchemaError` names the bad key and value."""
        if not isinstance(data, dict):
            raise SchemaError(f"{where} holds a {type(data).__name__}, expected an object")
        if "num_samples" not in data:
            raise SchemaError(f"{where} lacks 'num_samples'; it has keys {sorted(data)}")
        for key in ("num_samples", "num_classes", "seed", "reencoded_to_png"):
            _check_type(where, key, data.get(key), (int,), "an integer")
        _check_type(where, "source", data.get("source"), (str,), "a folder path")
        for key, kind in (("shards", str), ("samples_per_shard", int), ("shard_bytes", int)):
            value = data.get(key)
            if value is not None and not (isinstance(value, list) and all(isinstance(v, kind) for v in value)):
                raise SchemaError(f"{where}: {key} must be a list of {kind.__name__}, got {value!r}")
        names = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in data.items() if k in names},
                   extra={k: v for k, v in data.items() if k not in names})
