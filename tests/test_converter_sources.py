"""dcvit-shards on every ImageNet source (the tiny exact copies of tests/data_layouts.py): each
sample read back from the shards is its source's bytes, under the class the source gives it;
the archives are read without extraction; the docs' commands; the missing optional packages;
odd file names."""
import gzip
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

import data_layouts as L
from train_imagenet.shards import cli, plan


def _run(*argv) -> int:
    return cli.main([*map(str, argv), "--no-progress", "--workers", "1"])


def _read_back(out: Path, split: str) -> list[tuple[str, bytes, int]]:
    meta = json.loads((out / f"{split}.json").read_text())
    got = []
    for s in wds.WebDataset(str(out / meta["pattern"]), shardshuffle=False, empty_check=False):
        (ext,) = [k for k in s if k in ("jpg", "png")]
        got.append((s["__key__"], s[ext], int(s["cls"])))
    assert meta["num_samples"] == len(got)
    return got


def _check(out: Path, split: str, classes=L.WNIDS) -> list:
    """Every sample of ``split`` is one source image, once, byte for byte, labelled with its
    class (an image's colour says which sample it is and its class: data_layouts)."""
    truth = L.TRAIN_LABELS if split == "train" else L.VAL_LABELS
    got, seen = _read_back(out, split), []
    for key, data, label in got:
        red, green = (int(v) for v in L.as_array(data)[0, 0, :2])
        index = round(red / 5)
        assert label == truth[index] == round(green / 60), key
        assert data == L._image(split, index, label), key
        seen.append(index)
    assert sorted(seen) == list(range(len(truth)))
    assert json.loads((out / "classes.json").read_text()) == list(classes)
    return got


def _digests(out: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.tar"))}


def _kaggle(tmp_path: Path) -> tuple[Path, Path]:
    """(Kaggle's root, its CLS-LOC folder): the image-net.org archives extracted, plus LOC files."""
    root = tmp_path / "kaggle"
    L.kaggle(str(root))
    return root, root / "ILSVRC" / "Data" / "CLS-LOC"


# ----------------------------------------------------------------------------- image-net.org
def test_train_archive_is_read_in_place_and_equals_the_extracted_folder(tmp_path):
    L.imagenet_org(str(tmp_path / "dl"))
    tar = tmp_path / "dl" / "ILSVRC2012_img_train.tar"
    before = sorted(p.name for p in (tmp_path / "dl").iterdir())
    assert _run("--src", tar, "--out", tmp_path / "a", "--shard-size", 10) == 0
    got = _check(tmp_path / "a", "train")
    assert {k for k, _, _ in got} == {f"{L.WNIDS[y]}__{L.train_key(i)}" for i, y in enumerate(L.TRAIN_LABELS)}
    assert sorted(p.name for p in (tmp_path / "dl").iterdir()) == before  # nothing extracted
    _, images = _kaggle(tmp_path)  # the same images as folders
    assert _run("--src", images / "train", "--out", tmp_path / "b", "--shard-size", 10) == 0
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")  # the same shards, byte for byte


@pytest.mark.parametrize("kit", ["ILSVRC2012_devkit_t12", "ILSVRC2012_devkit_t12.tar.gz"])
def test_val_archive_with_the_devkit(tmp_path, kit):
    dl = tmp_path / "dl"
    L.imagenet_org(str(dl))
    out = tmp_path / "out"
    assert _run("--src", dl / "ILSVRC2012_img_train.tar", "--out", out) == 0
    assert _run("--src", dl / "ILSVRC2012_img_val.tar", "--out", out, "--devkit", dl / kit, "--verify") == 0
    got = _check(out, "val")  # the split from the archive's name
    assert [k for k, _, _ in got] == [L.val_key(i) for i in range(L.N_VAL)]  # val stays in file order


def test_val_archive_with_a_labels_file_and_loc_synset_mapping(tmp_path):
    L.imagenet_org(str(tmp_path / "dl"))
    root, _ = _kaggle(tmp_path)
    out = tmp_path / "out"
    assert _run("--src", tmp_path / "dl" / "ILSVRC2012_img_val.tar", "--out", out, "--labels",
                root / "LOC_val_solution.csv", "--classes", root / "LOC_synset_mapping.txt") == 0
    _check(out, "val")


def test_flat_val_folder_with_the_devkit(tmp_path):
    L.imagenet_org(str(tmp_path / "dl"))
    _, images = _kaggle(tmp_path)
    out = tmp_path / "out"
    assert _run("--src", images / "val", "--out", out, "--devkit", tmp_path / "dl" / "ILSVRC2012_devkit_t12") == 0
    _check(out, "val")


def test_archive_errors_name_the_file_and_the_fix(tmp_path, capsys):
    L.imagenet_org(str(tmp_path / "dl"))
    tar = tmp_path / "dl" / "ILSVRC2012_img_val.tar"
    assert _run("--src", tar, "--out", tmp_path / "o") == 2
    assert "pass --labels FILE (or --devkit" in capsys.readouterr().err
    cut = tmp_path / "cut" / "ILSVRC2012_img_train.tar"
    cut.parent.mkdir()
    cut.write_bytes((tmp_path / "dl" / "ILSVRC2012_img_train.tar").read_bytes()[:3000])
    assert _run("--src", cut, "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and str(cut) in err and "Traceback" not in err
    gz = tmp_path / "ILSVRC2012_img_val.tar.gz"
    gz.write_bytes(gzip.compress(tar.read_bytes()))
    assert _run("--src", gz, "--out", tmp_path / "o") == 2
    assert "no .tar or .parquet" in capsys.readouterr().err
    assert _run("--src", tmp_path / "missing.tar", "--out", tmp_path / "o") == 2
    assert "does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------------------- Kaggle, torchvision
@pytest.mark.parametrize("build", [L.kaggle, L.torchvision_root], ids=["kaggle", "torchvision"])
def test_a_root_of_both_splits_gives_each(tmp_path, build):
    root, out = tmp_path / "root", tmp_path / "out"
    build(str(root))
    assert _run("--src", root, "--out", out, "--split", "train") == 0
    assert _run("--src", root, "--out", out, "--split", "val") == 0
    _check(out, "train")
    _check(out, "val")


def test_kaggle_folders_with_loc_files(tmp_path):
    (root, images), out = _kaggle(tmp_path), tmp_path / "out"
    mapping = root / "LOC_synset_mapping.txt"
    assert _run("--src", images / "train", "--out", out, "--classes", mapping) == 0
    assert _run("--src", images / "val", "--out", out, "--labels", root / "LOC_val_solution.csv",
                "--classes", mapping) == 0
    _check(out, "train")
    _check(out, "val")


# ----------------------------------------------------------------------------- timm, Hugging Face
@pytest.mark.parametrize("info", ["json", "yaml", "none"])
def test_timm_webdataset_release(tmp_path, info):
    root, out = tmp_path / "imagenet-1k-wds", tmp_path / "out"
    L.timm_wds(str(root), info)
    mapping = _kaggle(tmp_path)[0] / "LOC_synset_mapping.txt"
    assert _run("--src", root, "--out", out, "--split", "train", "--classes", mapping) == 0
    assert _run("--src", root, "--out", out, "--split", "val", "--classes", mapping) == 0
    _check(out, "train")
    got = _check(out, "val")
    assert [k for k, _, _ in got] == [L.val_key(i) for i in range(L.N_VAL)]


def test_timm_release_without_class_names_or_with_a_short_download(tmp_path, capsys):
    root = tmp_path / "wds"
    L.timm_wds(str(root))
    assert _run("--src", root, "--out", tmp_path / "o") == 2
    assert "pass --classes FILE (for ImageNet-1k: LOC_synset_mapping.txt" in capsys.readouterr().err
    assert _run("--src", root, "--out", tmp_path / "o", "--split", "test") == 2
    assert "holds the splits ['train', 'validation'], not test; pass --split" in capsys.readouterr().err
    (root / "imagenet1k-train-0001.tar").unlink()
    assert _run("--src", root, "--out", tmp_path / "o", "--classes", tmp_path / "x") == 2
    assert "cannot read class names file" in capsys.readouterr().err
    (tmp_path / "c.json").write_text(json.dumps(L.WNIDS))
    assert _run("--src", root, "--out", tmp_path / "o", "--classes", tmp_path / "c.json") == 2
    assert "train shards its _info lists are missing" in capsys.readouterr().err


def test_verify_never_takes_timms_info_for_a_split(tmp_path, capsys):
    root = tmp_path / "imagenet-1k-wds"
    L.timm_wds(str(root))
    assert _run("--verify", root) == 2
    err = capsys.readouterr().err
    assert "this is timm's WebDataset release" in err and "_info" not in err.split("release")[0]
    out, mapping = tmp_path / "out", _kaggle(tmp_path)[0] / "LOC_synset_mapping.txt"
    assert _run("--src", root, "--out", out, "--split", "val", "--classes", mapping) == 0
    shutil.copy(root / "_info.json", out)  # beside our shards it is still no split
    assert _run("--verify", out) == 0
    assert "verify val:" in capsys.readouterr().out


def test_huggingface_parquet_release(tmp_path):
    root, out = tmp_path / "imagenet-1k", tmp_path / "out"
    L.hf_parquet(str(root))
    assert _run("--src", root, "--out", out, "--split", "train", "--shard-size", 7) == 0
    assert _run("--src", root, "--out", out, "--split", "val") == 0
    _check(out, "train", classes=L.NAMES)  # the dataset card's names
    _check(out, "val", classes=L.NAMES)
    one = root / "data" / "validation-00000-of-00001.parquet"  # a file alone: split val from its name
    assert _run("--src", one, "--out", tmp_path / "one") == 0
    assert _digests(tmp_path / "one") == {k: v for k, v in _digests(out).items() if k.startswith("val-")}


def test_parquet_test_split_is_refused(tmp_path, capsys):
    root = tmp_path / "imagenet-1k"
    L.hf_parquet(str(root))
    assert _run("--src", root, "--out", tmp_path / "o", "--split", "test") == 2
    err = capsys.readouterr().err
    assert "every label of test is -1" in err and not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- missing extras
def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_devkit_without_scipy_says_which_extra(tmp_path, capsys, monkeypatch):
    L.imagenet_org(str(tmp_path))
    monkeypatch.setitem(sys.modules, "scipy", None)  # import scipy.io fails as when not installed
    monkeypatch.setitem(sys.modules, "scipy.io", None)
    assert _run("--src", tmp_path / "ILSVRC2012_img_val.tar", "--out", tmp_path / "o",
                "--devkit", tmp_path / "ILSVRC2012_devkit_t12") == 2
    assert "pip install 'dcvit[devkit]'" in _one_error_line(capsys)


def test_parquet_without_pyarrow_says_which_extra(tmp_path, capsys, monkeypatch):
    L.hf_parquet(str(tmp_path / "imagenet-1k"))
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert _run("--src", tmp_path / "imagenet-1k", "--out", tmp_path / "o") == 2
    assert "pip install 'dcvit[parquet]'" in _one_error_line(capsys)


def test_console_script_is_installed_and_the_wrapper_is_the_same_command(tmp_path):
    src = _kaggle(tmp_path)[1] / "train"
    exe = Path(sys.executable).with_name("dcvit-shards")
    script = Path(__file__).resolve().parents[1] / "scripts" / "make_wds_shards.py"
    for name, command in (("a", [str(exe)]), ("b", [sys.executable, str(script)])):
        run = subprocess.run([*command, "--src", str(src), "--out", str(tmp_path / name), "--no-progress"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")


# ----------------------------------------------------------------------------- 31.6: odd file names
def test_keys_of_long_non_utf8_names_are_unique_and_valid():
    long_a = os.fsdecode(b"\xff" * 95 + b"a.jpg")
    long_b = os.fsdecode(b"\xfe" * 95 + b"a.jpg")  # the same key text before the hash
    short = [os.fsdecode(b"c/\xe9.png"), os.fsdecode(b"c/\xe8.png")]
    keys = plan.make_keys([f"c/{long_a}", f"c/{long_b}", *short])
    assert len(set(keys)) == 4 and all(len(k) <= plan.MAX_KEY_CHARS + 2 for k in keys)
    assert all(k.isascii() and "." not in k and "/" not in k for k in keys)


def test_a_non_utf8_file_name_longer_than_90_bytes_converts(tmp_path):
    src = _kaggle(tmp_path)[1] / "train"
    odd = src / os.fsdecode(L.WNIDS[0].encode() + b"/" + b"\xff" * 120 + b".JPEG")
    shutil.copy(next((src / L.WNIDS[1]).iterdir()), odd)  # another image's bytes
    out = tmp_path / "out"
    assert _run("--src", src, "--out", out, "--verify") == 0
    got = {key: label for key, _, label in _read_back(out, "train")}
    assert len(got) == L.N_TRAIN + 1
    (odd_key,) = [k for k in got if k.startswith(L.WNIDS[0] + "____")]
    assert got[odd_key] == 0 and len(odd_key) <= plan.MAX_KEY_CHARS
    with tarfile.open(next(out.glob("train-*.tar"))) as tar:
        assert all(len(m.name) <= 100 for m in tar.getmembers())


# ----------------------------------------------------------------------------- docs/data.md
DOCS = Path(__file__).resolve().parents[1] / "docs" / "data.md"


def _doc_blocks() -> list[list[list[str]]]:
    """The dcvit-shards commands of each ```bash block of docs/data.md's converting section."""
    text = DOCS.read_text().split("## Converting each source", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for body in text.split("```bash\n")[1:]:
        lines = body.split("\n```", 1)[0].replace("\\\n", " ").splitlines()
        blocks.append([shlex.split(line) for line in lines if line.startswith("dcvit-shards ")])
    return blocks


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """The copies under the names the docs use (``/data/...``)."""
    data = tmp_path_factory.mktemp("root") / "data"
    L.imagenet_org(str(data))
    L.kaggle(str(data / "kaggle"))
    shutil.copytree(data / "kaggle" / "ILSVRC" / "Data" / "CLS-LOC", data / "imagenet")
    shutil.copy(data / "kaggle" / "LOC_val_solution.csv", data / "imagenet")
    L.timm_wds(str(data / "imagenet-1k-wds"))
    L.hf_parquet(str(data / "imagenet-1k"))
    L.torchvision_root(str(data / "torchvision-imagenet"))
    return data


@pytest.mark.parametrize("block", range(len(_doc_blocks())))
def test_every_converting_command_of_the_docs_runs(block, data_root, tmp_path):
    commands = _doc_blocks()[block]
    assert commands, "each block of the section gives commands"
    out = tmp_path / "out"
    for argv in commands:
        args = [a.replace("/data/imagenet-wds", str(out)).replace("/data/", f"{data_root}/") for a in argv[1:]]
        assert cli.main([*args, "--no-progress", "--workers", "1"]) == 0, argv
    classes = json.loads((out / "classes.json").read_text())
    assert classes in (L.WNIDS, L.NAMES)
    _check(out, "train", classes)
    _check(out, "val", classes)
