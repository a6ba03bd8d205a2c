"""dcvit.schema: eval.json and shard metadata as the writers write them and the readers read them."""
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS

from dcvit.report import read_results
from dcvit.report.model_spec import ReportError
from dcvit.schema import (EvalResult, SchemaError, ShardMeta, check_split, metadata_path, shard_name,
                          split_of, IMAGE_EXTENSIONS)
from train_imagenet.results import eval_result as _result
from train_imagenet.config import load_config
from train_imagenet.data import count_samples, resolve_source
from train_imagenet.shards import cli, folders

ROOT = Path(__file__).resolve().parents[1]


def test_image_extensions_are_torchvisions():
    assert tuple("." + e for e in IMAGE_EXTENSIONS) == IMG_EXTENSIONS
    assert folders.IMG_EXTENSIONS == IMG_EXTENSIONS


def test_trainer_eval_json_reads_back_in_the_report(tmp_path):
    cfg = load_config(str(ROOT / "configs" / "quickstart.yaml"))
    metrics = {"top1": 91.25, "top5": 99.5, "num_samples": 360, "loss": 0.31}
    written = _result(cfg, metrics, "runs/x/last.pt", False)
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(written))
    result = read_results(str(path))
    assert (result.model, result.top1, result.top5, result.num_samples) == (cfg.model, 91.25, 99.5, 360)
    assert result.model_kwargs == dict(cfg.model_kwargs) and result.img_size == cfg.data.img_size
    assert result.num_classes == cfg.data.num_classes and result.ema is False and result.extra == {}
    assert result.to_dict() == written


def test_eval_result_keeps_unknown_keys_and_names_bad_values():
    data = {"model": "vit_tiny_patch16_224", "top1": 50, "seed": 3}
    result = EvalResult.from_dict(data)
    assert result.extra == {"seed": 3} and result.to_dict()["seed"] == 3 and result.model_kwargs == {}
    for bad, message in [({"top1": 50.0}, "lacks \\['model'\\]"),
                         ({"model": "m", "top1": 150}, "top1=150 is not a percentage"),
                         ({"model": "m", "top1": True}, "top1=True is not a percentage"),
                         ({"model": "m", "top1": 1, "model_kwargs": [1]}, "model_kwargs must be an object"),
                         ({"model": "m", "top1": 1, "num_samples": "9"}, "num_samples='9' is not an integer"),
                         ([1, 2], "holds a list")]:
        with pytest.raises(SchemaError, match=message):
            EvalResult.from_dict(bad, "runs/eval.json")


def test_report_names_the_file_of_a_bad_eval_json(tmp_path):
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"model": "vit_tiny_patch16_224", "top1": 150}))
    with pytest.raises(ReportError, match=f"results file {path}: top1=150"):
        read_results(str(path))


def test_shard_names_and_metadata_location():
    assert shard_name("train", 3) == "train-000003.tar"
    assert split_of("/data/in1k/train-000003.tar") == "train"
    assert metadata_path("/data/in1k/val_v2-000000.tar") == "/data/in1k/val_v2.json"
    assert check_split("val_v2") is None
    assert "letters, digits" in check_split("val-2") and "classes" in check_split("classes")


def test_writer_metadata_is_what_the_reader_reads(tmp_path):
    src, out = tmp_path / "src", tmp_path / "shards"
    rng = np.random.default_rng(0)
    for c in range(3):
        (src / f"c{c}").mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(src / f"c{c}" / f"{i}.png")
    assert cli.main(["--src", str(src), "--out", str(out), "--shard-size", "5", "--no-progress"]) == 0
    raw = json.loads((out / "train.json").read_text())
    meta = ShardMeta.from_dict(raw)
    assert meta.to_dict() == raw and meta.extra == {}
    assert (meta.num_samples, meta.num_classes, meta.shards) == (12, 3, [shard_name("train", i) for i in range(3)])
    assert meta.samples_per_shard == [5, 5, 2] and metadata_path(str(out / meta.shards[0])) == str(out / "train.json")
    counted = count_samples(resolve_source(str(out / meta.pattern), "data.train"))
    assert (counted["num_samples"], counted["num_classes"], counted["classes_exact"]) == (12, 3, 1)


def test_shard_meta_rejects_bad_types():
    assert ShardMeta.from_dict({"num_samples": 4}).num_classes is None
    with pytest.raises(SchemaError, match="lacks 'num_samples'"):
        ShardMeta.from_dict({"shards": []})
    with pytest.raises(SchemaError, match="samples_per_shard must be a list of int"):
        ShardMeta.from_dict({"num_samples": 4, "samples_per_shard": ["4"]})
