"""Image folders as sources: class folders (torchvision ``ImageFolder``) and a flat folder.

* class folders: ``SRC/<class_name>/**/<image>``; class index = position of the folder name
  in the sorted list of folder names (torchvision's convention); links are followed, but a
  link that would read a folder or file twice (a loop, a link into another class folder) or
  leads nowhere is refused, so each file is read once, labelled by the class folder it is
  listed in;
* a flat folder (the ImageNet val layout): ``SRC/<image>``, labelled by a labels file
  (`sources`). The walk and its rule for links are
  `train_imagenet.images.ImageWalk`, which the predictor uses too.
"""
from __future__ import annotations

import os
from pathlib import Path

from train_imagenet.images import IMAGE_SUFFIXES, FolderError, ImageWalk, is_image_name, refuse

from .plan import ConversionError
from .write import warn as _warn

# Files with other suffixes are not images and are ignored (dcvit.schema: torchvision's list).
IMG_EXTENSIONS = IMAGE_SUFFIXES


def _refuse_links(src: Path, problems: list[str]) -> None:
    try:
        refuse(src, problems, "--src")
    except FolderError as e:
        raise ConversionError(str(e)) from None


def known_classes(found: list[str], classes: list[str] | None, what: str, src: Path) -> list[str]:
    """``classes`` (``--classes``), which must name every class ``found`` in ``src``, or the
    ``found`` names themselves (sorted: torchvision's order)."""
    if classes is None:
        return sorted(found)
    unknown = [f for f in found if f not in set(classes)]
    if unknown:
        raise ConversionError(f"{what} {unknown[:5]} of {src} are not in --classes "
                              f"({len(classes)} names); use the classes of the same dataset")
    return classes


def _check_source(src: Path) -> None:
    if not src.exists():
        raise ConversionError(f"source folder {src} does not exist; pass --src IMAGEFOLDER_ROOT")
    if not src.is_dir():
        raise ConversionError(f"--src {src} is a file; pass the folder that holds the images")
    if not any(p for p in src.iterdir() if not p.name.startswith(".")):
        raise ConversionError(f"source folder {src} is empty")


def scan_class_folders(src: Path, classes: list[str] | None) -> tuple[list[str], list[tuple[Path, str, int]]]:
    """(class names, [(file, real path, label)]) for ``SRC/<class>/**/<image>``: the label is
    the class folder the file is listed in, and each real file is read once (`train_imagenet.images.ImageWalk`)."""
    folders = sorted(p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith("."))
    loose = [p.name for p in src.iterdir() if p.is_file() and is_image_name(p.name)]
    if not folders:
        hint = (f" ({len(loose)} images lie directly in it: for the flat ImageNet val layout "
                "pass --labels FILE and --classes classes.json)") if loose else ""
        raise ConversionError(f"no class folders in {src}{hint}; expected SRC/<class_name>/<image>")
    if loose:
        _warn(f"ignoring {len(loose)} images directly in {src} (not in a class folder)")
    classes = known_classes(folders, classes, "class folder(s)", src)
    index = {name: i for i, name in enumerate(classes)}
    walk = ImageWalk()   # train_imagenet.images: the one rule for links, shared with the predictor
    walk.claim(src)
    walk.problems.extend(f"{p} -> {os.readlink(p)}: the link's target does not exist"
                         for p in sorted(src.iterdir())
                         if p.is_symlink() and not p.exists() and not p.name.startswith("."))
    for name in folders:  # every class folder is claimed before any is read
        walk.claim(src / name)
    items: list[tuple[Path, str, int]] = []
    for name in folders:
        files = walk.files(src / name)
        if not files and not walk.problems:
            _warn(f"class folder {src / name} holds no images (extensions {', '.join(IMG_EXTENSIONS)})")
        items.extend((path, real, index[name]) for path, real in files)
    walk.forget(src)  # its loose images are not read
    _refuse_links(src, walk.all_problems())
    if not items:
        raise ConversionError(f"no images found under {src} (looked for {', '.join(IMG_EXTENSIONS)})")
    return classes, items


def flat_images(src: Path) -> list[tuple[Path, str]]:
    """(file, real path) of the images directly in ``src``, sorted by name."""
    _refuse_links(src, [f"{p} -> {os.readlink(p)}: the link's target does not exist"
                        for p in sorted(src.iterdir()) if p.is_symlink() and not p.exists()])
    images = sorted(p for p in src.iterdir() if p.is_file() and is_image_name(p.name))
    if not images:
        raise ConversionError(f"no images found directly in {src} for the flat layout of --labels "
                              f"(looked for {', '.join(IMG_EXTENSIONS)})")
    return [(p, os.path.realpath(p)) for p in images]
