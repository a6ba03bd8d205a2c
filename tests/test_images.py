"""train_imagenet.images: every mode PIL opens decodes to the 8-bit RGB the file shows, and one
rule walks a folder of images (links followed, nothing read twice)."""
import io
import os
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from train_imagenet.images import (BACKGROUND, MAX_PIXELS, FolderError, ImageError, image_files,
                                   open_image, to_rgb)


def _rgb(path_or_bytes, **kw) -> np.ndarray:
    im = open_image(path_or_bytes, **kw)
    assert im.mode == "RGB"
    return np.asarray(im).astype(np.int64)


def _grey(values) -> np.ndarray:
    """The expected RGB of greyscale values already on the 0..255 scale (float64, rounded)."""
    v = np.floor(np.asarray(values, dtype=np.float64) + 0.5).astype(np.int64)
    return np.repeat(v[..., None], 3, axis=-1)


def _over(colour, alpha, background=BACKGROUND) -> np.ndarray:
    """``colour`` at ``alpha`` (0..255) over ``background``, in float64, rounded."""
    a = np.asarray(alpha, dtype=np.float64)[..., None] / 255.0
    c = np.asarray(colour, dtype=np.float64)
    return np.floor(a * c + (1 - a) * np.asarray(background, dtype=np.float64) + 0.5).astype(np.int64)


LEVELS16 = np.array([[0, 257, 1000, 32767], [32896, 50000, 65278, 65535]], dtype=np.uint16)


def test_16bit_png_scales_to_8bit_not_clipped(tmp_path):
    path = tmp_path / "grey16.png"
    Image.fromarray(LEVELS16).save(path)           # a 16-bit greyscale PNG
    with Image.open(path) as im:
        assert im.mode in ("I;16", "I")            # what PIL opens it as (Pillow version)
    got = _rgb(path)
    np.testing.assert_array_equal(got, _grey(LEVELS16 / 257.0))
    assert got.max() == 255 and (got < 255).sum() == 3 * 7   # the old clip made every non-zero 255


@pytest.mark.parametrize("mode,fmt", [("I;16", "<u2"), ("I;16B", ">u2"), ("I;16L", "<u2")])
def test_16bit_byte_orders(mode, fmt):
    im = Image.frombytes(mode, (4, 2), LEVELS16.astype(fmt).tobytes())
    np.testing.assert_array_equal(np.asarray(to_rgb(im)).astype(np.int64), _grey(LEVELS16 / 257.0))


def test_I_mode_tiff_is_read_as_16bit(tmp_path):
    path = tmp_path / "int32.tif"
    Image.fromarray(LEVELS16.astype(np.int32)).save(path)
    with Image.open(path) as im:
        assert im.mode == "I"
    np.testing.assert_array_equal(_rgb(path), _grey(LEVELS16 / 257.0))


def test_I_mode_beyond_16bit_is_refused(tmp_path):
    path = tmp_path / "big.tif"
    Image.fromarray(np.array([[0, 70000]], dtype=np.int32)).save(path)
    with pytest.raises(ImageError, match=r"big\.tif: I pixels from 0 to 70000 lie outside 0\.\.65535"):
        open_image(path)


@pytest.mark.parametrize("top", [1.0, 255.0, 65535.0])
def test_F_mode_scaled_from_its_range(tmp_path, top):
    values = np.array([[0.0, 0.1, 0.25, 0.5], [0.6, 0.75, 0.9, 1.0]]) * top
    path = tmp_path / "float.tif"
    Image.fromarray(values.astype(np.float32)).save(path)
    with Image.open(path) as im:
        assert im.mode == "F"
    expected = _grey(values.astype(np.float32).astype(np.float64) * 255.0 / top)
    np.testing.assert_array_equal(_rgb(path), expected)   # 0.5 of 1.0 is 128, not 0 or 1


def test_F_mode_negative_or_nan_refused():
    for bad in (-1.0, float("nan")):
        im = Image.fromarray(np.array([[0.5, bad]], dtype=np.float32))
        with pytest.raises(ImageError, match="F"):
            to_rgb(im)


def test_palette_with_transparency(tmp_path):
    path = tmp_path / "pal.png"
    im = Image.new("P", (3, 1))
    im.putpalette([200, 10, 10, 10, 200, 10, 10, 10, 200])
    im.putdata([0, 1, 2])
    im.save(path, transparency=bytes([255, 0, 128]))   # opaque red, transparent green, half blue
    with Image.open(path) as back:
        assert back.mode == "P" and "transparency" in back.info
    expected = np.stack([_over([200, 10, 10], 255), _over([10, 200, 10], 0), _over([10, 10, 200], 128)])
    np.testing.assert_allclose(_rgb(path)[0], expected, atol=1)
    assert tuple(_rgb(path)[0, 1]) == BACKGROUND          # not the hidden green, not black


def test_LA_and_RGBA_composited_on_background(tmp_path):
    la = np.array([[[100, 255], [100, 64], [30, 0]]], dtype=np.uint8)
    Image.fromarray(la, "LA").save(tmp_path / "la.png")
    expected = _over(np.repeat(la[..., :1], 3, axis=-1), la[..., 1])
    np.testing.assert_allclose(_rgb(tmp_path / "la.png"), expected, atol=1)
    rgba = np.array([[[250, 0, 0, 255], [0, 250, 0, 100], [0, 0, 250, 0]]], dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    np.testing.assert_allclose(_rgb(tmp_path / "rgba.png"), _over(rgba[..., :3], rgba[..., 3]), atol=1)
    black = _rgb(tmp_path / "rgba.png", background=(0, 0, 0))
    np.testing.assert_allclose(black, _over(rgba[..., :3], rgba[..., 3], (0, 0, 0)), atol=1)


def test_PA_composited():
    im = Image.new("PA", (2, 1))
    im.putpalette([0, 0, 0, 240, 20, 20])
    im.putdata([(1, 255), (1, 0)])
    np.testing.assert_allclose(np.asarray(to_rgb(im)).astype(np.int64)[0],
                               [[240, 20, 20], list(BACKGROUND)], atol=1)


def test_cmyk_tiff(tmp_path):
    path = tmp_path / "cmyk.tif"
    im = Image.new("CMYK", (3, 1))
    im.putdata([(0, 0, 0, 0), (0, 255, 255, 0), (0, 0, 0, 255)])   # white, red, black
    im.save(path)
    np.testing.assert_array_equal(_rgb(path)[0], [[255, 255, 255], [255, 0, 0], [0, 0, 0]])


def test_1bit_and_L(tmp_path):
    Image.fromarray(np.array([[0, 1, 1, 0]], dtype=bool)).save(tmp_path / "bits.png")
    np.testing.assert_array_equal(_rgb(tmp_path / "bits.png"), _grey([[0, 255, 255, 0]]))
    Image.fromarray(np.array([[7, 128, 250]], dtype=np.uint8)).save(tmp_path / "l.png")
    np.testing.assert_array_equal(_rgb(tmp_path / "l.png"), _grey([[7, 128, 250]]))


def test_exif_orientation_applied(tmp_path):
    stored = np.zeros((32, 64, 3), dtype=np.uint8)
    stored[:, :32] = (230, 20, 20)                 # left half red, right half blue as stored
    stored[:, 32:] = (20, 20, 230)
    im = Image.fromarray(stored)
    exif = im.getexif()
    exif[0x0112] = 6                               # Orientation: shown rotated 90 degrees clockwise
    path = tmp_path / "phone.jpg"
    im.save(path, quality=95, exif=exif.tobytes())
    shown = _rgb(path)
    assert shown.shape == (64, 32, 3)              # upright: taller than wide
    assert np.abs(shown[8, 16] - [230, 20, 20]).max() < 12      # the stored left edge is the top
    assert np.abs(shown[56, 16] - [20, 20, 230]).max() < 12


def _png_of_zeros(path, width, height):
    """A real, valid 1-bit greyscale PNG of zeros (black), written row by row (a small file)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    z = zlib.compressobj(9)
    row = bytes(1 + (width + 7) // 8)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
                     + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def test_huge_dimensions_refused_from_header(tmp_path):
    path = tmp_path / "huge.png"
    _png_of_zeros(path, 12000, 12000)
    assert path.stat().st_size < 1_000_000 and 12000 * 12000 > MAX_PIXELS
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ImageError) as e:
            open_image(path)
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert str(path) in str(e.value) and "12000x12000" in str(e.value) and "limit" in str(e.value)


def test_pixel_limit_is_an_argument(tmp_path):
    path = tmp_path / "small.png"
    _png_of_zeros(path, 100, 60)
    with pytest.raises(ImageError, match=r"100x60 pixels"):
        open_image(path, max_pixels=5999)
    np.testing.assert_array_equal(_rgb(path, max_pixels=6000), np.zeros((60, 100, 3)))


def test_sources_bytes_file_object_and_name(tmp_path):
    path = tmp_path / "grey16.png"
    Image.fromarray(LEVELS16).save(path)
    data = path.read_bytes()
    expected = _grey(LEVELS16 / 257.0)
    np.testing.assert_array_equal(_rgb(data), expected)
    with open(path, "rb") as f:
        np.testing.assert_array_equal(_rgb(f), expected)
    np.testing.assert_array_equal(_rgb(io.BytesIO(data)), expected)
    with pytest.raises(ImageError, match=r"^shard-0/key7: cannot be decoded"):
        open_image(data[: len(data) // 2], name="shard-0/key7")


@pytest.mark.parametrize("payload", [b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + bytes(40)])
def test_undecodable_inputs_raise_image_error(tmp_path, payload):
    path = tmp_path / "bad.png"
    path.write_bytes(payload)
    with pytest.raises(ImageError, match=r"bad\.png: cannot be decoded \(\w+"):
        open_image(path)
    with pytest.raises(ImageError):
        open_image(tmp_path / "missing.png")


# ------------------------------------------------------------------------------ folder walk
def _png(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (2, 2)).save(path)


def test_image_files_follows_linked_folders(tmp_path):
    outside = tmp_path / "elsewhere"
    _png(outside / "a.png")
    _png(outside / "deep" / "b.JPG")
    root = tmp_path / "photos"
    _png(root / "c.png")
    (root / "notes.txt").write_text("x")
    (root / ".hidden.png").write_bytes(b"")
    os.symlink(outside, root / "linked")
    got = [(str(p.relative_to(root)), real) for p, real in image_files(root)]
    assert got == [("c.png", str(root / "c.png")),
                   ("linked/a.png", os.path.realpath(outside / "a.png")),
                   ("linked/deep/b.JPG", os.path.realpath(outside / "deep" / "b.JPG"))]


@pytest.mark.parametrize("case", ["loop", "dangling", "twice"])
def test_image_files_refuses_links_that_read_twice_or_nowhere(tmp_path, case):
    root = tmp_path / "photos"
    _png(root / "sub" / "a.png")
    if case == "loop":
        os.symlink(root, root / "sub" / "loop")
        expected = f"{root / 'sub' / 'loop'} -> {os.path.realpath(root)}: already read as {root}"
    elif case == "dangling":
        os.symlink(tmp_path / "nowhere.png", root / "gone.png")
        expected = f"{root / 'gone.png'} -> {tmp_path / 'nowhere.png'}: the link's target does not exist"
    else:
        os.symlink(root / "sub" / "a.png", root / "copy.png")
        expected = f"already read as {root / 'sub' / 'a.png'}"
    with pytest.raises(FolderError) as e:
        image_files(root)
    assert expected in str(e.value) and "remove or fix these links" in str(e.value)
