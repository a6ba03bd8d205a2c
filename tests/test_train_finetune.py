"""Fine-tuning with DCMHA in `python -m train_imagenet`: pretrained file -> convert -> train;
evaluation and resume of a converted run; checkpoints across the conversion."""
import json
from pathlib import Path

import pytest
import timm
import torch

import dcvit
import dcvit.weights
from train_imagenet.__main__ import build_model, main
from train_imagenet.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, load_model_weights
from train_imagenet.config import load_config
from train_imagenet.finetune import param_group_fn

KWARGS = "model_kwargs={img_size: 32, patch_size: 8, depth: 2, embed_dim: 24, num_heads: 2}"
TINY = ["model=vit_tiny_patch16_224", KWARGS,
        "data.num_classes=10", "data.img_size=32", "data.num_workers=0", "data.shuffle_buffer=16",
        "data.crop_pct=1.0", "data.interpolation=bilinear", "batch_size=8", "optim.lr=2e-3",
        "optim.lr_batch_size=null", "sched.warmup_epochs=0", "sched.min_lr=1e-5", "epochs=1",
        "threads=1", "aug.no_aug=true", "aug.mixup=0", "aug.cutmix=0"]
CONVERT = ["convert.enabled=true", "convert.lr_mult=10", "convert.weight_decay=0",
           "convert.options={rank: 1}"]


@pytest.fixture(scope="module")
def data(digits_shards):
    return digits_shards(n_train=80, n_val=32, train_per_shard=40, val_per_shard=32).root


@pytest.fixture(scope="module")
def pretrained(data, tmp_path_factory):
    """A trained ViT: its run directory and its weights as .safetensors."""
    out = tmp_path_factory.mktemp("pre")
    assert _run(data, out / "vit") == 0
    ckpt = list_checkpoints(str(out / "vit"))[-1]
    model = timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=8,
                              depth=2, embed_dim=24, num_heads=2)
    model.load_state_dict(load_checkpoint(ckpt)["model"])
    dcvit.save_weights(model, out / "vit.safetensors")
    return ckpt, str(out / "vit.safetensors")


def _run(data, out, *extra):
    return main([f"data.train={data}", f"data.val={data}", f"output_dir={out}", *TINY, *extra])


def _json(path):
    with open(path) as f:
        return json.load(f)


def test_converted_model_evaluates_as_the_pretrained_one(data, pretrained, tmp_path, caplog):
    ckpt, _ = pretrained
    assert _run(data, tmp_path / "plain", "--eval-only", f"checkpoint={ckpt}") == 0
    assert _run(data, tmp_path / "dc", "--eval-only", f"checkpoint={ckpt}", *CONVERT) == 0
    plain, dc = _json(tmp_path / "plain" / "eval.json"), _json(tmp_path / "dc" / "eval.json")
    assert dc["top1"] == plain["top1"] and dc["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert plain["convert"] is None and dc["convert"] == {"layers": None, "options": {"rank": 1}}
    assert "6 DCMHA tensors keep their initialisation: blocks.0.attn.core.dynamic_weights.dw1" in caplog.text


def test_fine_tune_from_pretrained_file_then_eval_and_resume(data, pretrained, tmp_path, capsys):
    _, weights = pretrained
    run = tmp_path / "ft"
    assert _run(data, run, f"pretrained={weights}", *CONVERT) == 0
    state = load_checkpoint(list_checkpoints(str(run))[-1])
    assert state["arch"]["convert"] == {"layers": None, "options": {"rank": 1}}
    groups = state["optimizer"]["param_groups"]
    dc = [g for g in groups if g.get("lr_scale") == 10]
    assert len(dc) == 1 and dc[0]["weight_decay"] == 0
    assert any(k.endswith("attn.core.dynamic_weights.qkw") for k in state["model"])
    # Evaluating the converted run's checkpoint needs no convert.* settings: the checkpoint has them.
    assert _run(data, tmp_path / "ev", "--eval-only", f"checkpoint={list_checkpoints(str(run))[-1]}") == 0
    assert _json(tmp_path / "ev" / "eval.json")["top1"] == _json(run / "eval.json")["top1"]
    assert "is of a model converted to DCMHA: converting with" in capsys.readouterr().err
    # Resuming it for a second epoch, with neither the pretrained file nor the convert settings.
    assert _run(data, run, "epochs=2", "resume=auto") == 0
    assert load_checkpoint(list_checkpoints(str(run))[-1])["epoch"] == 2


def test_pretrained_file_loads_into_the_model_before_conversion(pretrained):
    _, weights = pretrained
    cfg = load_config(None, TINY + [f"pretrained={weights}"])
    model = build_model(cfg)
    expected = dcvit.weights.read_state_dict(weights)
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert "state_dict" not in model.pretrained_cfg


def test_pretrained_file_of_a_converted_model_is_refused(data, pretrained, tmp_path, capsys):
    _, weights = pretrained
    model = dcvit.convert(build_model(load_config(None, TINY + [f"pretrained={weights}"])))
    dcvit.save_weights(model, tmp_path / "dc.safetensors")
    assert _run(data, tmp_path / "x", f"pretrained={tmp_path / 'dc.safetensors'}") == 2
    assert "is a model converted to DCMHA" in capsys.readouterr().err
    with pytest.raises(ValueError, match="comes from a model converted to DCMHA.*not converted; convert it first"):
        dcvit.load_weights(build_model(load_config(None, TINY)), tmp_path / "dc.safetensors")
    with pytest.raises(CheckpointError, match="converted to DCMHA"):
        load_model_weights(build_model(load_config(None, TINY)), model.state_dict(), "dc.pth")


def test_other_convert_options_than_the_checkpoints_are_an_error(data, pretrained, tmp_path, capsys):
    _, weights = pretrained
    run = tmp_path / "ft"
    assert _run(data, run, f"pretrained={weights}", *CONVERT) == 0
    ckpt = list_checkpoints(str(run))[-1]
    assert _run(data, tmp_path / "ev", "--eval-only", f"checkpoint={ckpt}", "convert.enabled=true",
                "convert.options={rank: 2}") == 2
    assert "was converted with" in capsys.readouterr().err


def test_bad_convert_settings_are_config_errors(data, tmp_path, capsys):
    assert _run(data, tmp_path / "a", "convert.enabled=true", "convert.options={rnak: 1}") == 2
    assert "unknown DCMHA option" in capsys.readouterr().err
    assert _run(data, tmp_path / "b", "convert.init=zero") == 2
    assert _run(data, tmp_path / "c", "pretrained=/no/such/file.safetensors") == 2
    assert "does not exist" in capsys.readouterr().err


def test_parameter_groups_of_a_converted_model():
    cfg = load_config(None, TINY + CONVERT + ["optim.weight_decay=0.05"])
    model = build_model(cfg)
    groups = param_group_fn(cfg, 0.05)(model)
    new = {id(p) for _, p in dcvit.conversion.dcmha_parameters(model)}
    assert [len(g["params"]) for g in groups if g.get("lr_scale") == 10] == [len(new)]
    rest = [p for g in groups if "lr_scale" not in g for p in g["params"]]
    assert len(rest) + len(new) == len(list(model.parameters())) and not new & {id(p) for p in rest}
    assert {g["weight_decay"] for g in groups if "lr_scale" not in g} == {0.0, 0.05}


def test_big_vision_npz_is_read_by_the_models_loader_then_converted():
    """``pretrained=params.npz`` goes to the model's own ``load_pretrained`` (the authors'
    big_vision ViT fixture); the converted model computes what the loaded one does."""
    npz = Path(__file__).parent / "fixtures" / "bigvision_vit_params.npz"
    size = "model_kwargs={img_size: 16, patch_size: 4, embed_dim: 16, depth: 2, num_heads: 4, mlp_ratio: 2.0}"
    base = ["model=vit_tiny_patch16_bv_224", size, "data.num_classes=10", "data.img_size=16", f"pretrained={npz}"]
    plain = build_model(load_config(None, base)).eval()
    converted = build_model(load_config(None, base + ["convert.enabled=true"])).eval()
    expected = timm.create_model("vit_tiny_patch16_bv_224", pretrained=True, img_size=16, patch_size=4,
                                 embed_dim=16, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=10,
                                 pretrained_cfg_overlay=dict(file=str(npz))).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(plain(x), expected(x))
        ref = expected(x)
        assert ((converted(x) - ref).abs().max() / ref.abs().max()).item() <= 1e-6
    assert dcvit.conversion.is_converted(converted)


@pytest.mark.parametrize("name", ["dcvit_tiny", "dcvit_tiny_patch16_224"])
def test_plain_vit_file_as_pretrained_of_a_dcvit(pretrained, tmp_path, name, caplog):
    """``pretrained=`` a plain ViT's file with ``model=dcvit_*`` (an alias with no pretrained
    cfg of its own included) loads it as ``checkpoint=`` does: every ViT tensor is the file's,
    the DCMHA tensors keep their initialisation; the DCViT's own file then loads whole."""
    _, weights = pretrained
    cfg = load_config(None, [f"model={name}"] + TINY[1:] + [f"pretrained={weights}"])
    model = build_model(cfg)
    vit = dcvit.weights.read_state_dict(weights)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in vit.items())
    assert len(state) - len(vit) == 6 and "6 DCMHA tensors keep their initialisation" in caplog.text
    with torch.no_grad():
        for k, v in state.items():
            if k not in vit:
                v.add_(1.0)
    dcvit.save_weights(model, tmp_path / "dc.safetensors")
    again = build_model(load_config(None, [f"model={name}"] + TINY[1:] + [f"pretrained={tmp_path / 'dc.safetensors'}"]))
    assert all(torch.equal(v, state[k]) for k, v in again.state_dict().items())
