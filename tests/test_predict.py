"""python -m train_imagenet.predict: a real (tiny) training run's checkpoint classifies digits
from a folder and from shards, to CSV and JSON, with the names of classes.json; the model's
own logits and preprocessing give the same classes and probabilities; bad input exits 2."""
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import dcvit
from train_imagenet.__main__ import main as train
from train_imagenet.checkpoint import list_checkpoints, load_checkpoint
from train_imagenet.predict import main

from train_helpers import digits, write_folder, write_shards

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
KWARGS = dict(img_size=32, patch_size=8, depth=1, embed_dim=24, num_heads=2)
TINY = ["model=dcvit_tiny", "model_kwargs={img_size: 32, patch_size: 8, depth: 1, embed_dim: 24, num_heads: 2}",
        "data.num_classes=10", "data.img_size=32", "data.num_workers=0", "data.shuffle_buffer=16",
        "data.crop_pct=1.0", "data.interpolation=bilinear", "data.mean=[0.2, 0.3, 0.4]",
        "data.std=[0.5, 0.6, 0.7]", "batch_size=8", "epochs=1", "aug.no_aug=true", "aug.mixup=0",
        "aug.cutmix=0", "ema.enabled=true", "ema.decay=0.5", "optim.lr=3e-3", "optim.lr_batch_size=null",
        "sched.warmup_epochs=0", "threads=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A one-epoch run on digit shards that have a classes.json, and 6 other digits as images."""
    root = tmp_path_factory.mktemp("predict")
    x, y = digits(70)
    write_shards(str(root / "data"), "train", x[:48], y[:48], 16)
    write_shards(str(root / "data"), "val", x[48:64], y[48:64], 8)
    (root / "data" / "classes.json").write_text(json.dumps(NAMES))
    assert train([f"data.train={root / 'data'}", f"data.val={root / 'data'}",
                  f"output_dir={root / 'run'}", *TINY]) == 0
    folder = write_folder(str(root / "images"), x[64:], y[64:])
    return root, list_checkpoints(str(root / "run"))[-1], folder, x[64:], y[64:]


def _reference(ckpt, images, which="model"):
    """Softmax of the checkpoint's weights on the images, preprocessed by hand (no resize at
    crop_pct 1.0 and 32 px: scale to [0, 1], then the run's mean and std)."""
    model = timm.create_model("dcvit_tiny", num_classes=10, **KWARGS).eval()
    model.load_state_dict(load_checkpoint(ckpt)[which])
    x = (torch.tensor(images, dtype=torch.float32) / 255 - torch.tensor([0.2, 0.3, 0.4])) / torch.tensor([0.5, 0.6, 0.7])
    with torch.no_grad():
        return model(x.permute(0, 3, 1, 2)).softmax(-1)


def _check_top(rows_top, probs, k):
    p, c = probs.topk(k)
    assert [t["class"] for t in rows_top] == c.tolist()
    assert [t["name"] for t in rows_top] == [NAMES[i] for i in c.tolist()]
    np.testing.assert_allclose([t["prob"] for t in rows_top], p.numpy(), rtol=1e-5, atol=1e-6)


def test_folder_to_json_with_names_and_the_runs_preprocessing(run, tmp_path, capsys):
    root, ckpt, folder, x, _ = run
    out = tmp_path / "preds.json"
    assert main([str(root / "run"), folder, "--out", str(out), "--top-k", "3"]) == 0   # the run directory
    res = json.loads(out.read_text())
    assert res["checkpoint"] == ckpt and res["top_k"] == 3 and res["skipped"] == []
    assert res["classes"] == str(root / "data" / "classes.json")      # the run's training shards
    files = sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*.png"))
    assert [r["image"] for r in res["predictions"]] == files            # class_DD/IIIII.png, path order
    probs = _reference(ckpt, x)
    for row in res["predictions"]:
        _check_top(row["top"], probs[int(Path(row["image"]).stem)], 3)    # write_folder names files by index
    assert "6 images classified, 0 skipped" in capsys.readouterr().err


def test_shards_to_csv_keep_labels_and_ema_weights_differ(run, tmp_path):
    root, ckpt, _, _, _ = run
    out = tmp_path / "preds.csv"
    assert main([ckpt, str(root / "data" / "val-{000000..000001}.tar"), "--out", str(out),
                 "--ema", "--batch-size", "5"]) == 0
    rows = list(csv.DictReader(out.open()))
    x, y = digits(64)
    assert [r["image"] for r in rows] == [f"val-00000{i // 8}.tar/{i:08d}" for i in range(16)]
    assert [int(r["label"]) for r in rows] == y[48:64].tolist()
    probs = _reference(ckpt, x[48:64], "ema")
    for r, pr in zip(rows, probs):
        top = [{"class": int(r[f"class_{i}"]), "name": r[f"name_{i}"], "prob": float(r[f"prob_{i}"])}
               for i in range(1, 6)]
        _check_top(top, pr, 5)
    assert not torch.allclose(probs, _reference(ckpt, x[48:64], "model"))   # --ema did choose


def test_corrupt_images_are_skipped_and_counted_or_refused(run, tmp_path, capsys):
    root, ckpt, folder, _, _ = run
    images = tmp_path / "imgs"
    shutil.copytree(folder, images)
    (images / "class_04" / "broken.png").write_bytes(b"not a png")
    out = tmp_path / "p.json"
    assert main([ckpt, str(images), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["predictions"]) == 6 and [s["image"] for s in res["skipped"]] == ["class_04/broken.png"]
    assert "skipped class_04/broken.png" in capsys.readouterr().err
    out2 = tmp_path / "q.json"
    assert main([ckpt, str(images), "--out", str(out2), "--on-corrupt", "fail"]) == 2
    assert "broken.png" in capsys.readouterr().err and not out2.exists()


def test_save_pretrained_folder_uses_its_config_and_label_names(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model("dcvit_tiny", num_classes=10, **KWARGS).eval()
    hub = dcvit.save_pretrained(model, tmp_path / "hub", label_names=NAMES)
    x, _ = digits(4)
    folder = write_folder(str(tmp_path / "images"), x, [0] * 4)
    out = tmp_path / "p.json"
    assert main([str(hub), folder, "--out", str(out), "--top-k", "2"]) == 0
    res = json.loads(out.read_text())
    t = timm.data.create_transform(input_size=32, interpolation="bicubic", crop_pct=0.875,   # the model's
                                   mean=(0.5,) * 3, std=(0.5,) * 3)                          # size, dcvit's cfg
    with torch.no_grad():
        probs = model(torch.stack([t(Image.fromarray(im)) for im in x])).softmax(-1)
    for row in res["predictions"]:
        _check_top(row["top"], probs[int(Path(row["image"]).stem)], 2)


def test_errors_exit_2_and_name_the_fix(run, tmp_path, capsys):
    root, ckpt, folder, _, _ = run
    out = str(tmp_path / "p.csv")
    weights = tmp_path / "w.pth"
    torch.save({"model": load_checkpoint(ckpt)["model"]}, weights)
    damaged = tmp_path / "ckpt-e0001-u00000006.pth"
    damaged.write_bytes(Path(ckpt).read_bytes()[:1000])
    names = tmp_path / "names.json"
    names.write_text(json.dumps(NAMES[:3]))
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "dir.csv").mkdir()
    cases = [
        ([str(weights), folder, "--out", out], "not a training checkpoint"),
        ([str(damaged), folder, "--out", out], "cannot be read"),
        ([str(tmp_path / "nowhere"), folder, "--out", out], "does not exist"),
        ([str(tmp_path / "x.safetensors"), folder, "--out", out], "does not exist"),
        ([ckpt, folder, "--out", out, "--classes", str(names)], "3 class names"),
        ([ckpt, str(empty), "--out", out], "no images"),
        ([ckpt, folder, "--out", str(tmp_path / "p.txt")], "name a .csv or a .json"),
        ([ckpt, folder, "--out", str(empty)], "is a directory"),
        ([ckpt, folder, "--out", str(tmp_path / "dir.csv")], "is a directory"),
        ([ckpt, str(tmp_path / "val-{000000..000003}.tar"), "--out", out], "shards are missing"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not os.path.exists(out)


@pytest.mark.slow
def test_module_runs_as_a_command(run, tmp_path):
    root, ckpt, folder, _, _ = run
    out = tmp_path / "p.csv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "train_imagenet.predict", ckpt, folder, "--out", str(out),
                           "--top-k", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().splitlines()[0] == "image,class_1,name_1,prob_1"


def test_class_names_from_classes_option_then_the_images_shards_else_indices(run, tmp_path, capsys):
    root, _, folder, _, _ = run
    torch.manual_seed(0)
    hub = dcvit.save_pretrained(timm.create_model("dcvit_tiny", num_classes=10, **KWARGS), tmp_path / "hub")
    shards = str(root / "data" / "val-000000.tar")                # beside ../classes.json
    other = tmp_path / "other.json"
    other.write_text(json.dumps([n.upper() for n in NAMES]))
    cases = [([str(hub), shards, "--classes", str(other)], str(other), [n.upper() for n in NAMES]),
             ([str(hub), shards], str(root / "data" / "classes.json"), NAMES),
             ([str(hub), folder], None, None)]
    for argv, source, names in cases:
        out = tmp_path / "p.json"
        assert main([*argv, "--out", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["classes"] == source
        for row in res["predictions"]:
            assert [t["name"] for t in row["top"]] == [names[t["class"]] if names else None for t in row["top"]]
    assert "no class names found" in capsys.readouterr().err


def _probs_of(ckpt, folder, tmp_path, name="p.json"):
    out = tmp_path / name
    assert main([ckpt, str(folder), "--out", str(out), "--top-k", "10"]) == 0
    rows = json.loads(out.read_text())["predictions"]
    return {r["image"]: {t["class"]: t["prob"] for t in r["top"]} for r in rows}


def test_16bit_and_exif_rotated_images_classified_as_they_show(run, tmp_path):
    """A 16-bit copy of a digit and a copy stored sideways with an EXIF orientation get the
    same probabilities as the 8-bit upright image (both read as the picture they show)."""
    _, ckpt, _, x, _ = run
    folder = tmp_path / "odd"
    folder.mkdir()
    grey = x[0, :, :, 0]
    Image.fromarray(x[0]).save(folder / "a_8bit.png")
    Image.fromarray(grey.astype(np.uint16) * 257).save(folder / "b_16bit.png")     # 16-bit greyscale
    sideways = Image.fromarray(np.rot90(x[0], k=1).copy())       # stored turned 90 degrees left
    exif = sideways.getexif()
    exif[0x0112] = 6                                             # shown turned 90 degrees right
    sideways.save(folder / "c_exif.png", exif=exif.tobytes())
    probs = _probs_of(ckpt, folder, tmp_path)
    expected = _reference(ckpt, x[:1])[0]
    for name in ("a_8bit.png", "b_16bit.png", "c_exif.png"):
        got = torch.tensor([probs[name][c] for c in range(10)])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_linked_subfolder_followed_and_non_utf8_name_in_csv(run, tmp_path, capsys):
    """The predictor walks a folder by the converter's rule (a linked sub-folder is read),
    and a file name that is not UTF-8 is written to CSV as \\xNN escapes, nothing lost."""
    _, ckpt, folder, x, _ = run
    images = tmp_path / "imgs"
    images.mkdir()
    os.symlink(os.path.abspath(folder), images / "linked")
    raw = os.path.join(os.fsencode(images), b"caf\xe9.png")     # latin-1 bytes: not UTF-8
    Image.fromarray(x[1]).save(open(raw, "wb"), format="PNG")
    out = tmp_path / "p.csv"
    assert main([ckpt, str(images), "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open(encoding="utf-8")))
    assert len(rows) == 7 and sum(r["image"].startswith("linked/") for r in rows) == 6
    assert rows[0]["image"] == "caf\\xe9.png"
    err = capsys.readouterr().err
    assert "1 image name(s) are not valid UTF-8" in err and "7 images classified" in err
    os.symlink(images, images / "loop")
    assert main([ckpt, str(images), "--out", str(tmp_path / "q.csv")]) == 2
    assert f"{images / 'loop'} -> {os.path.realpath(images)}: already read as {images}" in capsys.readouterr().err
