"""Images as the model sees them: one decoder and one rule for walking a folder of images.

`open_image` turns whatever PIL opens into the 8-bit RGB picture the file shows:

* EXIF orientation is applied (``ImageOps.exif_transpose``), so a rotated phone photo is
  upright;
* 16-bit greyscale (``I;16``, ``I;16B``, ... and ``I``, which older Pillows use for 16-bit
  PNGs) is scaled from 0..65535 to 0..255 (``round(v / 257)``); an ``I`` pixel outside
  0..65535 is refused, as no 16-bit picture holds it;
* 32-bit float (``F``) is scaled from the range its pixels lie in: 0..1 if all of them do
  (the usual float-image convention), else 0..255 (PIL's own), else 0..65535; negative,
  larger or non-finite pixels are refused;
* transparency (``RGBA``, ``LA``, ``PA``, ``La``, ``RGBa``, a palette or a greyscale/RGB image
  with a transparent colour) is composited on `BACKGROUND`, white, as a browser shows it on
  a white page, so what is transparent is neither black nor the hidden colour beneath it;
* everything else (``1``, ``L``, ``P``, ``CMYK``, ``YCbCr``, ...) goes through PIL's own
  ``convert("RGB")``.

An image with more than `MAX_PIXELS` pixels (PIL's default bomb limit, made explicit) is
refused from its header, before its pixels are decoded, and PIL's
``DecompressionBombWarning`` is not shown. Every input that cannot be decoded raises
`ImageError` naming the file and the reason.

`image_files` lists the images below a folder (sub-folders included, hidden names skipped,
sorted). Links are followed, but nothing is read twice: a link to a folder or file that the
walk reaches anyway (a loop such as ``ln -s .. SRC/1/loop``, a link into another class folder,
a second link to one file), a link to nothing, and an image name that is no regular file are
refused with `FolderError`, listing them. ``scripts/make_wds_shards.py`` walks each class
folder with one shared `ImageWalk`, so the same rule holds across class folders; the
predictor walks its one folder.
"""
from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import BinaryIO, Dict, List, Optional, Tuple, Union

import numpy as np
from PIL import Image, ImageOps

from dcvit.schema import IMAGE_EXTENSIONS

__all__ = ["ImageError", "FolderError", "MAX_PIXELS", "BACKGROUND", "IMAGE_SUFFIXES", "open_image",
           "to_rgb", "is_image_name", "ImageWalk", "refuse", "image_files"]

MAX_PIXELS = 89_478_485          # width x height; PIL's default Image.MAX_IMAGE_PIXELS (~ 9459 x 9459)
BACKGROUND = (255, 255, 255)     # what transparent pixels are composited on
IMAGE_SUFFIXES = tuple("." + ext for ext in IMAGE_EXTENSIONS)   # torchvision's list, lower case

Source = Union[str, os.PathLike, BinaryIO, bytes, bytearray, memoryview]


class ImageError(ValueError):
    """An image that cannot be decoded, or is too large: ``str()`` is ``"NAME: REASON"``
    (``REASON`` alone without a name); both are attributes too."""

    def __init__(self, reason: str, name: Optional[str] = None) -> None:
        super().__init__(f"{name}: {reason}" if name is not None else reason)
        self.reason, self.name = reason, name


class FolderError(ValueError):
    """A folder whose files cannot each be read as exactly one image; the message lists them."""


# ---------------------------------------------------------------------------------- decoding
def _name_of(src: Source) -> str:
    if isinstance(src, (bytes, bytearray, memoryview)):
        return f"<{len(src)} bytes>"
    if isinstance(src, (str, os.PathLike)):
        return os.fsdecode(src)
    return str(getattr(src, "name", "<file object>"))


def open_image(src: Source, name: Optional[str] = None, max_pixels: Optional[int] = MAX_PIXELS,
               background: Tuple[int, int, int] = BACKGROUND) -> Image.Image:
    """The 8-bit RGB picture of ``src`` (a path, a binary file object or the file's bytes),
    upright; see the module docstring for each mode. ``name`` names the image in errors
    (default: the path, the file object's name, or the byte count). ``max_pixels=None``
    leaves only PIL's own bomb check (twice its limit). Raises `ImageError`."""
    name = _name_of(src) if name is None else name
    fp = io.BytesIO(bytes(src)) if isinstance(src, (bytes, bytearray, memoryview)) else src
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(fp)
    except Image.DecompressionBombError as e:
        raise ImageError(f"too large to decode ({e})", name) from None
    except Exception as e:            # PIL raises many types for files it cannot read
        raise ImageError(f"cannot be decoded ({type(e).__name__}: {e})", name) from e
    with im:
        width, height = im.size
        if max_pixels is not None and width * height > max_pixels:
            raise ImageError(f"{width}x{height} pixels ({width * height / 1e6:.1f} Mpx) is more than the "
                             f"limit of {max_pixels / 1e6:.1f} Mpx; downscale the image, or raise the "
                             f"limit (max_pixels, train_imagenet.images.MAX_PIXELS)", name)
        try:
            im.load()
            return to_rgb(_upright(im), background)
        except ImageError as e:
            raise ImageError(e.reason, name) from None
        except Exception as e:        # truncated data, broken EXIF, unsupported conversion ...
            raise ImageError(f"cannot be decoded ({type(e).__name__}: {e})", name) from e


def _upright(im: Image.Image) -> Image.Image:
    """``im`` turned as its EXIF orientation says (in place where Pillow can: no copy)."""
    try:
        ImageOps.exif_transpose(im, in_place=True)
        return im
    except TypeError:                 # Pillow < 9.4: no in_place
        return ImageOps.exif_transpose(im)


def to_rgb(im: Image.Image, background: Tuple[int, int, int] = BACKGROUND) -> Image.Image:
    """A new image in 8-bit RGB of the decoded ``im``, as it shows (module docstring); raises
    `ImageError` (without the file's name) for pixels no picture of its mode holds."""
    mode = im.mode
    if mode == "RGB":                 # a copy, as convert("RGB") makes: ``im`` may be closed
        return im.copy() if "transparency" not in im.info else _composite(im, background)
    if mode.startswith("I"):          # I, I;16, I;16B, I;16L, I;16N, I;16S, I;32 ...
        return _grey_to_rgb(_scaled(np.asarray(im).astype(np.float64), 65535.0, mode))
    if mode == "F":
        return _grey_to_rgb(_float_scaled(np.asarray(im, dtype=np.float64)))
    if mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in im.info:
        return _composite(im, background)
    return im.convert("RGB")


def _scaled(pixels: np.ndarray, top: float, mode: str) -> np.ndarray:
    low, high = (float(pixels.min()), float(pixels.max())) if pixels.size else (0.0, 0.0)
    if low < 0 or high > top:
        raise ImageError(f"{mode} pixels from {low:g} to {high:g} lie outside 0..{top:g}, the range "
                         f"this decoder reads them in; convert the image to 8 or 16 bits")
    return np.floor(pixels * (255.0 / top) + 0.5).astype(np.uint8)


def _float_scaled(pixels: np.ndarray) -> np.ndarray:
    if pixels.size and not np.isfinite(pixels).all():
        raise ImageError("F (32-bit float) pixels include NaN or infinity; save the image in 8 or 16 bits")
    high = float(pixels.max()) if pixels.size else 0.0
    top = 1.0 if high <= 1.0 else 255.0 if high <= 255.0 else 65535.0
    return _scaled(pixels, top, "F (32-bit float)")


def _grey_to_rgb(grey: np.ndarray) -> Image.Image:
    return Image.fromarray(np.ascontiguousarray(np.repeat(grey[:, :, None], 3, axis=2)))   # (H, W, 3) uint8


def _composite(im: Image.Image, background: Tuple[int, int, int]) -> Image.Image:
    rgba = im.convert("RGBA")
    base = Image.new("RGBA", rgba.size, tuple(background) + (255,))
    return Image.alpha_composite(base, rgba).convert("RGB")


# ------------------------------------------------------------------------------ folder walk
def is_image_name(name: str) -> bool:
    """An image file name: one of torchvision's suffixes (any case), not hidden."""
    return name.lower().endswith(IMAGE_SUFFIXES) and not name.startswith(".")


class ImageWalk:
    """One walk over folders of images in which each real folder and file is read once.

    ``seen`` maps each real folder read so far (or claimed with `claim`) to the path that
    reached it first, ``linked`` each real file reached through a link to that link;
    ``problems`` collects what cannot be read as exactly one image each."""

    def __init__(self) -> None:
        self.seen: Dict[str, str] = {}
        self.linked: Dict[str, str] = {}
        self.problems: List[str] = []

    def claim(self, folder: Path) -> None:
        """Mark ``folder`` as read at this path (a root, or a class folder before any is read);
        a folder that is already claimed under another path is a problem."""
        real = os.path.realpath(folder)
        if real in self.seen:
            self.problems.append(f"{folder} -> {real}: already read as {self.seen[real]}")
        self.seen.setdefault(real, str(folder))

    def forget(self, folder: Path) -> None:
        """Unclaim ``folder`` (a root whose loose files are not read)."""
        self.seen.pop(os.path.realpath(folder), None)

    def files(self, folder: Path) -> List[Tuple[Path, str]]:
        """(path, real path) of the image files under ``folder``, sorted; hidden names skipped."""
        found = []
        stack = [(Path(folder), os.path.realpath(folder))]
        while stack:
            here, real_here = stack.pop()
            try:
                entries = sorted(os.scandir(here), key=lambda e: e.name)
            except OSError as e:
                self.problems.append(f"cannot list {here} ({e.strerror})")
                continue
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                path = here / entry.name
                link = entry.is_symlink()
                real = os.path.realpath(path) if link else os.path.join(real_here, entry.name)
                if link and not os.path.exists(real):
                    self.problems.append(f"{path} -> {os.readlink(path)}: the link's target does not exist")
                elif entry.is_dir():
                    if real in self.seen:
                        self.problems.append(
                            f"{path}{f' -> {real}' if link else ''}: already read as {self.seen[real]}")
                    else:
                        self.seen[real] = str(path)
                        stack.append((path, real))
                elif not is_image_name(entry.name):
                    continue
                elif not entry.is_file():
                    self.problems.append(f"{path} is not a regular file")
                elif link and real in self.linked:
                    self.problems.append(f"{path} -> {real}: already read as {self.linked[real]}")
                else:
                    if link:
                        self.linked[real] = str(path)
                    found.append((path, real))
        return sorted(found)

    def all_problems(self) -> List[str]:
        """`problems`, and the links to image files that are read where they lie as well."""
        twice = []
        for real, path in sorted(self.linked.items(), key=lambda kv: kv[1]):
            folder, name = os.path.split(real)
            if folder in self.seen and is_image_name(name):
                twice.append(f"{path} -> {real}: already read as {os.path.join(self.seen[folder], name)}")
        return self.problems + twice

    def check(self, root: Path, what: str = "the folder") -> None:
        """`refuse` the problems, if any; ``what`` names ``root`` in the fix (e.g. ``--src``)."""
        refuse(root, self.all_problems(), what)


def refuse(root: Path, problems: List[str], what: str = "the folder") -> None:
    """Raise `FolderError` listing ``problems`` (the first ten) of ``root``, if there are any."""
    if problems:
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise FolderError(
            f"{len(problems)} path(s) in {root} cannot be read as exactly one image each:\n  "
            + "\n  ".join(problems[:10]) + more + f"\nremove or fix these links (a link is followed "
            f"only to a folder or file that nothing else under {what} reaches), then re-run")


def image_files(folder: Union[str, os.PathLike]) -> List[Tuple[Path, str]]:
    """(path, real path) of every image below ``folder``, sorted, by `ImageWalk`'s rule;
    raises `FolderError` for links that would read a file twice or lead nowhere."""
    root = Path(folder)
    walk = ImageWalk()
    walk.claim(root)
    found = walk.files(root)
    walk.check(root)
    return found
