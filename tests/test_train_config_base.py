"""Configs compose: a file's `base:` is read first and the file's keys applied on top."""
import glob
import os

import pytest
import yaml

from train_imagenet.config import ConfigError, config_layers, config_to_dict, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_a_file_changes_only_what_it_names(tmp_path):
    write(tmp_path / "recipes" / "root.yaml",
          "epochs: 300\noptim: {lr: 1.0e-3, weight_decay: 0.05}\nmodel_kwargs: {img_size: 32, depth: 2}\n")
    write(tmp_path / "recipes" / "short.yaml", "base: root.yaml\nepochs: 90\n")      # a base with a base
    path = write(tmp_path / "run" / "model.yaml",
                 "base: ../recipes/short.yaml\nmodel: dcvit_tiny\noptim: {lr: 5.0e-4}\nmodel_kwargs: {depth: 4}\n")
    cfg = load_config(path, ["optim.weight_decay=0.1"])
    assert cfg.model == "dcvit_tiny" and cfg.epochs == 90
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (5e-4, 0.1)   # section: key by key
    assert cfg.model_kwargs == {"depth": 4}                           # a value: replaced whole
    files = [os.path.relpath(f, tmp_path) for f, _ in config_layers(path)]
    assert files == [os.path.join("recipes", "root.yaml"), os.path.join("recipes", "short.yaml"),
                     os.path.join("run", "model.yaml")]


@pytest.mark.parametrize("files, match", [
    ({"a.yaml": "base: a.yaml\n"}, r"base='a.yaml' makes a cycle .*a.yaml -> .*a.yaml"),
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: ./a.yaml\n"}, r"makes a cycle \(.*a.yaml -> .*b.yaml -> .*a.yaml\)"),
    ({"a.yaml": "base: missing.yaml\n"}, r"base='missing.yaml' in config file .*a.yaml.*missing.yaml' does not exist"),
    ({"a.yaml": "base: [b.yaml]\n"}, r"base=\['b.yaml'\] .* must be the path of another config file"),
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "optim: {lr_rate: 1}\n"},
     r"config file .*b.yaml.*unknown config key 'optim.lr_rate'; did you mean 'optim.lr'"),
    ({"a.yaml": "bsae: b.yaml\n"}, r"unknown config key 'bsae'; did you mean 'base'"),
])
def test_bad_bases_are_named(tmp_path, files, match):
    for name, text in files.items():
        write(tmp_path / name, text)
    with pytest.raises(ConfigError, match=match):
        load_config(str(tmp_path / "a.yaml"))


def test_base_is_a_file_key_only():
    with pytest.raises(ConfigError, match="base can only be set in a config file"):
        load_config(None, ["base=configs/recipes/paper.yaml"])


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_model_files_state_only_what_differs_from_their_recipe(path):
    layers = config_layers(path)
    own = layers[-1][1]
    if len(layers) == 1:
        return                                          # a file without a base (quickstart)
    base = config_to_dict(load_config(layers[-2][0]))
    set_by_bases = {k for _, keys in layers[:-1] for k in keys}
    same = [k for k, v in own.items() if k in set_by_bases and base.get(k) == v]
    assert not same, f"{path} repeats its base's {same}"
    assert set(own) <= {"model", "model_kwargs", "output_dir", "epochs", "eval_epochs"}, sorted(own)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "recipes", "*.yaml"))))
def test_recipes_load_and_say_what_builds_on_them(path):
    load_config(path)
    head = [line for line in open(path).read().splitlines()[:4] if line.startswith("#")]
    assert head and "base of" in " ".join(head), f"{path} must say which configs build on it"
    assert "model" not in (yaml.safe_load(open(path)) or {}), "a recipe names no model"
