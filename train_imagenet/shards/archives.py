"""Images inside uncompressed tars, read where they lie: no extraction.

* ``ILSVRC2012_img_train.tar`` from image-net.org: a tar of per-class tars
  (``n01440764.tar`` ...), each a flat tar of that class's JPEGs;
* ``ILSVRC2012_img_val.tar``: a flat tar of images, labelled by a labels file or by the
  devkit (`devkit_labels`);
* WebDataset shards (timm's ``timm/imagenet-1k-wds`` release): samples of an image and a
  ``.cls`` member.

A listing reads only the tar headers (and the small ``.cls`` members): `tarfile` seeks
over the image data, inner tars included, so listing the 140 GB train archive reads its
1.28 M header blocks. Each image is then one `Sample` holding the tar's path and the byte
offset of its data; the writers read exactly those bytes (``os.pread``), in whatever order
the shard plan asks, so the train split is shuffled across shards as from a folder. The
memory used is that of the sample list, as for a folder of the same images.
"""
from __future__ import annotations

import os
import tarfile
import tempfile
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Iterator

from dcvit.schema import IMAGE_EXTENSIONS, LABEL_EXTENSION
from train_imagenet.images import is_image_name

from .plan import ConversionError

# (relative path, label or class name, tar path, size, (offset,)): one image of a tar
Member = tuple


def _is_image(name: str) -> bool:
    return is_image_name(PurePosixPath(name).name)


def _open(path: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(path, mode="r:")  # uncompressed only: its members are byte ranges
    except (OSError, tarfile.TarError) as e:
        raise ConversionError(f"cannot read {path} as an uncompressed tar ({getattr(e, 'strerror', None) or e}); "
                              "--src takes the archives as image-net.org ships them (ILSVRC2012_img_train.tar, "
                              "ILSVRC2012_img_val.tar), or a folder") from None


def _files(tar: tarfile.TarFile, where: Path) -> list[tarfile.TarInfo]:
    try:
        members = tar.getmembers()
    except (OSError, tarfile.TarError) as e:
        raise ConversionError(f"{where} cannot be read to its end ({e}): the file is truncated or "
                              "damaged; download it again (image-net.org lists its MD5)") from None
    return [m for m in members if m.isfile() and not m.issparse()]


def tar_kind(path: Path) -> str:
    """``'class-tars'`` (a tar of per-class tars, ILSVRC2012_img_train.tar) or ``'images'``."""
    with _open(path) as tar:
        names = [m.name for m in _files(tar, path)]
    tars = [n for n in names if n.endswith(".tar")]
    images = [n for n in names if _is_image(n)]
    if tars and images:
        raise ConversionError(f"{path} holds both tars ({tars[0]}, ...) and images ({images[0]}, ...); "
                              "expected ILSVRC2012_img_train.tar (per-class tars) or a tar of images")
    if not tars and not images:
        raise ConversionError(f"{path} holds no images and no per-class tars")
    return "class-tars" if tars else "images"


def class_tar_members(path: Path) -> tuple[list[str], list[Member]]:
    """(class names in sorted order, images) of a tar of per-class tars; each image's
    relative path is ``<class>/<file>``, as in the folder the archive extracts to."""
    found: list[Member] = []
    where = str(path)  # one string shared by every sample
    with _open(path) as tar:
        inner_tars = sorted((m for m in _files(tar, path) if m.name.endswith(".tar")), key=lambda m: m.name)
        for outer in inner_tars:
            name = PurePosixPath(outer.name).name[:-len(".tar")]
            try:
                with tarfile.open(fileobj=tar.extractfile(outer), mode="r:") as inner:
                    files = _files(inner, Path(f"{path}:{outer.name}"))
            except tarfile.TarError as e:
                raise ConversionError(f"{path}: member {outer.name} is not a readable tar ({e}); "
                                      "download the archive again") from None
            for m in sorted(files, key=lambda m: m.name):
                if _is_image(m.name):
                    found.append((f"{name}/{m.name}", name, where, m.size, (outer.offset_data + m.offset_data,)))
    names = sorted({f[1] for f in found})
    if not found:
        raise ConversionError(f"{path}: its per-class tars hold no images")
    return names, found


def image_members(path: Path) -> list[Member]:
    """The images of a flat tar, sorted by name (label ``None``: a labels file gives them)."""
    with _open(path) as tar:
        files = sorted((m for m in _files(tar, path) if _is_image(m.name)), key=lambda m: m.name)
    where = str(path)
    return [(m.name, None, where, m.size, (m.offset_data,)) for m in files]


def wds_members(shards: list[Path]) -> list[Member]:
    """The samples of WebDataset shards, in shard order: (key, label from ``.cls``, ...).

    Member names split into key and extension at the first dot of the base name, as
    webdataset does; a sample needs one image and one ``.cls``."""
    found: list[Member] = []
    for shard in shards:
        where = str(shard)
        with _open(shard) as tar:
            samples: dict[str, dict] = {}
            for m in _files(tar, shard):
                folder, _, base = m.name.rpartition("/")
                if "." not in base:
                    continue
                stem, ext = base.split(".", 1)
                samples.setdefault(f"{folder}/{stem}" if folder else stem, {})[ext.lower()] = m
            for key, parts in samples.items():
                images = [e for e in parts if e in IMAGE_EXTENSIONS]
                if len(images) != 1 or LABEL_EXTENSION not in parts:
                    raise ConversionError(f"{shard}: sample {key} has {len(images)} images and "
                                          f"{'a' if LABEL_EXTENSION in parts else 'no'} .cls; each sample "
                                          "needs one image and its .cls")
                text = tar.extractfile(parts[LABEL_EXTENSION]).read().decode("ascii", "replace").strip()
                if not text.isdigit() or not text.isascii():
                    raise ConversionError(f"{shard}: sample {key} has .cls {text!r}, not a class index")
                image = parts[images[0]]
                found.append((key, int(text), where, image.size, (image.offset_data,)))
    return found


DEVKIT_TRUTH = "data/ILSVRC2012_validation_ground_truth.txt"
DEVKIT_META = "data/meta.mat"


@contextmanager
def devkit_labels(devkit: Path) -> Iterator[tuple[Path, Path]]:
    """(ground truth file, meta.mat) of the ILSVRC2012 devkit: its folder
    (``ILSVRC2012_devkit_t12``) or its archive (``ILSVRC2012_devkit_t12.tar.gz``), whose two
    small files are read into a temporary folder for the length of the block."""
    if devkit.is_dir():
        truth, meta = devkit / DEVKIT_TRUTH, devkit / DEVKIT_META
        missing = [str(p) for p in (truth, meta) if not p.is_file()]
        if missing:
            raise ConversionError(f"--devkit {devkit} lacks {', '.join(missing)}; give the "
                                  "ILSVRC2012_devkit_t12 folder or ILSVRC2012_devkit_t12.tar.gz")
        yield truth, meta
        return
    try:
        tar = tarfile.open(devkit, mode="r:*")
    except (OSError, tarfile.TarError) as e:
        raise ConversionError(f"--devkit {devkit}: not a folder or a readable tar ({getattr(e, 'strerror', None) or e}); "
                              "give the ILSVRC2012_devkit_t12 folder or ILSVRC2012_devkit_t12.tar.gz") from None
    with tar, tempfile.TemporaryDirectory(prefix="dcvit-devkit-") as tmp:
        wanted = {}
        for m in tar.getmembers():
            for part in (DEVKIT_TRUTH, DEVKIT_META):
                if m.isfile() and (m.name == part or m.name.endswith("/" + part)):
                    wanted[part] = m
        missing = [p for p in (DEVKIT_TRUTH, DEVKIT_META) if p not in wanted]
        if missing:
            raise ConversionError(f"--devkit {devkit} holds no {', '.join(missing)}; give the "
                                  "ILSVRC2012 devkit (ILSVRC2012_devkit_t12.tar.gz)")
        paths = []
        for part in (DEVKIT_TRUTH, DEVKIT_META):
            target = Path(tmp) / os.path.basename(part)
            target.write_bytes(tar.extractfile(wanted[part]).read())
            paths.append(target)
        yield paths[0], paths[1]
