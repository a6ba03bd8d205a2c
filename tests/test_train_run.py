"""End-to-end runs of `python -m train_imagenet` in this process (one rank, CPU): evaluation
against a hand count, resume equivalence, and the errors raised before training starts."""
import importlib.util
import json
import os
import shutil

import numpy as np
import pytest
import torch

import train_imagenet.__main__ as entry_mod
from train_imagenet.start import load_start_weights
from train_imagenet.__main__ import main
from train_imagenet.checkpoint import list_checkpoints, load_checkpoint
from train_imagenet.distributed import DistInfo

from train_helpers import TINY_RUN, nan_loss_at

TINY = [*TINY_RUN, "sched.min_lr=1e-5", "epochs=2"]


@pytest.fixture(scope="module")
def data(digits_shards):
    return digits_shards()        # 96 train samples in 4 shards; 53 val samples: 20, 20, 13


def _run(data, out, *extra):
    return main([f"data.train={data.root}", f"data.val={data.root}", f"output_dir={out}", *TINY, *extra])


def _json(path):
    with open(path) as f:
        return json.load(f)


def test_eval_equals_hand_count(data, tmp_path):
    """eval.json's top-1/top-5 equal a count by hand over every val image (uneven last batch)."""
    x_val, y_val = data.x_val, data.y_val
    assert _run(data, tmp_path / "run", "epochs=1", "aug.no_aug=true", "aug.mixup=0",
                "aug.cutmix=0", "batch_size=8") == 0
    ckpt = list_checkpoints(str(tmp_path / "run"))[-1]
    assert _run(data, tmp_path / "ev", "--eval-only", f"checkpoint={ckpt}", "batch_size=6") == 0
    res = _json(tmp_path / "ev" / "eval.json")

    import timm
    model = timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=8,
                              depth=1, embed_dim=24, num_heads=2)
    model.load_state_dict(load_checkpoint(ckpt)["model"])
    model.eval()
    mean, std = np.array(model.pretrained_cfg["mean"]), np.array(model.pretrained_cfg["std"])
    img = (x_val.astype(np.float64) / 255.0 - mean) / std            # (N, 32, 32, 3), no resize
    with torch.no_grad():
        logits = model(torch.tensor(img, dtype=torch.float32).permute(0, 3, 1, 2))
    rank_of_target = (logits > logits[torch.arange(len(y_val)), torch.tensor(y_val)][:, None]).sum(1)
    top1 = 100.0 * (rank_of_target == 0).float().mean().item()
    top5 = 100.0 * (rank_of_target < 5).float().mean().item()
    assert res["num_samples"] == len(y_val) == 53
    assert res["top1"] == pytest.approx(top1, abs=1e-4) and res["top5"] == pytest.approx(top5, abs=1e-4)
    for key in ("model", "model_kwargs", "img_size", "num_classes", "checkpoint", "ema"):
        assert key in res
    assert res["checkpoint"] == ckpt and res["ema"] is False


def test_resume_mid_epoch_matches_uninterrupted(data, tmp_path):
    """A run restarted from a mid-epoch checkpoint (RandAugment, mixup/cutmix, drop-path and
    EMA all on) ends with the same weights and metrics as the uninterrupted run."""
    aug = ["aug.auto_augment=rand-m9-mstd0.5-inc1", "aug.reprob=0.25", "aug.mixup=0.8",
           "aug.cutmix=1.0", "drop_path=0.1", "ema.enabled=true", "ema.decay=0.9",
           "save_every_steps=5", "keep_checkpoints=20"]
    full = tmp_path / "full"
    assert _run(data, full, *aug) == 0
    mid = [p for p in list_checkpoints(str(full)) if load_checkpoint(p)["batch"] > 0]
    assert mid, "expected a mid-epoch checkpoint"
    state = load_checkpoint(mid[-1])
    assert state["epoch"] == 1 and 0 < state["batch"] < 12
    resumed = tmp_path / "resumed"
    os.makedirs(resumed)
    shutil.copy(mid[-1], resumed)                      # as if killed right after this save
    assert _run(data, resumed, *aug, "resume=auto") == 0
    a, b = load_checkpoint(list_checkpoints(str(full))[-1]), load_checkpoint(list_checkpoints(str(resumed))[-1])
    assert a["update"] == b["update"] == 24
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
        assert torch.equal(a["ema"][k], b["ema"][k]), k
    assert _json(full / "eval.json")["top1"] == _json(resumed / "eval.json")["top1"]
    assert _json(full / "eval_ema.json")["top1"] == _json(resumed / "eval_ema.json")["top1"]


def test_nan_loss_stops_and_keeps_last_good_checkpoint(data, tmp_path, capsys, monkeypatch):
    nan_loss_at(monkeypatch, 7)
    out = tmp_path / "nan"
    assert _run(data, out, "save_every_steps=4") == 3
    err = capsys.readouterr().err
    assert "loss is nan" in err and "update 7" in err and "last good checkpoint" in err
    ckpts = list_checkpoints(str(out))
    assert [load_checkpoint(p)["update"] for p in ckpts] == [4]
    assert os.path.basename(ckpts[0]) in err
    assert all(torch.isfinite(v).all() for v in load_checkpoint(ckpts[0])["model"].values())
    assert not (out / "eval.json").exists()


def test_wrong_architecture_checkpoint(data, tmp_path, capsys):
    assert _run(data, tmp_path / "a", "epochs=1", "aug.mixup=0", "aug.cutmix=0") == 0
    ckpt = list_checkpoints(str(tmp_path / "a"))[-1]
    other = ["model_kwargs={img_size: 32, patch_size: 8, depth: 2, embed_dim: 24, num_heads: 2}"]
    assert _run(data, tmp_path / "b", "--eval-only", f"checkpoint={ckpt}", *other) == 2
    assert "differs in: model_kwargs" in capsys.readouterr().err
    assert _run(data, tmp_path / "c", f"resume={ckpt}", "model=dcvit_tiny") == 2
    assert "differs in: model" in capsys.readouterr().err
    bare = tmp_path / "bare.pth"                        # weights only, no metadata
    torch.save(load_checkpoint(ckpt)["model"], bare)
    assert _run(data, tmp_path / "d", "--eval-only", f"checkpoint={bare}", *other) == 2
    assert "it is not a checkpoint of this architecture" in capsys.readouterr().err
    assert not (tmp_path / "b" / "eval.json").exists()


@pytest.mark.parametrize("args, message", [
    (["optim.lr_rate=1"], "did you mean 'optim.lr'"),
    (["data.train=/nonexistent/train-{000000..000003}.tar"], "4 of 4 shards are missing"),
    (["data.num_classes=4"], "set data.num_classes=10"),
    (["data.img_size=64"], "set model_kwargs.img_size=64"),
    (["model=vit_tiny_patch16_22"], "did you mean 'vit_tiny_patch16_224'"),
    (["amp=fp16"], "amp=fp16 needs a CUDA device"),
    pytest.param(["tensorboard=true"], "needs the tensorboard package", marks=pytest.mark.skipif(
        importlib.util.find_spec("tensorboard") is not None,
        reason="tensorboard is installed")),
])
def test_bad_input_fails_before_training(data, tmp_path, capsys, args, message):
    assert _run(data, tmp_path / "x", *args) == 2
    assert message in capsys.readouterr().err
    assert not any(n.startswith("ckpt") for n in os.listdir(tmp_path / "x")) if (tmp_path / "x").exists() else True


def test_accumulation_equals_larger_batch_and_logs_are_written(data, tmp_path):
    plain = ["aug.no_aug=true", "aug.mixup=0", "aug.cutmix=0", "aug.smoothing=0", "drop_path=0",
             "epochs=1"]
    assert _run(data, tmp_path / "big", *plain, "batch_size=16") == 0
    assert _run(data, tmp_path / "acc", *plain, "batch_size=8", "accum_steps=2") == 0
    a, b = (load_checkpoint(list_checkpoints(str(tmp_path / d))[-1]) for d in ("big", "acc"))
    assert a["update"] == b["update"] == 6
    assert max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"]) < 1e-5
    with open(tmp_path / "acc" / "log.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["epoch"] for r in records] == [0]
    for key in ("train_loss", "lr", "top1", "top5", "img_per_s", "epoch_time_s", "peak_mem_mb"):
        assert key in records[0]
    with open(tmp_path / "acc" / "summary.csv") as f:
        header, row = f.read().strip().split("\n")
    assert header.startswith("epoch,train_loss,lr,top1,top5") and row.startswith("0,")
    assert os.path.exists(tmp_path / "acc" / "config.yaml")


def test_bf16_autocast_on_cpu(data, tmp_path):
    assert _run(data, tmp_path / "bf16", "epochs=1", "amp=bf16", "model=dcvit_tiny") == 0
    res = _json(tmp_path / "bf16" / "eval.json")
    assert res["model"] == "dcvit_tiny" and res["num_samples"] == 53 and 0 <= res["top1"] <= 100


def test_counting_errors_reach_every_rank_as_data_error(tmp_path, monkeypatch):
    """Rank 0's unexpected error (here ImageFolder's FileNotFoundError for a directory without
    images) is broadcast as a DataError, so the other ranks raise instead of waiting."""
    from train_imagenet.config import load_config
    from train_imagenet.data import DataError
    (tmp_path / "train" / "class_a").mkdir(parents=True)           # a class folder, no images
    cfg = load_config(None, [f"data.train={tmp_path / 'train'}", f"data.val={tmp_path / 'train'}"])
    sent = []
    monkeypatch.setattr(entry_mod, "broadcast_object", lambda obj: sent.append(obj) or obj)
    with pytest.raises(DataError, match=r"data.train=.* cannot be read \(FileNotFoundError"):
        entry_mod._counts(cfg, "train", DistInfo(rank=0, world_size=2))
    assert isinstance(sent[0], DataError)
    monkeypatch.setattr(entry_mod, "broadcast_object", lambda obj: sent[0])   # what rank 1 receives
    with pytest.raises(DataError, match="FileNotFoundError"):
        entry_mod._counts(cfg, "train", DistInfo(rank=1, world_size=2))


def _tiny_cfg(root, model, **kwargs):
    from train_imagenet.config import load_config
    shape = {"img_size": 32, "patch_size": 8, "depth": 1, "embed_dim": 24, "num_heads": 2, **kwargs}
    return load_config(None, [f"data.train={root}", f"data.val={root}", f"model={model}",
                              f"model_kwargs={json.dumps(shape)}", "data.num_classes=10",
                              "data.img_size=32"])


def test_start_from_weights_files(data, tmp_path, capsys):
    """checkpoint=PATH that is no training checkpoint: a .safetensors of the same model loads
    exactly; a plain ViT .pth starts a DCViT (shared tensors copied, DCMHA ones keep their
    initialisation); weights of another size fail with a clear error, before training."""
    import dcvit
    torch.manual_seed(1)
    vit = entry_mod.build_model(_tiny_cfg(data.root, "vit_tiny_patch16_224"))
    st, pth = tmp_path / "vit.safetensors", tmp_path / "vit.pth"
    dcvit.save_weights(vit, st)
    torch.save(vit.state_dict(), pth)
    source = vit.state_dict()

    cfg = _tiny_cfg(data.root, "vit_tiny_patch16_224")
    model = entry_mod.build_model(cfg)
    assert load_start_weights(model, str(st), cfg) is None
    assert all(torch.equal(v, source[k]) for k, v in model.state_dict().items())

    cfg = _tiny_cfg(data.root, "dcvit_tiny")
    model = entry_mod.build_model(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    load_start_weights(model, str(pth), cfg)
    after = model.state_dict()
    dcmha = [k for k in after if k not in source]
    assert dcmha and all(torch.equal(after[k], before[k]) for k in dcmha)
    assert all(torch.equal(after[k], source[k]) for k in source)

    big = _tiny_cfg(data.root, "dcvit_tiny", embed_dim=48)
    with pytest.raises(entry_mod.CheckpointError, match="another size"):
        load_start_weights(entry_mod.build_model(big), str(st), big)

    out = tmp_path / "from_st"
    assert _run(data, out, "model=dcvit_tiny", f"checkpoint={st}", "epochs=1", "aug.mixup=0",
                "aug.cutmix=0") == 0
    assert load_checkpoint(list_checkpoints(str(out))[-1])["update"] == 12
    assert _run(data, tmp_path / "ev", "--eval-only", f"checkpoint={st}") == 0
    assert _json(tmp_path / "ev" / "eval.json")["checkpoint"] == str(st)


def test_the_model_does_not_write_into_the_config(data, tmp_path, monkeypatch):
    """data.mean/std unset: the run normalises with the model's pretrained values, and the
    config (in memory and in config.yaml) stays as given."""
    import yaml
    from train_imagenet.config import load_config
    import train_imagenet.__main__ as entry
    seen = []
    real_build = entry.build_data
    monkeypatch.setattr(entry, "build_data", lambda *a, **k: seen.append(a[-1]) or real_build(*a, **k))
    cfg = load_config(None, [f"data.train={data.root}", f"data.val={data.root}", f"output_dir={tmp_path / 'r'}",
                             *TINY, "epochs=1", "aug.mixup=0", "aug.cutmix=0"])
    assert entry.run(cfg) == 0
    assert cfg.data.mean is None and cfg.data.std is None
    import timm
    pretrained = timm.create_model("vit_tiny_patch16_224").pretrained_cfg
    assert seen == [(list(pretrained["mean"]), list(pretrained["std"]))] * 2
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert saved["data"]["mean"] is None and saved["data"]["std"] is None
