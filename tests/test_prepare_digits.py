"""scripts/prepare_digits.py: split sizes, stratification, determinism, images."""
import hashlib
import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "prepare_digits.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("prepare_digits", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prep = _load_script()
DIGITS = load_digits()


def _tree(root: Path):
    """{split: {index: label}} read back from the files on disk."""
    out = {}
    for split in ("train", "val"):
        out[split] = {int(p.stem): int(p.parent.name) for p in (root / split).glob("*/*.png")}
    return out


def _digests(root: Path):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*.png"))}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    manifest = prep.prepare_digits(root, size=16, progress=False)
    return root, manifest


def test_split_sizes_cover_every_digit_once(tree):
    root, manifest = tree
    files = _tree(root)
    train, val = files["train"], files["val"]
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(range(len(DIGITS.target)))
    assert manifest["counts"] == {"train": len(train), "val": len(val)}
    # Labels on disk are scikit-learn's labels of the same index.
    for split in (train, val):
        for idx, label in split.items():
            assert label == DIGITS.target[idx]


def test_split_is_stratified(tree):
    root, _ = tree
    files = _tree(root)
    per_class = Counter(DIGITS.target.tolist())
    val_counts = Counter(files["val"].values())
    for c, n in per_class.items():
        assert val_counts[c] == int(round(n * 0.2)), (c, n, val_counts[c])
    # Overall fraction close to 20 % (rounding per class moves it by at most 10 images).
    assert abs(len(files["val"]) - 0.2 * len(DIGITS.target)) <= 10


def test_images_are_rgb_of_requested_size_and_match_source(tree):
    root, _ = tree
    for split, files in _tree(root).items():
        for idx, label in list(files.items())[:20]:
            img = Image.open(root / split / str(label) / f"{idx:04d}.png")
            assert img.size == (16, 16) and img.mode == "RGB"
            arr = np.asarray(img).astype(np.float64)                          # (16, 16, 3)
            assert np.array_equal(arr[..., 0], arr[..., 1]) and np.array_equal(arr[..., 0], arr[..., 2])
            # Downsampling back by 2x2 block means recovers the 8x8 source (up to interpolation).
            blocks = arr[..., 0].reshape(8, 2, 8, 2).mean(axis=(1, 3)) / 255.0 * 16.0
            src = DIGITS.images[idx]
            assert np.corrcoef(blocks.ravel(), src.ravel())[0, 1] > 0.9


def test_size_8_is_exact_copy_of_source(tmp_path):
    img = prep.digit_image(DIGITS.images[5], 8)
    arr = np.asarray(img)[..., 0].astype(np.float64)
    np.testing.assert_allclose(arr, np.rint(DIGITS.images[5] * 255.0 / 16.0))


def test_deterministic_and_idempotent(tree, tmp_path):
    root, _ = tree
    again = prep.prepare_digits(tmp_path, size=16, progress=False)
    assert not again["skipped"]
    assert _digests(tmp_path) == _digests(root)
    mtimes = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.png")}
    third = prep.prepare_digits(tmp_path, size=16, progress=False)
    assert third["skipped"]
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.png")} == mtimes


def test_other_seed_rewrites_and_removes_stale_files(tree, tmp_path):
    root, _ = tree
    prep.prepare_digits(tmp_path, size=16, progress=False)
    m = prep.prepare_digits(tmp_path, size=16, seed=1, progress=False)
    assert not m["skipped"]
    files = _tree(tmp_path)
    assert set(files["train"]).isdisjoint(files["val"])
    assert len(files["train"]) + len(files["val"]) == len(DIGITS.target)
    assert files["val"] != _tree(root)["val"]
    assert json.loads((tmp_path / "digits.json").read_text())["seed"] == 1


def test_split_indices_rejects_bad_fraction():
    with pytest.raises(ValueError, match="val_fraction"):
        prep.split_indices(DIGITS.target, 1.5, 0)


def test_cli_prints_counts(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "d"), "--size", "12", "--quiet"],
                         capture_output=True, text=True, check=True).stdout
    files = _tree(tmp_path / "d")
    assert f"train {len(files['train'])}, val {len(files['val'])}" in out
    assert Image.open(next((tmp_path / "d" / "val").glob("*/*.png"))).size == (12, 12)
