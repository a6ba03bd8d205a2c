"""dcvit-shards on every ImageNet source (tests/imagenet_copies.py): each sample read back
from the shards is its source's bytes, under the class the source gives it; the archives are
read without extraction; the missing optional packages and bad non-UTF-8 names."""
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

import imagenet_copies as ic
from train_imagenet.shards import cli, plan

COPY = ic.make_copy()
TRUTH = COPY.label_of()


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


def _check(out: Path, split: str, n: int, classes=ic.WNIDS) -> list:
    """Every sample of ``split`` is one source image, once, labelled with its class."""
    got = _read_back(out, split)
    assert len(got) == n and len({data for _, data, _ in got}) == n
    assert [TRUTH[data] for _, data, _ in got] == [label for _, _, label in got]
    assert json.loads((out / "classes.json").read_text()) == list(classes)
    return got


def _digests(out: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.tar"))}


N_TRAIN, N_VAL = len(ic.WNIDS) * ic.TRAIN_PER_CLASS, len(COPY.val)


# ----------------------------------------------------------------------------- image-net.org
def test_train_archive_is_read_in_place_and_equals_the_extracted_folder(tmp_path):
    tar = ic.train_tar(COPY, tmp_path / "dl")
    assert _run("--src", tar, "--out", tmp_path / "a", "--shard-size", 10) == 0
    got = _check(tmp_path / "a", "train", N_TRAIN)
    assert {k for k, _, _ in got} == {f"{w}__{Path(n).stem}" for w, fs in COPY.train.items() for n, _ in fs}
    assert sorted(p.name for p in (tmp_path / "dl").iterdir()) == ["ILSVRC2012_img_train.tar"]  # nothing extracted
    folder = ic.train_folder(COPY, tmp_path / "train")
    assert _run("--src", folder, "--out", tmp_path / "b", "--shard-size", 10) == 0
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")  # the same shards, byte for byte


@pytest.mark.parametrize("as_tar_gz", [False, True])
def test_val_archive_with_the_devkit(tmp_path, as_tar_gz):
    tar = ic.val_tar(COPY, tmp_path / "dl")
    kit = ic.devkit(COPY, tmp_path / "dl", as_tar_gz=as_tar_gz)
    out = tmp_path / "out"
    assert _run("--src", ic.train_tar(COPY, tmp_path / "dl"), "--out", out) == 0
    assert _run("--src", tar, "--out", out, "--devkit", kit, "--verify") == 0  # split val from the name
    got = _check(out, "val", N_VAL)
    assert [k for k, _, _ in got] == [Path(n).stem for n, _, _ in COPY.val]  # val stays in file order


def test_val_archive_with_a_labels_file_and_loc_synset_mapping(tmp_path):
    root = ic.kaggle(COPY, tmp_path / "kaggle")
    out = tmp_path / "out"
    assert _run("--src", ic.val_tar(COPY, tmp_path / "dl"), "--out", out, "--labels",
                root / "LOC_val_solution.csv", "--classes", root / "LOC_synset_mapping.txt") == 0
    _check(out, "val", N_VAL)


def test_flat_val_folder_with_the_devkit(tmp_path):
    flat = ic.val_flat(COPY, tmp_path / "val")
    kit = ic.devkit(COPY, tmp_path)
    out = tmp_path / "out"
    assert _run("--src", flat, "--out", out, "--devkit", kit) == 0
    _check(out, "val", N_VAL)


def test_archive_errors_name_the_file_and_the_fix(tmp_path, capsys):
    tar = ic.val_tar(COPY, tmp_path)
    assert _run("--src", tar, "--out", tmp_path / "o") == 2
    assert "pass --labels FILE (or --devkit" in capsys.readouterr().err
    cut = tmp_path / "cut" / "ILSVRC2012_img_train.tar"
    cut.parent.mkdir()
    cut.write_bytes(ic.train_tar(COPY, tmp_path / "full").read_bytes()[:3000])
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
@pytest.mark.parametrize("build", [ic.kaggle, ic.torchvision_root], ids=["kaggle", "torchvision"])
def test_a_root_of_both_splits_gives_each(tmp_path, build):
    root, out = build(COPY, tmp_path / "root"), tmp_path / "out"
    assert _run("--src", root, "--out", out, "--split", "train") == 0
    assert _run("--src", root, "--out", out, "--split", "val") == 0
    _check(out, "train", N_TRAIN)
    _check(out, "val", N_VAL)


def test_kaggle_folders_with_loc_files(tmp_path):
    root, out = ic.kaggle(COPY, tmp_path / "kaggle"), tmp_path / "out"
    images, mapping = root / "ILSVRC" / "Data" / "CLS-LOC", root / "LOC_synset_mapping.txt"
    assert _run("--src", images / "train", "--out", out, "--classes", mapping) == 0
    assert _run("--src", images / "val", "--out", out, "--labels", root / "LOC_val_solution.csv",
                "--classes", mapping) == 0
    _check(out, "train", N_TRAIN)
    _check(out, "val", N_VAL)


# ----------------------------------------------------------------------------- timm, Hugging Face
@pytest.mark.parametrize("info", ["json", "yaml", "none"])
def test_timm_webdataset_release(tmp_path, info):
    root = ic.timm_wds(COPY, tmp_path / "imagenet-1k-wds")
    if info != "json":
        (root / "_info.json").unlink()
    if info == "none":
        (root / "_info.yaml").unlink()
    out, mapping = tmp_path / "out", ic.kaggle(COPY, tmp_path / "k") / "LOC_synset_mapping.txt"
    assert _run("--src", root, "--out", out, "--split", "train", "--classes", mapping) == 0
    assert _run("--src", root, "--out", out, "--split", "val", "--classes", mapping) == 0
    _check(out, "train", N_TRAIN)
    got = _check(out, "val", N_VAL)
    assert [k for k, _, _ in got] == [Path(n).stem for n, _, _ in COPY.val]


def test_timm_release_without_class_names_or_with_a_short_download(tmp_path, capsys):
    root = ic.timm_wds(COPY, tmp_path / "wds")
    assert _run("--src", root, "--out", tmp_path / "o") == 2
    assert "pass --classes FILE (for ImageNet-1k: LOC_synset_mapping.txt" in capsys.readouterr().err
    assert _run("--src", root, "--out", tmp_path / "o", "--split", "test") == 2
    assert "holds the splits ['train', 'validation'], not test; pass --split" in capsys.readouterr().err
    (root / "imagenet1k-train-0001.tar").unlink()
    assert _run("--src", root, "--out", tmp_path / "o", "--classes", tmp_path / "x") == 2
    err = capsys.readouterr().err
    assert "cannot read class names file" in err
    (tmp_path / "c.json").write_text(json.dumps(ic.WNIDS))
    assert _run("--src", root, "--out", tmp_path / "o", "--classes", tmp_path / "c.json") == 2
    assert "train shards its _info lists are missing" in capsys.readouterr().err


def test_verify_never_takes_timms_info_for_a_split(tmp_path, capsys):
    root = ic.timm_wds(COPY, tmp_path / "imagenet-1k-wds")
    assert _run("--verify", root) == 2
    err = capsys.readouterr().err
    assert "this is timm's WebDataset release" in err and "_info" not in err.split("release")[0]
    out, mapping = tmp_path / "out", ic.kaggle(COPY, tmp_path / "k") / "LOC_synset_mapping.txt"
    assert _run("--src", root, "--out", out, "--split", "val", "--classes", mapping) == 0
    shutil.copy(root / "_info.json", out)  # beside our shards it is still no split
    assert _run("--verify", out) == 0
    assert "verify val:" in capsys.readouterr().out


def test_huggingface_parquet_release(tmp_path):
    root, out = ic.parquet(COPY, tmp_path / "imagenet-1k"), tmp_path / "out"
    assert _run("--src", root, "--out", out, "--split", "train", "--shard-size", 7) == 0
    assert _run("--src", root, "--out", out, "--split", "val") == 0
    _check(out, "train", N_TRAIN, classes=ic.WORDS)  # the card's names
    _check(out, "val", N_VAL, classes=ic.WORDS)
    one = root / "data" / "validation-00000-of-00001.parquet"  # a file alone: split val from its name
    assert _run("--src", one, "--out", tmp_path / "one") == 0
    assert _digests(tmp_path / "one") == {k: v for k, v in _digests(out).items() if k.startswith("val-")}


def test_parquet_test_split_is_refused(tmp_path, capsys):
    root = ic.parquet(COPY, tmp_path / "imagenet-1k")
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
    tar, kit = ic.val_tar(COPY, tmp_path), ic.devkit(COPY, tmp_path)
    monkeypatch.setitem(sys.modules, "scipy", None)  # import scipy.io fails as when not installed
    monkeypatch.setitem(sys.modules, "scipy.io", None)
    assert _run("--src", tar, "--out", tmp_path / "o", "--devkit", kit) == 2
    assert "pip install 'dcvit[devkit]'" in _one_error_line(capsys)


def test_parquet_without_pyarrow_says_which_extra(tmp_path, capsys, monkeypatch):
    root = ic.parquet(COPY, tmp_path / "imagenet-1k")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert _run("--src", root, "--out", tmp_path / "o") == 2
    assert "pip install 'dcvit[parquet]'" in _one_error_line(capsys)


def test_console_script_is_installed_and_the_wrapper_is_the_same_command(tmp_path):
    src = ic.train_folder(COPY, tmp_path / "train")
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
    src = ic.train_folder(COPY, tmp_path / "train")
    odd = src / os.fsdecode(ic.WNIDS[0].encode() + b"/" + b"\xff" * 120 + b".JPEG")
    shutil.copy(src / ic.WNIDS[1] / COPY.train[ic.WNIDS[1]][0][0], odd)  # another image's bytes
    out = tmp_path / "out"
    assert _run("--src", src, "--out", out, "--verify") == 0
    got = {key: label for key, _, label in _read_back(out, "train")}
    assert len(got) == N_TRAIN + 1
    (odd_key,) = [k for k in got if k.startswith(ic.WNIDS[0] + "____")]
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
    ic.train_folder(COPY, data / "imagenet" / "train")
    ic.val_flat(COPY, data / "imagenet" / "val")
    ic.train_tar(COPY, data)
    ic.val_tar(COPY, data)
    ic.devkit(COPY, data, as_tar_gz=True)
    ic.kaggle(COPY, data / "kaggle")
    shutil.copy(data / "kaggle" / "LOC_val_solution.csv", data / "imagenet")
    ic.timm_wds(COPY, data / "imagenet-1k-wds")
    ic.parquet(COPY, data / "imagenet-1k")
    ic.torchvision_root(COPY, data / "torchvision-imagenet")
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
    assert classes in (ic.WNIDS, ic.WORDS)
    _check(out, "train", N_TRAIN, classes)
    _check(out, "val", N_VAL, classes)
