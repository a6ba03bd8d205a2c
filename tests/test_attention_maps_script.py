"""scripts/attention_maps.py on a tiny DCViT: the PNG, checkpoint loading, the maps' layout."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import yaml
from PIL import Image

import dcvit
import dcvit.weights
from dcvit.cli import parse_kwargs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "attention_maps.py"
TINY = dict(img_size=32, patch_size=8, depth=2, embed_dim=24, num_heads=3)


def _load_script():
    spec = importlib.util.spec_from_file_location("attention_maps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


am = _load_script()


def _trained_like(**kwargs) -> torch.nn.Module:
    """A tiny DCViT with large dynamic weights, so that post-compose visibly changes maps."""
    torch.manual_seed(1)
    model = timm.create_model("dcvit_tiny", num_classes=10, **{**TINY, **kwargs}).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".core.dynamic_weights." in name:
                p.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    model = _trained_like()
    dcvit.save_weights(model, d / "model.safetensors")
    torch.save({"model": model.state_dict(), "epoch": 3}, d / "checkpoint.pth")
    (d / "config.yaml").write_text(yaml.safe_dump(
        {"model": "dcvit_tiny", "model_kwargs": TINY,
         "data": {"num_classes": 10, "mean": [0.1, 0.2, 0.3], "std": [0.5, 0.25, 2.0]}}))
    return d, model


def _check_png(out: Path, heads: int) -> None:
    with Image.open(out) as img:
        img.verify()
    with Image.open(out) as img:
        assert img.format == "PNG"
        assert img.size == am.figure_size(heads)
    assert not list(out.parent.glob("*.tmp"))


def test_main_writes_png_of_expected_size(run_dir, tmp_path, capsys):
    d, _ = run_dir
    out = tmp_path / "sub" / "maps.png"
    assert am.main(["--checkpoint", str(d / "model.safetensors"), "--digit", "7", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "saved" in printed and "blocks.1.attn" in printed
    _check_png(out, 3)


@pytest.mark.slow
def test_cli_subprocess(run_dir, tmp_path):
    d, _ = run_dir
    out = tmp_path / "maps.png"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--checkpoint", str(d / "checkpoint.pth"),
                           "--layer", "0", "--out", str(out)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "blocks.0.attn" in proc.stdout
    _check_png(out, 3)


def test_figure_grows_with_heads(tmp_path):
    model = _trained_like(num_heads=6)
    pic, x = am.load_image(model, None, 0)
    maps = am.query_maps(model, x, -1, None)
    out = am.plot_maps(pic, maps, "six heads", tmp_path / "m.png")
    with Image.open(out) as img:
        assert img.size == am.figure_size(6)
    assert am.figure_size(6)[0] > am.figure_size(3)[0]


def test_model_comes_from_config_beside_checkpoint(run_dir):
    d, _ = run_dir
    name, kwargs = am.resolve_model(None, {}, d / "checkpoint.pth")
    assert name == "dcvit_tiny" and kwargs == {**TINY, "num_classes": 10}
    # Flags override the config.
    name, kwargs = am.resolve_model("dcvit_small", {"depth": 1}, d / "checkpoint.pth")
    assert name == "dcvit_small" and kwargs["depth"] == 1 and kwargs["embed_dim"] == 24


def test_normalisation_comes_from_the_run(run_dir):
    d, model = run_dir
    run = am.read_run_config(d / "model.safetensors", {})
    assert run["mean"] == [0.1, 0.2, 0.3] and run["std"] == [0.5, 0.25, 2.0]
    pic, x = am.load_image(model, None, 3, run["mean"], run["std"])
    pixels = torch.tensor(np.asarray(pic), dtype=torch.float32) / 255.0         # (H, W, 3)
    for c in range(3):
        expected = (pixels[..., c] - run["mean"][c]) / run["std"][c]
        torch.testing.assert_close(x[0, c], expected)


def test_training_checkpoint_arch_and_ema(tmp_path):
    """A `python -m train_imagenet` checkpoint without config.yaml: arch entry, EMA weights."""
    model, ema = _trained_like(), _trained_like()
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(0.01)
    arch = {"model": "dcvit_tiny", "model_kwargs": TINY, "num_classes": 10}
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "epoch": 2, "arch": arch},
               tmp_path / "ckpt-e0002-u00000010.pth")
    torch.save({"model": model.state_dict(), "ema": None, "arch": arch}, tmp_path / "no_ema.pth")
    ckpt = tmp_path / "ckpt-e0002-u00000010.pth"
    name, kwargs = am.resolve_model(None, {}, ckpt)
    assert name == "dcvit_tiny" and kwargs == {**TINY, "num_classes": 10}
    _, x = am.load_image(model, None, 1)
    torch.testing.assert_close(am.build_model(name, kwargs, ckpt)(x), model(x))
    torch.testing.assert_close(am.build_model(name, kwargs, ckpt, ema=True)(x), ema(x))
    with pytest.raises(ValueError, match="no EMA weights.*drop --ema"):
        am.build_model(name, kwargs, tmp_path / "no_ema.pth", ema=True)


def test_run_directory_means_its_newest_checkpoint(tmp_path):
    for name in ("ckpt-e0002-u00000040.pth", "ckpt-e0010-u00000200.pth", "ckpt-e0009-u00000180.pth"):
        (tmp_path / name).write_bytes(b"")
    assert am.find_checkpoint(tmp_path).name == "ckpt-e0010-u00000200.pth"
    assert am.find_checkpoint(tmp_path / "ckpt-e0002-u00000040.pth").name == "ckpt-e0002-u00000040.pth"
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no ckpt-e"):
        am.find_checkpoint(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        am.find_checkpoint(tmp_path / "missing")


def test_num_classes_from_checkpoint_without_config(tmp_path):
    model = timm.create_model("dcvit_tiny", num_classes=7, **TINY)
    dcvit.save_weights(model, tmp_path / "w.safetensors")
    name, kwargs = am.resolve_model(None, parse_kwargs(
        ["img_size=32", "patch_size=8", "depth=2", "embed_dim=24", "num_heads=3"]), tmp_path / "w.safetensors")
    assert kwargs == {**TINY, "num_classes": 7}


@pytest.mark.parametrize("ckpt", ["model.safetensors", "checkpoint.pth"])
def test_checkpoint_weights_are_used(run_dir, ckpt):
    d, reference = run_dir
    name, kwargs = am.resolve_model(None, {}, d / ckpt)
    model = am.build_model(name, kwargs, d / ckpt)
    _, x = am.load_image(model, None, 4)
    torch.testing.assert_close(model(x), reference(x))


def test_maps_are_the_query_row_on_the_patch_grid(run_dir):
    _, model = run_dir
    _, x = am.load_image(model, None, 2)
    maps = am.query_maps(model, x, 1, 0)
    rec = dcvit.attention_maps(model, x)[1]
    gh, gw = model.patch_embed.grid_size
    for h in range(3):
        for i in range(gh):
            for j in range(gw):
                assert maps["before"][h, i, j] == rec["weights_before"][0, h, 0, 1 + i * gw + j]
                assert maps["after"][h, i, j] == rec["weights_after"][0, h, 0, 1 + i * gw + j]
    # Softmax weights over all keys (CLS + patches) sum to one; composition changed them.
    cls = rec["weights_before"][0, :, 0, 0].numpy()
    assert abs(maps["before"].sum(axis=(1, 2)) + cls - 1).max() < 1e-5
    assert abs(maps["after"] - maps["before"]).max() > 1e-3


def test_image_file_and_query_patch(tmp_path):
    model = _trained_like(class_token=False, global_pool="avg")
    Image.new("RGB", (50, 40), (200, 10, 10)).save(tmp_path / "red.png")
    pic, x = am.load_image(model, tmp_path / "red.png", 0)
    assert pic.size == (32, 32) and x.shape == (1, 3, 32, 32)
    maps = am.query_maps(model, x, 0, None)                 # no prefix token: centre patch
    assert maps["prefix"] == 0 and maps["query"] == 2 * 4 + 2
    assert abs(maps["before"].sum(axis=(1, 2)) - 1).max() < 1e-5


def test_errors_name_the_bad_value():
    model = _trained_like(dcmha_layers=[0])
    _, x = am.load_image(model, None, 0)
    with pytest.raises(ValueError, match=r"block 1 has no DCMHA.*DCMHA blocks: \[0\]"):
        am.query_maps(model, x, 1, None)
    with pytest.raises(ValueError, match="--layer 5"):
        am.query_maps(model, x, 5, None)
    with pytest.raises(ValueError, match="--query 99"):
        am.query_maps(model, x, 0, 99)
    with pytest.raises(ValueError, match="img_size"):
        parse_kwargs(["img_size"])
    with pytest.raises(ValueError, match="--digit"):
        am.load_image(model, None, 5000)


def test_pre_compose_only_and_register_tokens():
    """Without post-compose the maps are softmax(scores) around pre-compose; prefix tokens
    (CLS + registers) are left out of the patch grid."""
    model = _trained_like(post_compose=False, reg_tokens=2)
    _, x = am.load_image(model, None, 0)
    maps = am.query_maps(model, x, -1, None)
    assert maps["stage"].startswith("pre-compose") and maps["prefix"] == 3
    assert maps["before"].shape == (3, 4, 4)
    rec = dcvit.attention_maps(model, x)[-1]
    after = rec["scores_after"][0, :, 0].softmax(-1)                     # (H, N), CLS query
    torch.testing.assert_close(torch.from_numpy(maps["after"]).reshape(3, 16), after[:, 3:])


def test_checkpoint_of_a_converted_run(tmp_path):
    """A fine-tuning run's checkpoint of a ViT converted to DCMHA: converted again from its arch."""
    model = dcvit.convert(timm.create_model("vit_tiny_patch16_224", num_classes=10, **TINY), init="paper").eval()
    arch = {"model": "vit_tiny_patch16_224", "model_kwargs": TINY, "num_classes": 10,
            "convert": {"layers": None, "options": {}}}
    ckpt = tmp_path / "ckpt-e0001-u00000010.pth"
    torch.save({"model": model.state_dict(), "ema": None, "arch": arch}, ckpt)
    state = dcvit.weights.read_state_dict(ckpt)
    run = am.read_run_config(ckpt, state)
    name, kwargs = am.resolve_model(None, {}, ckpt, state)
    rebuilt = am.build_model(name, kwargs, ckpt, state=state, convert=run["convert"])
    _, x = am.load_image(model, None, 2)
    torch.testing.assert_close(rebuilt(x), model(x))
    maps = am.query_maps(rebuilt, x, -1, None)
    assert maps["before"].shape == maps["after"].shape
