"""train_imagenet.data: shard discovery, exact evaluation splits, fixed per-rank training
quotas, determinism, corrupt samples, ImageFolder fallback and the errors for bad data."""
import collections
import json
import os
import tarfile

import pytest

from train_imagenet.config import load_config
from train_imagenet.data import DataError, build_data, count_samples, resolve_source

from train_helpers import digits, write_folder, write_shards


def _cfg(train, val, *extra):
    return load_config(None, [f"data.train={train}", f"data.val={val}", "data.num_classes=10",
                              "data.img_size=32", "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]",
                              "batch_size=8", "data.num_workers=0", "data.shuffle_buffer=20",
                              "aug.no_aug=true", "aug.mixup=0", "aug.cutmix=0", *extra])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("shards"))
    x, y = digits(200)
    write_shards(root, "train", x[:150], y[:150], 30)            # 5 shards of 30
    write_shards(root, "val", x[150:], y[150:], 16)              # 4 shards: 16, 16, 16, 2
    return root, list(y[:150]), list(y[150:])


def _labels(pipe, epoch=0):
    out, skipped = [], 0
    for x, y, s in pipe.loader(epoch):
        assert x.shape[1:] == (3, 32, 32)
        out += y.tolist()
        skipped += int(s)
    return out, skipped


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("workers", [0, 2])
def test_eval_split_visits_every_sample_once(shards, world, workers):
    root, _, val_y = shards
    cfg = _cfg(f"{root}/train-{{000000..000004}}.tar", root, f"data.num_workers={workers}")
    seen = []
    for rank in range(world):
        seen += _labels(build_data(cfg, "val", rank, world))[0]
    assert collections.Counter(seen) == collections.Counter(val_y)   # no sample lost or doubled


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 0), (3, 2)])
def test_train_quota_is_fixed_per_rank(shards, world, workers):
    root, train_y, _ = shards
    cfg = _cfg(f"{root}/train-{{000000..000004}}.tar", root, f"data.num_workers={workers}")
    batches = (150 // world) // 8
    for rank in range(world):
        pipe = build_data(cfg, "train", rank, world)
        assert pipe.batches_per_epoch == batches
        got = sum(1 for _ in pipe.loader(0))
        assert got == batches, f"rank {rank} gave {got} batches, expected {batches}"


def test_train_order_depends_on_seed_and_epoch_only(shards):
    root, train_y, _ = shards
    cfg = _cfg(root + "/train-{000000..000004}.tar", root)
    pipe = build_data(cfg, "train")
    e0, e0_again, e1 = _labels(pipe, 0)[0], _labels(build_data(cfg, "train"), 0)[0], _labels(pipe, 1)[0]
    assert e0 == e0_again and e0 != e1
    assert collections.Counter(e0) <= collections.Counter(train_y)   # one pass: no repeats


def test_missing_shards_named(shards):
    root, _, _ = shards
    with pytest.raises(DataError, match=r"2 of 7 shards are missing .*train-000005.tar"):
        resolve_source(root + "/train-{000000..000006}.tar", "data.train")


def test_empty_dataset(tmp_path, shards):
    root, _, _ = shards
    with tarfile.open(tmp_path / "train-000000.tar", "w"):
        pass
    cfg = _cfg(str(tmp_path / "train-000000.tar"), root)
    with pytest.raises(DataError, match="holds no samples"):
        build_data(cfg, "train")


def test_too_few_samples_for_a_batch(shards):
    root, _, _ = shards
    cfg = _cfg(root + "/train-000000.tar", root, "batch_size=32")
    with pytest.raises(DataError, match="fewer than one update needs"):
        build_data(cfg, "train")


def test_num_classes_mismatch(shards):
    root, _, _ = shards
    cfg = _cfg(root + "/train-{000000..000004}.tar", root, "data.num_classes=5")
    with pytest.raises(DataError, match=r"has 10 classes .* data.num_classes=5; set data.num_classes=10"):
        build_data(cfg, "train")


def test_metadata_file_is_used_when_it_matches(tmp_path):
    x, y = digits(20)
    paths = write_shards(str(tmp_path), "val", x, y, 10)
    meta = {"num_samples": 20, "num_classes": 10, "shards": [os.path.basename(p) for p in paths]}
    (tmp_path / "val.json").write_text(json.dumps(meta))
    assert count_samples(resolve_source(str(tmp_path), "data.val"))["num_samples"] == 20
    meta["num_samples"] = 999
    (tmp_path / "val.json").write_text(json.dumps(meta))          # trusted, not re-counted
    assert count_samples(resolve_source(str(tmp_path), "data.val"))["num_samples"] == 999
    meta["shards"] = ["other.tar"]
    (tmp_path / "val.json").write_text(json.dumps(meta))          # describes other shards: count
    assert count_samples(resolve_source(str(tmp_path), "data.val"))["num_samples"] == 20


def test_corrupt_samples_skipped_and_counted_or_fatal(tmp_path):
    x, y = digits(40)
    write_shards(str(tmp_path), "val", x, y, 20, corrupt={3, 25, 26})
    cfg = _cfg(str(tmp_path), str(tmp_path))
    labels, skipped = _labels(build_data(cfg, "val"))
    assert skipped == 3 and len(labels) == 37
    assert labels == [int(v) for i, v in enumerate(y) if i not in {3, 25, 26}]
    cfg.data.on_corrupt = "fail"
    with pytest.raises(DataError, match="corrupt sample '.*00000003'"):
        _labels(build_data(cfg, "val"))


def test_imagefolder_fallback(tmp_path):
    x, y = digits(80)
    write_folder(str(tmp_path / "train"), x[:40], y[:40])
    write_folder(str(tmp_path / "val"), x[40:], y[40:])
    assert set(y[:40]) == set(y[40:]) == set(range(10))
    cfg = _cfg(str(tmp_path / "train"), str(tmp_path / "val"))
    assert resolve_source(cfg.data.train, "data.train").kind == "folder"
    seen = []
    for rank in range(3):
        seen += _labels(build_data(cfg, "val", rank, 3))[0]
    assert sorted(seen) == sorted(int(v) for v in y[40:])
    pipe = build_data(cfg, "train", 1, 2)
    assert sum(1 for _ in pipe.loader(0)) == pipe.batches_per_epoch == 20 // 8
