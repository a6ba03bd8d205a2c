"""Image folders as sources: class folders (torchvision ``ImageFolder``) and a flat folder.

* class folders: ``SRC/<class_name>/**/<image>``; class index = position of the folder name
  in the sorted list of folder names (torchvision's convention); links are followed, but a
  link that would read a folder or file twice (a loop, a link into another class folder) or
  leads nowhere is refused, so each file is read once, labelled by the class folder it is
  listed in;
* a flat folder (the ImageNet val layout): ``SRC/<image>``, labelled by a labels file
  (`labels.read_labels`).
"""
from __future__ import annotations

import os
from pathlib import Path

from dcvit.schema import IMAGE_EXTENSIONS

from train_imagenet.data.labels import read_labels
from .plan import ConversionError
from .write import warn as _warn

# Files with other suffixes are not images and are ignored (dcvit.schema: torchvision's list).
IMG_EXTENSIONS = tuple("." + ext for ext in IMAGE_EXTENSIONS)


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS) and not name.startswith(".")


def _images_below(folder: Path, seen: dict[str, str], linked: dict[str, str],
                  problems: list[str]) -> list[tuple[Path, str]]:
    """(path, real path) of the image files under ``folder``, sorted; hidden names skipped.

    Links are followed, but nothing is read twice: ``seen`` maps each real folder read so
    far (the source root and every class folder included) to the path that reached it
    first, ``linked`` each real file reached through a link; a link to one of them (a loop
    such as ``ln -s .. SRC/1/loop``, a link into another class folder, a second link to one
    file) is added to ``problems``, as is a link to nothing and an image name that is no
    regular file. (`_linked_twice` finds links to files that are also read where they lie.)
    """
    found = []
    stack = [(folder, os.path.realpath(folder))]
    while stack:
        here, real_here = stack.pop()
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError as e:
            problems.append(f"cannot list {here} ({e.strerror})")
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = here / entry.name
            link = entry.is_symlink()
            real = os.path.realpath(path) if link else os.path.join(real_here, entry.name)
            if link and not os.path.exists(real):
                problems.append(f"{path} -> {os.readlink(path)}: the link's target does not exist")
            elif entry.is_dir():
                if real in seen:
                    problems.append(f"{path}{f' -> {real}' if link else ''}: already read as {seen[real]}")
                else:
                    seen[real] = str(path)
                    stack.append((path, real))
            elif not _is_image(entry.name):
                continue
            elif not entry.is_file():
                problems.append(f"{path} is not a regular file")
            elif link and real in linked:
                problems.append(f"{path} -> {real}: already read as {linked[real]}")
            else:
                if link:
                    linked[real] = str(path)
                found.append((path, real))
    return sorted(found)


def _linked_twice(seen: dict[str, str], linked: dict[str, str]) -> list[str]:
    """Links to image files that are read where they lie as well (in a folder of ``seen``)."""
    problems = []
    for real, path in sorted(linked.items(), key=lambda kv: kv[1]):
        folder, name = os.path.split(real)
        if folder in seen and _is_image(name):
            problems.append(f"{path} -> {real}: already read as {os.path.join(seen[folder], name)}")
    return problems


def _refuse_links(src: Path, problems: list[str]) -> None:
    if problems:
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ConversionError(
            f"{len(problems)} path(s) in {src} cannot be read as exactly one image each:\n  "
            + "\n  ".join(problems[:10]) + more + "\nremove or fix these links (a link is followed "
            "only to a folder or file that nothing else under --src reaches), then re-run")


def _check_source(src: Path) -> None:
    if not src.exists():
        raise ConversionError(f"source folder {src} does not exist; pass --src IMAGEFOLDER_ROOT")
    if not src.is_dir():
        raise ConversionError(f"--src {src} is a file; pass the folder that holds the images")
    if not any(p for p in src.iterdir() if not p.name.startswith(".")):
        raise ConversionError(f"source folder {src} is empty")


def scan_class_folders(src: Path, classes: list[str] | None) -> tuple[list[str], list[tuple[Path, str, int]]]:
    """(class names, [(file, real path, label)]) for ``SRC/<class>/**/<image>``: the label is
    the class folder the file is listed in, and each real file is read once (`_images_below`)."""
    folders = sorted(p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith("."))
    loose = [p.name for p in src.iterdir() if p.is_file() and _is_image(p.name)]
    if not folders:
        hint = (f" ({len(loose)} images lie directly in it: for the flat ImageNet val layout "
                "pass --labels FILE and --classes classes.json)") if loose else ""
        raise ConversionError(f"no class folders in {src}{hint}; expected SRC/<class_name>/<image>")
    if loose:
        _warn(f"ignoring {len(loose)} images directly in {src} (not in a class folder)")
    if classes is None:
        classes = folders
    else:
        unknown = [f for f in folders if f not in set(classes)]
        if unknown:
            raise ConversionError(f"class folder(s) {unknown[:5]} of {src} are not in --classes "
                                  f"({len(classes)} names); use the classes.json of the same dataset")
    index = {name: i for i, name in enumerate(classes)}
    root = os.path.realpath(src)
    seen: dict[str, str] = {root: str(src)}
    problems = [f"{p} -> {os.readlink(p)}: the link's target does not exist"
                for p in sorted(src.iterdir())
                if p.is_symlink() and not p.exists() and not p.name.startswith(".")]
    for name in folders:  # every class folder is claimed before any is read
        real = os.path.realpath(src / name)
        if real in seen:
            problems.append(f"{src / name} -> {real}: already read as {seen[real]}")
        seen.setdefault(real, str(src / name))
    items: list[tuple[Path, str, int]] = []
    linked: dict[str, str] = {}
    for name in folders:
        files = _images_below(src / name, seen, linked, problems)
        if not files and not problems:
            _warn(f"class folder {src / name} holds no images (extensions {', '.join(IMG_EXTENSIONS)})")
        items.extend((path, real, index[name]) for path, real in files)
    del seen[root]  # its loose images are not read
    _refuse_links(src, problems + _linked_twice(seen, linked))
    if not items:
        raise ConversionError(f"no images found under {src} (looked for {', '.join(IMG_EXTENSIONS)})")
    return classes, items


def scan_flat(src: Path, labels_file: Path, classes: list[str], offset: int,
              names: list[str] | None = None) -> list[tuple[Path, str, int]]:
    """[(file, real path, label)] for the images directly in ``src``, labelled by ``labels_file``."""
    _refuse_links(src, [f"{p} -> {os.readlink(p)}: the link's target does not exist"
                        for p in sorted(src.iterdir()) if p.is_symlink() and not p.exists()])
    images = sorted(p for p in src.iterdir() if p.is_file() and _is_image(p.name))
    if not images:
        raise ConversionError(f"no images found directly in {src} for the flat layout of --labels "
                              f"(looked for {', '.join(IMG_EXTENSIONS)})")
    labels = read_labels(labels_file, images, classes, offset, names)
    return [(p, os.path.realpath(p), label) for p, label in zip(images, labels)]
