import pytest

from dcvit.cli import did_you_mean, parse_kwargs
from dcvit.report import ReportError, parse_model_kwargs


def test_values_are_typed():
    got = parse_kwargs(["class_token=false", "no_embed_class=True", "img_size=32", "drop_path_rate=0.1",
                        "lr=1e-3", "dcmha_layers=[0, 1]", "global_pool=avg", "mean=[0.5,0.5,0.5]",
                        "pre_norm=None", "act=", "name='7'"])
    assert got == {"class_token": False, "no_embed_class": True, "img_size": 32, "drop_path_rate": 0.1,
                   "lr": 0.001, "dcmha_layers": [0, 1], "global_pool": "avg", "mean": [0.5, 0.5, 0.5],
                   "pre_norm": None, "act": None, "name": "7"}
    assert type(got["class_token"]) is bool and type(got["img_size"]) is int
    assert parse_kwargs([]) == {}


@pytest.mark.parametrize("item", ["novalue", "=3", "2x=1", "a-b=1"])
def test_bad_item_is_named(item):
    with pytest.raises(ValueError, match=f"--model-kwargs entry '{item}' is not key=value"):
        parse_kwargs(["img_size=32", item])


def test_bad_yaml_is_named():
    with pytest.raises(ValueError, match=r"entry 'dcmha_layers=\[0,': .*YAML"):
        parse_kwargs(["dcmha_layers=[0,"])


def test_report_uses_the_same_parser():
    assert parse_model_kwargs(["class_token=false", "patch_size=4"]) == {"class_token": False, "patch_size": 4}
    with pytest.raises(ReportError, match="'novalue'"):
        parse_model_kwargs(["novalue"])


def test_did_you_mean_lists_the_closest_first():
    assert did_you_mean("rnak", ["rank", "query_wise"]) == "; did you mean 'rank'?"
    assert did_you_mean("lr_rat", ["lr_rate", "lr_ratio", "weight_decay"]) == \
        "; did you mean 'lr_rate' or 'lr_ratio'?"
    assert did_you_mean("optim", ["optimizer", "opt", "optim_x"]) == \
        "; did you mean 'optim_x', 'opt' or 'optimizer'?"          # ratios 0.83, 0.75, 0.71
    assert did_you_mean("lr_rat", ["lr_rate", "lr_ratio"], n=1) == "; did you mean 'lr_rate'?"
    assert did_you_mean("zzz", ["rank", "query_wise"]) == ""
    by_last = {"lr": "optim.lr", "momentum": "optim.momentum"}
    assert did_you_mean("lr", by_last, shown=by_last) == "; did you mean 'optim.lr'?"


def test_the_checks_share_the_hint():
    from train_imagenet.config import ConfigError, load_config
    from dcvit.report import check_model_name
    with pytest.raises(ConfigError, match=r"unknown config key 'momentun'; did you mean 'optim.momentum'\?$"):
        load_config(None, ["momentun=0.8"])
    with pytest.raises(ReportError, match=r"unknown model 'dcvit_tiny_patch16_22'; did you mean "
                                          r"'dcvit_tiny_patch16_224'"):
        check_model_name("dcvit_tiny_patch16_22")
