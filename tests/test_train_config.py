"""train_imagenet.config: YAML + dotted overrides, typed, unknown keys rejected with hints."""
import glob
import os

import pytest
import yaml

from train_imagenet.config import Config, ConfigError, all_keys, config_to_dict, load_config, save_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_overrides_are_typed_and_nested(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: dcvit_tiny\noptim:\n  lr: 1.0e-3\ndata: {num_classes: 10}\n")
    cfg = load_config(str(path), ["optim.lr=3e-4", "epochs=7", "model_kwargs={img_size: 32, patch_size: 4}",
                                  "aug.scale=[0.5, 1]", "ema={enabled: true, decay: 0.9}", "resume="])
    assert cfg.model == "dcvit_tiny" and cfg.data.num_classes == 10
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.epochs == 7 and cfg.model_kwargs == {"img_size": 32, "patch_size": 4}
    assert cfg.aug.scale == [0.5, 1.0] and cfg.ema.enabled and cfg.ema.decay == 0.9
    assert cfg.resume == ""


@pytest.mark.parametrize("override, suggestion", [
    ("optim.lr_rate=1", "optim.lr"), ("lr=1", "optim.lr"), ("data.trian=x", "data.train"),
    ("batchsize=4", "batch_size"),
])
def test_unknown_key_suggests(override, suggestion):
    with pytest.raises(ConfigError, match=f"unknown config key.*did you mean '{suggestion}'"):
        load_config(None, [override])


def test_unknown_key_in_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  weight_decy: 0.1\n")
    with pytest.raises(ConfigError, match="'optim.weight_decy'.*'optim.weight_decay'"):
        load_config(str(path))


def test_duplicate_yaml_keys_are_refused_naming_key_and_lines(tmp_path, capsys):
    """A second ``optim:`` block would silently replace the first (weight_decay 0.0 -> 0.05)."""
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 3\noptim:\n  weight_decay: 0.0\nbatch_size: 8\noptim:\n  lr: 1.0e-3\n")
    with pytest.raises(ConfigError, match=r"c\.yaml.*key 'optim' is given twice in one mapping "
                                          r"\(line 2 and line 5\).*keep one"):
        load_config(str(path))
    path.write_text("optim:\n  lr: 1.0e-3\n  weight_decay: 0.0\n  lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match=r"key 'lr' is given twice in one mapping \(line 2 and line 4\)"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"override 'optim=\{lr: 1, lr: 2\}': key 'lr' is given twice "
                                          r"in one mapping \(line 1, columns 2 and 9\)"):
        load_config(None, ["optim={lr: 1, lr: 2}"])
    from train_imagenet.__main__ import main
    path.write_text("epochs: 3\nepochs: 4\n")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "key 'epochs' is given twice" in err and "line 1 and line 2" in err


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim: &o {lr: 1.0e-3, weight_decay: 0.0}\nsched:\n  warmup_epochs: 2\n"
                    "model_kwargs:\n  <<: {depth: 2, embed_dim: 24}\n  depth: 3\n")
    cfg = load_config(str(path))
    assert cfg.model_kwargs == {"depth": 3, "embed_dim": 24} and cfg.optim.weight_decay == 0.0


@pytest.mark.parametrize("override, match", [
    ("epochs=abc", "epochs='abc' must be of type int"), ("amp=fp8", "amp='fp8' is not one of"),
    ("batch_size=0", "batch_size=0 must be >= 1"), ("batch_size=3", "must be even for mixup"),
    ("aug.scale=0.5", "must be a list"), ("epochs", "not of the form key=value"),
])
def test_bad_values(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["model=dcvit_small", "optim.lr=1e-3", "model_kwargs={rank: 1}"])
    save_config(cfg, str(tmp_path / "config.yaml"))
    again = load_config(str(tmp_path / "config.yaml"))
    assert config_to_dict(again) == config_to_dict(cfg)
    assert set(all_keys()) >= {"model", "model_kwargs", "data.train", "data.val", "data.num_classes",
                               "data.img_size", "epochs", "batch_size", "output_dir", "seed", "resume"}


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_recipes_load_and_state_command_cost_result(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    head = open(path).read().split("\n")[:12]
    text = "\n".join(line for line in head if line.startswith("#")).lower()
    for word in ("command", "cost", "expect"):
        assert word in text, f"{path} must begin with comments giving its {word}"
    yaml.safe_load(open(path))
