"""The training features of the paper's recipe (configs/paper_*.yaml): big_vision's mixup,
step-based warm-up, decoupled weight decay, evaluations at chosen epochs."""
import json

import pytest
import torch

from train_imagenet.__main__ import main
from train_imagenet.checkpoint import list_checkpoints, load_checkpoint
from train_imagenet.config import ConfigError, load_config
from train_imagenet.mixup import RollMixup

TINY_BV = ["model=dcvit_tiny_patch16_bv_224",
           "model_kwargs={img_size: 32, patch_size: 8, depth: 1, embed_dim: 24, num_heads: 2}",
           "data.num_classes=10", "data.img_size=32", "data.num_workers=0", "data.shuffle_buffer=16",
           "data.crop_pct=1.0", "data.interpolation=bilinear", "data.mean=[0.5,0.5,0.5]",
           "data.std=[0.5,0.5,0.5]", "batch_size=8", "optim.lr=2e-3", "optim.lr_batch_size=null",
           "optim.weight_decay=0", "optim.decoupled_weight_decay=1e-4", "sched.warmup_epochs=0",
           "sched.warmup_steps=3", "sched.warmup_prefix=true", "sched.min_lr=0", "sched.warmup_lr=0",
           "aug.mixup=0", "aug.cutmix=0", "aug.bv_mixup=0.2", "aug.smoothing=0", "aug.reprob=0",
           "epochs=2", "eval_epochs=[1,2]", "threads=1", "drop_path=0"]


def test_roll_mixup_is_big_visions_formula():
    mix = RollMixup(0.2, num_classes=4, label_smoothing=0.1)
    x = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    y = torch.tensor([0, 3, 1])
    torch.manual_seed(7)
    b = float(torch.distributions.Beta(torch.tensor(0.2, dtype=torch.float64),
                                       torch.tensor(0.2, dtype=torch.float64)).sample())
    a = max(b, 1 - b)
    torch.manual_seed(7)
    xm, t = mix(x, y)
    torch.testing.assert_close(xm, a * x + (1 - a) * x[[2, 0, 1]])
    soft = torch.full((3, 4), 0.025, dtype=torch.float64)
    soft[torch.arange(3), y] = 0.925
    torch.testing.assert_close(t.double(), a * soft + (1 - a) * soft[[2, 0, 1]], atol=1e-6, rtol=0)
    ratios = [mix.ratio() for _ in range(200)]
    assert min(ratios) >= 0.5 and max(ratios) <= 1.0 and len(set(ratios)) > 100
    with pytest.raises(ValueError, match="Beta parameter p must be > 0"):
        RollMixup(0.0, 4)


@pytest.mark.parametrize("overrides,match", [
    (["aug.bv_mixup=0.2"], "set aug.mixup=0 aug.cutmix=0 or aug.bv_mixup=0"),
    (["optim.decoupled_weight_decay=1e-4"], "set optim.weight_decay=0"),
    (["sched.warmup_steps=100"], "set sched.warmup_epochs=0"),
    (["epochs=10", "eval_epochs=[90]"], r"\[90\] not in \[1, epochs=10\]"),
])
def test_paper_options_that_conflict_are_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_paper_configs_load_and_say_300_epochs():
    for name in ("vit_small", "vit_medium", "dcvit_small", "dcvit_medium"):
        cfg = load_config(f"configs/paper_{name}.yaml", [])
        assert cfg.epochs == 300 and cfg.eval_epochs == [90, 300]
        assert cfg.model.endswith("_patch16_bv_224") and cfg.aug.bv_mixup == 0.2
        assert cfg.sched.warmup_steps == 10_000 and cfg.optim.decoupled_weight_decay == 1e-4
        assert cfg.data.mean == [0.5, 0.5, 0.5] and cfg.data.std == [0.5, 0.5, 0.5]


def test_a_paper_recipe_run_writes_the_epoch_evaluations(tmp_path, digits_shards):
    root = digits_shards().root                             # 96 train, 53 val samples
    out = tmp_path / "run"
    assert main([f"data.train={root}", f"data.val={root}", f"output_dir={out}", *TINY_BV]) == 0
    e1 = json.loads((out / "eval-e0001.json").read_text())
    e2 = json.loads((out / "eval-e0002.json").read_text())
    final = json.loads((out / "eval.json").read_text())
    assert e1["epoch"] == 1 and e2["epoch"] == 2 and e2["top1"] == final["top1"]
    assert e1["num_samples"] == 53 and e1["model"] == "dcvit_tiny_patch16_bv_224"
    state = load_checkpoint(list_checkpoints(str(out))[-1])
    # 12 updates per epoch, warm-up of 3 updates, decay from its end
    assert state["scheduler"]["warmup_t"] == pytest.approx(3) and state["scheduler"]["warmup_prefix"]
    groups = state["optimizer"]["param_groups"]
    decayed = [g for g in groups if g["weight_decay"] > 0]
    assert [g["weight_decay"] for g in decayed] == [pytest.approx(1e-4 / 2e-3)]
    import timm
    import dcvit  # noqa: F401
    model = timm.create_model("dcvit_tiny_patch16_bv_224", num_classes=10, img_size=32, patch_size=8,
                              depth=1, embed_dim=24, num_heads=2)
    kernels = [n for n, p in model.named_parameters() if p.ndim > 1 and not n.endswith((".qkw", ".static"))]
    assert len(decayed[0]["params"]) == len(kernels)


def test_bv90_configs_are_big_visions_90_epoch_schedule_not_the_papers():
    for name in ("vit_small", "vit_medium", "dcvit_small", "dcvit_medium"):
        cfg = load_config(f"configs/bv90_{name}.yaml", [])
        paper = load_config(f"configs/paper_{name}.yaml", [])
        assert cfg.epochs == 90 and cfg.model == paper.model and cfg.aug == paper.aug
        text = open(f"configs/bv90_{name}.yaml").read()
        assert "NOT the\n# paper's protocol" in text and f"configs/paper_{name}.yaml" in text
