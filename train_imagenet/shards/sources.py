"""What ``--src`` is, found from what is on disk, and its samples for one split.

==========================  =====================================================  ===========
kind                        what ``--src`` names                                   labels
==========================  =====================================================  ===========
``folders``                 ``SRC/<class>/**/<image>`` (torchvision ImageFolder)   the folder
``flat``                    ``SRC/<image>`` with ``--labels`` (or ``--devkit``)    the file
``imagenet-train-tar``      ``ILSVRC2012_img_train.tar``: a tar of per-class tars  the inner tar
``imagenet-tar``            ``ILSVRC2012_img_val.tar``: a tar of images            ``--labels``/``--devkit``
``timm-wds``                timm's WebDataset release: ``_info.json``/``.yaml``,   ``.cls``
                            ``imagenet1k-{train,validation}-NNNN.tar``
``parquet``                 the Hugging Face Parquet release: ``data/*.parquet``   ``label``
``torchvision``             torchvision's prepared ``ImageNet`` root (``meta.bin``,  the folder
                            ``train/``, ``val/``)
``kaggle``                  Kaggle's ILSVRC root: ``LOC_synset_mapping.txt``,      folder / CSV
                            ``LOC_val_solution.csv``, ``ILSVRC/Data/CLS-LOC/``
==========================  =====================================================  ===========

A root that holds several splits (timm, Parquet, torchvision, Kaggle) gives the one that
``--split`` names (``val`` reads timm's and Hugging Face's ``validation``).
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from train_imagenet.data import parquet as data_parquet
from train_imagenet.data import timm_wds

from . import archives, parquet
from .folders import _check_source, flat_images, known_classes, scan_class_folders
from train_imagenet.data.labels import read_class_names, read_label_names, read_labels
from .plan import ConversionError

KAGGLE_MAPPING = "LOC_synset_mapping.txt"
KAGGLE_VAL_LABELS = "LOC_val_solution.csv"
KAGGLE_IMAGES = Path("ILSVRC") / "Data" / "CLS-LOC"
ALIASES = {"val": ("validation",), "validation": ("val",)}  # one split, two names


@dataclass
class Listing:
    kind: str
    classes: list[str]
    members: list[tuple]   # (relative path, label, file, size, at): see plan.Sample
    source: str            # recorded as the split's "source"


@dataclass
class Options:
    classes: str | None = None
    labels: str | None = None
    label_offset: int = 0
    label_names: str | None = None
    devkit: str | None = None


def source_kind(src: Path, labels: bool) -> str:
    """The kind of ``src`` (see the module docstring); ``labels``: a labels file was given."""
    if not src.exists():
        raise ConversionError(f"--src {src} does not exist; pass an image folder, an ILSVRC2012_img_*.tar "
                              "or a dataset root (docs/data.md lists the sources)")
    if src.is_file():
        if src.suffix == ".tar":
            return "imagenet-train-tar" if archives.tar_kind(src) == "class-tars" else "imagenet-tar"
        if src.suffix == ".parquet":
            return "parquet"
        raise ConversionError(f"--src {src} is a file but no .tar or .parquet; pass the folder that "
                              "holds the images, or an uncompressed ILSVRC2012_img_*.tar")
    names = set(os.listdir(src))
    if timm_wds.is_timm(str(src), sorted(n for n in names if n.endswith(".tar"))):
        return "timm-wds"
    if data_parquet.files_of(str(src)):
        return "parquet"
    if "meta.bin" in names and {"train", "val"} & names:
        return "torchvision"
    if KAGGLE_MAPPING in names or (src / KAGGLE_IMAGES).is_dir():
        return "kaggle"
    return "flat" if labels else "folders"


def _classes(opts: Options) -> list[str] | None:
    return read_class_names(Path(opts.classes)) if opts.classes else None


def _folder_members(root: Path, items) -> list[tuple]:
    return [(path.relative_to(root).as_posix(), label, real, os.stat(real).st_size, ())
            for path, real, label in items]


def _labelled(members: list[tuple], opts: Options, classes: list[str] | None, where: Path,
              stack: ExitStack, labels: Path | None = None) -> tuple[list[str], list[tuple]]:
    """(classes, members with their labels) of flat images, from ``--labels`` (or ``labels``,
    a layout's own file) or ``--devkit``."""
    labels = Path(opts.labels) if opts.labels else labels
    if opts.devkit and labels:
        raise ConversionError("pass --devkit or --labels, not both (--devkit reads its "
                              "ILSVRC2012_validation_ground_truth.txt and meta.mat)")
    images = [PurePosixPath(m[0]) for m in members]
    if opts.devkit:
        truth, meta = stack.enter_context(archives.devkit_labels(Path(opts.devkit)))
        names = read_label_names(meta)
        classes = classes or sorted(names)  # train's order: the sorted WNIDs
        found = read_labels(truth, images, classes, 1, names)
    elif not labels:
        raise ConversionError(f"{where} holds images without classes: pass --labels FILE (or --devkit "
                              "ILSVRC2012_devkit_t12.tar.gz) and --classes, e.g. the train split's classes.json")
    elif classes is None:
        raise ConversionError("the flat layout (--labels) needs --classes: pass the classes.json "
                              "written for the train split so both splits share class indices")
    else:
        names = read_label_names(Path(opts.label_names)) if opts.label_names else None
        found = read_labels(labels, images, classes, opts.label_offset, names)
    return classes, [(r, y, p, s, a) for (r, _, p, s, a), y in zip(members, found)]


def _index_labels(members: list[tuple], classes: list[str] | None, src: Path, hint: str) -> list[str]:
    """Checks integer labels against ``classes`` (which a source of class indices needs)."""
    if classes is None:
        raise ConversionError(f"{src} holds class indices but no class names; pass --classes FILE ({hint})")
    top = max(m[1] for m in members)
    if top >= len(classes) or min(m[1] for m in members) < 0:
        raise ConversionError(f"{src} has label {top}, out of range for the {len(classes)} names of --classes "
                              f"{'' if not hint else '(' + hint + ')'}")
    return classes


def _chooser(src: Path, split: str):
    """The ``choose`` of the trainer's resolvers (`train_imagenet.data`): ``split`` or its
    other name among the splits a root holds; none of them is an error naming ``--split``."""
    def choose(have: list[str]) -> str:
        for name in (split, *ALIASES.get(split, ())):
            if name in have:
                return name
        raise ConversionError(f"--src {src} holds the splits {have}, not {split}; pass --split "
                              "with one of them")
    return choose


# One function a kind: (src, split, --classes or None, options, exit stack) -> Listing
def _folders(src, split, classes, opts, stack, kind="folders") -> Listing:
    _check_source(src)
    classes, items = scan_class_folders(src, classes)
    return Listing(kind, classes, _folder_members(src, items), str(src.resolve()))


def _flat(src, split, classes, opts, stack, kind="flat", labels=None) -> Listing:
    _check_source(src)
    members = [(path.name, None, real, os.stat(real).st_size, ()) for path, real in flat_images(src)]
    classes, members = _labelled(members, opts, classes, src, stack, labels)
    return Listing(kind, classes, members, str(src.resolve()))


def _torchvision(src, split, classes, opts, stack) -> Listing:
    folder = src / ("train" if split == "train" else "val")
    if not folder.is_dir():
        raise ConversionError(f"torchvision's ImageNet root {src} has no {folder.name}/ folder for --split {split}")
    if classes is None and split != "train" and (src / "train").is_dir():
        classes = sorted(p.name for p in (src / "train").iterdir() if p.is_dir() and not p.name.startswith("."))
    return _folders(folder, split, classes, opts, stack, "torchvision")


def _kaggle(src, split, classes, opts, stack) -> Listing:
    mapping = src / KAGGLE_MAPPING
    classes = classes or (read_class_names(mapping) if mapping.is_file() else None)
    if split == "train":
        return _folders(src / KAGGLE_IMAGES / "train", split, classes, opts, stack, "kaggle")
    if split == "val":
        if classes is None:
            raise ConversionError(f"{src} has no {KAGGLE_MAPPING}; pass --classes FILE")
        return _flat(src / KAGGLE_IMAGES / "val", split, classes, opts, stack, "kaggle", src / KAGGLE_VAL_LABELS)
    raise ConversionError(f"Kaggle's ILSVRC holds labels for train and val only, not --split {split}")


def _class_tars(src, split, classes, opts, stack) -> Listing:
    names, members = archives.class_tar_members(src)
    classes = known_classes(names, classes, "class tar(s)", src)
    index = {n: i for i, n in enumerate(classes)}
    return Listing("imagenet-train-tar", classes, [(r, index[c], p, s, a) for r, c, p, s, a in members],
                   str(src.resolve()))


def _image_tar(src, split, classes, opts, stack) -> Listing:
    members = archives.image_members(src)
    if not members:
        raise ConversionError(f"{src} holds no images")
    classes, members = _labelled(members, opts, classes, src, stack)
    return Listing("imagenet-tar", classes, members, str(src.resolve()))


def _timm(src, split, classes, opts, stack) -> Listing:
    found = timm_wds.resolve(str(src), "--src", _chooser(src, split))
    members = archives.wds_members([Path(f) for f in found.shards])
    if found.num_samples is not None and found.num_samples != len(members):
        raise ConversionError(f"{src}: _info says {found.split} holds {found.num_samples} samples, "
                              f"its shards hold {len(members)}; the download is incomplete or _info "
                              "belongs elsewhere")
    classes = _index_labels(members, classes, src, "for ImageNet-1k: LOC_synset_mapping.txt or the "
                                                  "classes.json of a converted split")
    return Listing("timm-wds", classes, members, str(src.resolve()))


def _parquet(src, split, classes, opts, stack) -> Listing:
    if src.is_file():
        files, card = [src], data_parquet.card_classes(str(src.parent.parent))
    else:
        found = data_parquet.resolve(str(src), "--src", _chooser(src, split))
        files, card = [Path(f) for f in found.shards], found.classes
    members = parquet.parquet_members(files)
    classes = _index_labels(members, classes or card, src, "the dataset card README.md names none")
    return Listing("parquet", classes, members, str(src.resolve()))


READERS = {"folders": _folders, "flat": _flat, "imagenet-train-tar": _class_tars, "imagenet-tar": _image_tar,
           "timm-wds": _timm, "parquet": _parquet, "torchvision": _torchvision, "kaggle": _kaggle}


def list_source(src: Path, split: str, opts: Options, stack: ExitStack) -> Listing:
    """The samples of ``split`` of ``src``, with the class names that index their labels."""
    kind = source_kind(src, bool(opts.labels or opts.devkit))
    return READERS[kind](src, split, _classes(opts), opts, stack)
