"""dcvit-shards (train_imagenet.shards) on class folders and flat folders: round trip through real WebDataset, determinism, val layout,
verification of damaged shards, atomic re-runs and the error messages of bad inputs."""
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image
from sklearn.datasets import load_digits

from train_imagenet.shards import cli, plan, write

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "make_wds_shards.py"  # the wrapper of dcvit-shards
DIGITS = load_digits()
CLASSES = ["three", "one", "zero", "two"]  # folder names; index = sorted position
PER_CLASS = 7


def _digit_image(i: int) -> Image.Image:
    """Digit ``i`` of scikit-learn's set as a 16x16 grey image."""
    pixels = (DIGITS.images[i] * (255 / 16)).round().astype(np.uint8)  # (8, 8) in [0, 16]
    return Image.fromarray(pixels, mode="L").resize((16, 16), Image.NEAREST)


def _make_imagefolder(root: Path) -> dict:
    """ImageFolder of 4 digit classes: PNG, JPEG (``.JPEG``), BMP, PNG bytes named ``.jpeg``,
    a nested folder and a text file.

    Returns {key: (relative path, label)} with keys and labels derived here independently.
    """
    digit_of = {"zero": 0, "one": 1, "two": 2, "three": 3}
    index = {name: i for i, name in enumerate(sorted(CLASSES))}
    expected = {}
    for name in CLASSES:
        picks = np.flatnonzero(DIGITS.target == digit_of[name])[:PER_CLASS]
        for j, i in enumerate(picks):
            ext = {0: ".JPEG", 1: ".bmp", 3: ".jpeg"}.get(j, ".png")
            sub = "nested/" if j == 2 else ""
            rel = f"{name}/{sub}digit_{i}{ext}"
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            _digit_image(i).save(root / rel, format={".JPEG": "JPEG", ".bmp": "BMP"}.get(ext, "PNG"))
            expected[f"{name}__{sub.replace('/', '__')}digit_{i}"] = (rel, index[name])
    (root / "one" / "README.txt").write_text("not an image\n")
    return expected


def _read_back(out: Path, split: str = "train") -> tuple[dict, dict]:
    """({key: (ext, bytes, label)}, metadata) read with webdataset from the brace pattern."""
    meta = json.loads((out / f"{split}.json").read_text())
    samples = {}
    for s in wds.WebDataset(str(out / meta["pattern"]), shardshuffle=False, empty_check=False):
        (ext,) = [k for k in s if k in ("jpg", "png")]
        assert s["__key__"] not in samples
        samples[s["__key__"]] = (ext, s[ext], int(s["cls"]))
    return samples, meta


def _digests(out: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.tar"))}


def _run(*argv) -> int:
    return cli.main([*map(str, argv), "--no-progress"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagefolder")
    return root, _make_imagefolder(root)


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory):
    src, _ = folder
    out = tmp_path_factory.mktemp("shards")
    assert _run("--src", src, "--out", out, "--shard-size", 6, "--workers", 1) == 0
    return out


def test_round_trip_keeps_bytes_labels_and_count(folder, shards, capsys):
    src, expected = folder
    samples, meta = _read_back(shards)
    assert set(samples) == set(expected)
    assert meta["num_samples"] == len(samples) == len(CLASSES) * PER_CLASS
    assert meta["num_classes"] == len(CLASSES)
    assert json.loads((shards / "classes.json").read_text()) == sorted(CLASSES)
    assert sum(meta["samples_per_shard"]) == len(samples) and max(meta["samples_per_shard"]) == 6
    assert meta["shards"] == [f"train-{i:06d}.tar" for i in range(len(meta["shards"]))]
    for key, (ext, data, label) in samples.items():
        rel, want_label = expected[key]
        assert label == want_label, key
        original = (src / rel).read_bytes()
        if rel.endswith(".bmp"):  # re-encoded: same pixels, PNG container
            assert ext == "png"
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), np.asarray(Image.open(src / rel)))
        else:
            assert ext == {"JPEG": "jpg", "PNG": "png"}[Image.open(src / rel).format]
            assert data == original, key
    # Shuffled by default for train: the first shard is not one class.
    first = [samples[k][2] for k in samples][:6]
    assert len(set(first)) > 1


def test_same_shards_for_any_worker_count_and_seed_changes_order(folder, tmp_path):
    src, _ = folder
    digests = {}
    for workers, seed in ((1, 0), (2, 0), (2, 5)):
        out = tmp_path / f"w{workers}s{seed}"
        assert _run("--src", src, "--out", out, "--shard-size", 5, "--workers", workers, "--seed", seed) == 0
        digests[workers, seed] = _digests(out)
    assert digests[1, 0] == digests[2, 0]
    assert digests[2, 5] != digests[2, 0]
    assert len(digests[2, 5]) == len(digests[2, 0])


def test_unshuffled_split_keeps_sorted_order(folder, tmp_path):
    src, expected = folder
    assert _run("--src", src, "--out", tmp_path, "--split", "val", "--no-shuffle") == 0
    meta = json.loads((tmp_path / "val.json").read_text())
    keys = [s["__key__"] for s in wds.WebDataset(str(tmp_path / meta["pattern"]), shardshuffle=False)]
    in_order = sorted(expected, key=lambda k: (expected[k][1], expected[k][0]))
    assert keys == in_order and meta["shuffled"] is False


def test_max_shard_bytes_bounds_every_shard(folder, tmp_path):
    src, _ = folder
    limit = 12 * 1024
    assert _run("--src", src, "--out", tmp_path, "--max-shard-bytes", limit, "--other-formats", "png") == 0
    meta = json.loads((tmp_path / "train.json").read_text())
    sizes = [(tmp_path / s).stat().st_size for s in meta["shards"]]
    assert len(sizes) > 1 and sizes == meta["shard_bytes"]
    # BMP sources are re-encoded, so their planned size is the BMP's: an upper bound here.
    assert all(size <= limit for size in sizes)


def _val_layout(tmp_path: Path, folder) -> tuple[Path, dict]:
    """Flat folder ILSVRC2012_val_NNNNNNNN.JPEG|png and {filename: class index}."""
    src, expected = folder
    flat = tmp_path / "val_flat"
    flat.mkdir()
    truth = {}
    for n, (rel, label) in enumerate(sorted(expected.values())):
        if rel.endswith(".bmp"):
            continue
        name = f"ILSVRC2012_val_{n + 1:08d}{Path(rel).suffix}"
        shutil.copy(src / rel, flat / name)
        truth[name] = label
    return flat, truth


@pytest.mark.parametrize("form", ["name-index", "csv-classname", "one-column-1-based"])
def test_val_layout_with_labels_file(folder, shards, tmp_path, form):
    flat, truth = _val_layout(tmp_path, folder)
    classes = json.loads((shards / "classes.json").read_text())
    names = sorted(truth)
    labels = tmp_path / "labels.txt"
    extra = []
    if form == "name-index":
        labels.write_text("".join(f"{n} {truth[n]}\n" for n in reversed(names)))
    elif form == "csv-classname":  # LOC_val_solution.csv: header, stem, class name + boxes
        labels.write_text("\ufeffImageId,PredictionString\r\n" + "".join(
            f"{Path(n).stem},{classes[truth[n]]} 1 2 3 4\n" for n in names))
    else:  # ILSVRC2012_validation_ground_truth.txt
        labels.write_text("".join(f"{truth[n] + 1}\n" for n in names))
        extra = ["--label-offset", 1]
    out = tmp_path / "out"
    shutil.copytree(shards, out)
    assert _run("--src", flat, "--out", out, "--split", "val", "--labels", labels,
                "--classes", out / "classes.json", "--workers", 2, "--verify", *extra) == 0
    samples, meta = _read_back(out, "val")
    assert meta["num_samples"] == len(truth) and meta["shuffled"] is False
    for name, label in truth.items():
        ext, data, got = samples[Path(name).stem]
        assert got == label and data == (flat / name).read_bytes()
    assert json.loads((out / "classes.json").read_text()) == classes
    assert (out / "train.json").exists()  # the other split is untouched


def test_ilsvrc_ground_truth_with_devkit_class_order(folder, shards, tmp_path):
    """1-based ids in the devkit's own class order, mapped to train's sorted indices via meta.mat."""
    from scipy.io import savemat

    flat, truth = _val_layout(tmp_path, folder)
    classes = json.loads((shards / "classes.json").read_text())
    devkit_order = [classes[i] for i in (2, 0, 3, 1)]  # ILSVRC2012_ID 1..4
    synsets = np.array([(i + 1, name, 0) for i, name in enumerate(devkit_order)] + [(5, "parent", 4)],
                       dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O"), ("num_children", "O")])
    savemat(tmp_path / "meta.mat", {"synsets": synsets[::-1].reshape(-1, 1)})
    gt = tmp_path / "ILSVRC2012_validation_ground_truth.txt"
    gt.write_text("".join(f"{devkit_order.index(classes[truth[n]]) + 1}\n" for n in sorted(truth)))
    out = tmp_path / "out"
    assert _run("--src", flat, "--out", out, "--split", "val", "--labels", gt, "--label-offset", 1,
                "--label-names", tmp_path / "meta.mat", "--classes", shards / "classes.json") == 0
    samples, _ = _read_back(out, "val")
    assert {name: samples[Path(name).stem][2] for name in truth} == truth


def _copy(shards: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(shards, out)
    return out


def test_verify_passes_on_good_shards(shards, capsys):
    assert _run("--verify", shards, "--workers", 2) == 0
    assert "OK" in capsys.readouterr().out


def test_verify_names_shard_and_key_of_corrupt_image(shards, tmp_path, capsys):
    out = _copy(shards, tmp_path)
    shard = out / "train-000001.tar"
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith((".png", ".jpg")))
    raw = bytearray(shard.read_bytes())
    raw[member.offset_data:member.offset_data + member.size] = bytes(member.size)  # zeros
    shard.write_bytes(bytes(raw))
    assert _run("--verify", out) == 1
    err = capsys.readouterr().err
    key = member.name.rsplit(".", 1)[0]
    assert "train-000001.tar" in err and key in err and "does not decode" in err


def test_verify_detects_truncated_shard_and_count_mismatch(shards, tmp_path, capsys):
    out = _copy(shards, tmp_path)
    shard = out / "train-000002.tar"
    shard.write_bytes(shard.read_bytes()[:1500])
    assert _run("--verify", out) == 1
    assert "train-000002.tar" in capsys.readouterr().err

    out = tmp_path / "count"
    shutil.copytree(shards, out)
    meta = json.loads((out / "train.json").read_text())
    meta["samples_per_shard"][0] += 1
    meta["num_samples"] += 1
    (out / "train.json").write_text(json.dumps(meta))
    assert _run("--verify", out, "--split", "train") == 1
    err = capsys.readouterr().err
    assert "train-000000.tar holds 6 samples, metadata says 7" in err
    assert f"num_samples={meta['num_samples']}" in err

    (out / "train-000003.tar").unlink()
    assert _run("--verify", out) == 1
    assert "train-000003.tar listed in train.json is missing" in capsys.readouterr().err


def test_rerun_overwrites_and_interrupted_run_leaves_the_split_as_it_was(folder, tmp_path, monkeypatch):
    src, _ = folder
    out = tmp_path / "out"
    assert _run("--src", src, "--out", out, "--shard-size", 3) == 0
    (out / ".train.tmp-deadbeef").mkdir()
    (out / ".train.tmp-deadbeef" / "train-000000.tar").write_bytes(b"left by a killed run")
    assert _run("--src", src, "--out", out, "--shard-size", 10) == 0
    meta = json.loads((out / "train.json").read_text())
    visible = sorted(p.name for p in out.iterdir() if p.name != ".lock")  # the lock file stays
    assert visible == sorted(meta["shards"] + ["classes.json", "train.json"])
    assert _run("--verify", out) == 0
    before = _digests(out), (out / "train.json").read_bytes()

    calls = {"n": 0}
    real = write.encode_image

    def failing(path, other_formats):
        calls["n"] += 1
        if calls["n"] == 15:  # inside the second shard
            raise KeyboardInterrupt
        return real(path, other_formats)

    monkeypatch.setattr(write, "encode_image", failing)
    assert _run("--src", src, "--out", out, "--shard-size", 10, "--seed", 3, "--workers", 1) == 130
    names = sorted(p.name for p in out.iterdir() if p.name != ".lock")
    assert not any(".tmp" in n for n in names)
    assert (_digests(out), (out / "train.json").read_bytes()) == before  # the old split, whole
    assert _run("--verify", out) == 0


def test_other_formats_error_names_file(folder, tmp_path, capsys):
    src, _ = folder
    assert _run("--src", src, "--out", tmp_path, "--other-formats", "error", "--workers", 1) == 2
    err = capsys.readouterr().err
    assert ".bmp is neither JPEG nor PNG" in err and "--other-formats png" in err
    assert not list(tmp_path.glob("*.tar*")) and not list(tmp_path.glob(".*tmp*"))


def test_keys_are_unique_and_tar_safe():
    rels = ["a/x.y.jpg", "a/x_y.png", "b c/ü.png", "_a/.z.png", "a/x_y.JPEG", "d/" + "n" * 200 + ".png"]
    keys = plan.make_keys(rels)
    assert len(set(keys)) == len(keys)
    for key in keys:
        assert "." not in key and "/" not in key and not key.startswith("_")
        assert len(key) <= plan.MAX_KEY_CHARS
        assert re.fullmatch(r"[A-Za-z0-9_-]+", key)


def _error(capsys, *argv) -> str:
    assert _run(*argv) == 2
    return capsys.readouterr().err


def test_bad_split_name_is_rejected(folder, tmp_path, capsys):
    src, _ = folder
    with pytest.raises(SystemExit) as exc:
        _run("--src", src, "--out", tmp_path, "--split", "val-real")
    assert exc.value.code == 2 and "letters, digits and '_'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_source_errors(tmp_path, capsys, folder):
    assert "does not exist" in _error(capsys, "--src", tmp_path / "nope", "--out", tmp_path / "o")
    (tmp_path / "empty").mkdir()
    assert "is empty" in _error(capsys, "--src", tmp_path / "empty", "--out", tmp_path / "o")
    (tmp_path / "noimg" / "cat").mkdir(parents=True)
    (tmp_path / "noimg" / "cat" / "a.txt").write_text("x")
    err = _error(capsys, "--src", tmp_path / "noimg", "--out", tmp_path / "o")
    assert "no images found" in err and "holds no images" in err  # warning, then the error
    src, _ = folder
    assert "lies inside --src" in _error(capsys, "--src", src, "--out", src / "shards")
    assert not (src / "shards").exists()
    flat, _ = _val_layout(tmp_path, folder)
    err = _error(capsys, "--src", flat, "--out", tmp_path / "o")
    assert "--labels" in err and "directly in" in err
    assert "needs --classes" in _error(capsys, "--src", flat, "--out", tmp_path / "o", "--labels", "x.txt")


def test_empty_class_folder_warns_and_keeps_its_index(tmp_path, capsys):
    src = tmp_path / "src"
    for name in ("a", "b", "c"):
        (src / name).mkdir(parents=True)
    _digit_image(0).save(src / "a" / "0.png")
    _digit_image(1).save(src / "c" / "1.png")
    assert _run("--src", src, "--out", tmp_path / "o") == 0
    assert "holds no images" in capsys.readouterr().err
    samples, meta = _read_back(tmp_path / "o")
    assert meta["num_classes"] == 3 and samples["c__1"][2] == 2


def test_label_file_errors_name_path_and_line(tmp_path, capsys, folder, shards):
    flat, truth = _val_layout(tmp_path, folder)
    classes = shards / "classes.json"
    names = sorted(truth)
    base = ["--src", flat, "--out", tmp_path / "o", "--classes", classes, "--labels"]
    missing = tmp_path / "missing.txt"
    assert f"cannot read labels file {missing}" in _error(capsys, *base, missing)

    bad = tmp_path / "bad.txt"
    bad.write_text(f"{names[0]} 0\n{names[1]}\n")
    assert f"{bad}:2: expected 'filename label'" in _error(capsys, *base, bad)
    bad.write_text("".join(f"{n} {4 if i == 3 else 0}\n" for i, n in enumerate(names)))
    err = _error(capsys, *base, bad)
    assert f"{bad}:4: label 4" in err and "out of range [0, 4)" in err
    bad.write_text("".join(f"{n} {'tow' if i == 1 else 'one'}\n" for i, n in enumerate(names)))
    assert f"{bad}:2: class 'tow' is not in --classes; did you mean 'two'?" in _error(capsys, *base, bad)
    bad.write_text("1\n" * (len(names) - 1))
    assert f"has {len(names) - 1} labels" in _error(capsys, *base, bad)
    bad.write_text("".join(f"{n} 0\n" for n in names[1:]))
    assert f"no label for 1 image(s), e.g. ['{names[0]}']" in _error(capsys, *base, bad)
    bad.write_text("0\n" * len(names))  # 0 in a 1-based file
    assert "--label-offset 1" in _error(capsys, *base, bad, "--label-offset", 1)


def test_classes_conflict_with_other_split(shards, tmp_path, capsys):
    out = _copy(shards, tmp_path)
    src = tmp_path / "other"
    (src / "zebra").mkdir(parents=True)
    _digit_image(0).save(src / "zebra" / "0.png")
    err = _error(capsys, "--src", src, "--out", out, "--split", "val")
    assert "lists other classes" in err and "--classes" in err


def test_command_line_usage_errors_exit_2():
    run = subprocess.run([sys.executable, str(SCRIPT), "--src", "somewhere"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "needs both --src and --out" in run.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_command_line_writes_prints_pattern_and_verifies(folder, tmp_path):
    src, expected = folder
    out = tmp_path / "cli"
    run = subprocess.run([sys.executable, str(SCRIPT), "--src", str(src), "--out", str(out), "--shard-size", "8",
                          "--workers", "2", "--verify"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    n = -(-len(expected) // 8)
    assert f"train shards: {out}/train-{{000000..{n - 1:06d}}}.tar" in run.stdout
    assert "verify train:" in run.stdout and "OK" in run.stdout
    assert "img/s" in run.stderr or "img]" in run.stderr  # progress bar


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_verify_of_a_missing_or_empty_folder_says_so(tmp_path, capsys, make):
    folder = tmp_path / "shards"
    if make == "empty":
        folder.mkdir()
    assert cli.main(["--verify", str(folder), "--no-progress"]) == (2 if make == "missing" else 1)
    err = capsys.readouterr().err
    assert str(folder) in err and ("no such folder" if make == "missing" else "no split metadata") in err
