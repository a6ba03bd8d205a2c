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


@pytest.mark.parametrize("workers, world", [(0, 1), (0, 2), (0, 3), (0, 5), (2, 1), (2, 2),
                                           *(pytest.param(2, w, marks=pytest.mark.slow) for w in (3, 5))])
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


def test_shards_are_counted_and_metadata_gives_the_class_count(tmp_path, caplog):
    x, y = digits(20)
    paths = write_shards(str(tmp_path), "val", x, y, 10)
    meta = {"num_samples": 20, "num_classes": 12, "shards": [os.path.basename(p) for p in paths]}
    (tmp_path / "val.json").write_text(json.dumps(meta))
    counts = count_samples(resolve_source(str(tmp_path), "data.val"))
    assert counts["lengths"] == [10, 10]                           # per shard, for the dealing
    assert {k: counts[k] for k in ("num_samples", "num_classes", "classes_exact")} == {
        "num_samples": 20, "num_classes": 12, "classes_exact": 1}
    meta["num_samples"] = 999
    (tmp_path / "val.json").write_text(json.dumps(meta))          # stale metadata: the shards win
    assert count_samples(resolve_source(str(tmp_path), "data.val"))["num_samples"] == 20
    assert "says num_samples=999 but the shards hold 20" in caplog.text
    meta["shards"] = ["other.tar"]
    (tmp_path / "val.json").write_text(json.dumps(meta))          # describes other shards
    counts = count_samples(resolve_source(str(tmp_path), "data.val"))
    assert {k: counts[k] for k in ("num_samples", "num_classes", "classes_exact")} == {
        "num_samples": 20, "num_classes": int(max(y)) + 1, "classes_exact": 0}


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


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 0), (2, 2)])
def test_corrupt_train_samples_are_replaced_and_counted(tmp_path, world, workers):
    """Every rank still yields exactly batches_per_epoch full batches (an odd number of corrupt
    samples, more than a batch of them in one shard), and the skips are reported."""
    x, y = digits(150)
    corrupt = {0, 1, 2, 3, 4, 5, 6, 7, 8, 40, 77}                  # 11: odd, > batch_size
    write_shards(str(tmp_path), "train", x, y, 30, corrupt=corrupt)
    cfg = _cfg(str(tmp_path), str(tmp_path), f"data.num_workers={workers}")
    good = collections.Counter(int(v) for i, v in enumerate(y) if i not in corrupt)
    total_skipped = 0
    for rank in range(world):
        pipe = build_data(cfg, "train", rank, world)
        assert pipe.batches_per_epoch == (150 // world) // 8
        sizes, labels, skipped = [], [], 0
        for xb, yb, s in pipe.loader(0):
            sizes.append(len(yb))
            labels += yb.tolist()
            skipped += int(s)
        assert sizes == [8] * pipe.batches_per_epoch, f"rank {rank}: batch sizes {sizes}"
        assert collections.Counter(labels) <= good + good        # at most two passes, no corrupt
        total_skipped += skipped
    assert total_skipped >= len(corrupt) // world                 # every pass meets some of them


def test_corrupt_train_images_in_folder_are_replaced(tmp_path):
    x, y = digits(80)
    for split, part in (("train", slice(0, 40)), ("val", slice(40, 80))):
        write_folder(str(tmp_path / split), x[part], y[part])
        bad = sorted(str(p) for p in (tmp_path / split).rglob("*.png"))[:3]
        for p in bad:
            with open(p, "wb") as f:
                f.write(b"not an image " + split.encode())
    cfg = _cfg(str(tmp_path / "train"), str(tmp_path / "val"))
    pipe = build_data(cfg, "train")
    sizes, skipped = [], 0
    for xb, yb, s in pipe.loader(0):
        sizes.append(len(yb))
        skipped += int(s)
    assert sizes == [8] * pipe.batches_per_epoch == [8] * 5
    assert skipped >= 1                       # 3 corrupt of 40, 40 drawn: at least one met
    labels, skipped = _labels(build_data(cfg, "val"))
    assert len(labels) == 37 and skipped == 3                      # evaluation drops them


def test_all_corrupt_train_shards_fail_instead_of_hanging(tmp_path):
    x, y = digits(20)
    write_shards(str(tmp_path), "train", x, y, 20, corrupt=set(range(20)))
    cfg = _cfg(str(tmp_path), str(tmp_path))
    with pytest.raises(DataError, match="no readable sample"):
        _labels(build_data(cfg, "train"))


def test_importing_data_leaves_timm_op_table_alone():
    """The posterize fix is local to the transforms build_transform makes."""
    import subprocess
    import sys
    code = ("from timm.data import auto_augment as aa; before = dict(aa.NAME_TO_OP); "
            "import train_imagenet.data; "
            "changed = [k for k, f in aa.NAME_TO_OP.items() if before[k] is not f]; "
            "assert not changed and aa.NAME_TO_OP.keys() == before.keys(), changed")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ,
                   "PYTHONPATH": os.pathsep.join(sys.path)})


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5-inc1", "rand-m10-n2", "augmix-m5-w2",
                                    "original"])
def test_augmentation_posterize_keeps_zero_bits_as_black(shards, policy):
    """Pillow >= 13 rejects ImageOps.posterize(img, 0); the posterize ops of the transform keep
    0 bits as a black image, and timm's table still holds timm's own function."""
    from PIL import Image
    from timm.data import auto_augment
    from train_imagenet.data import build_transform
    root, _, _ = shards
    cfg = _cfg(root, root, "aug.no_aug=false", f"aug.auto_augment={policy}")
    transform = build_transform(cfg, training=True)
    steps = transform.transforms
    ops = [op for s in steps for op in list(getattr(s, "ops", []))
           + [o for sub in getattr(s, "policy", []) for o in sub] if "Posterize" in op.name]
    assert ops, f"{policy}: no posterize op found in {steps}"
    img = Image.new("RGB", (4, 4), (200, 100, 50))
    for op in ops:
        out = op.aug_fn(img, 0)
        assert out.size == img.size and out.getextrema() == ((0, 0),) * 3
        assert op.aug_fn(img, 8) is img                               # timm's behaviour otherwise
    assert auto_augment.NAME_TO_OP["Posterize"] is auto_augment.posterize


def _indexed_shards(root, sizes):
    """Shards of the given sizes whose images say their global index (red = 4 x (i % 64),
    green = 64 x (i // 64)); the label is i % 10."""
    import webdataset as wds
    from PIL import Image
    import io
    os.makedirs(root, exist_ok=True)
    i = 0
    for s, size in enumerate(sizes):
        with wds.TarWriter(os.path.join(root, f"train-{s:06d}.tar")) as sink:
            for _ in range(size):
                buf = io.BytesIO()
                Image.new("RGB", (8, 8), (4 * (i % 64), 64 * (i // 64), 0)).save(buf, format="PNG")
                sink.write({"__key__": f"{i:08d}", "png": buf.getvalue(), "cls": str(i % 10).encode()})
                i += 1
    return i


def _indices(x):
    means = x.mean(dim=(2, 3)) * 255
    return [int(round(float(r) / 4)) + 64 * int(round(float(g) / 64)) for r, g in means[:, :2]]


@pytest.mark.parametrize("sizes, world, workers", [([40, 40, 40], 2, 0), ([100, 20], 2, 0),
                                                   ([30, 30, 30, 30, 8], 2, 2)])
def test_uneven_shards_every_sample_once_per_epoch(tmp_path, sizes, world, workers):
    """Issue 31.2: shards of uneven sizes per (rank, worker) slot; each epoch visits every
    sample at most once and all but at most one batch per rank, with equal batches per rank
    and the same order when rebuilt (what exact resume replays)."""
    total = _indexed_shards(str(tmp_path), sizes)
    cfg = _cfg(str(tmp_path), str(tmp_path), f"data.num_workers={workers}", "data.mean=[0,0,0]",
               "data.std=[1,1,1]", "data.crop_pct=1.0", "data.num_classes=10")
    for epoch in (0, 1):
        visits, batches = collections.Counter(), []
        for rank in range(world):
            pipe = build_data(cfg, "train", rank, world)
            order = [i for x, y, _ in pipe.loader(epoch) for i in _indices(x)]
            again = [i for x, y, _ in build_data(cfg, "train", rank, world).loader(epoch)
                     for i in _indices(x)]
            assert order == again                                   # replayable: exact resume
            batches.append(len(order) // 8)
            visits.update(order)
        assert len(set(batches)) == 1 and batches[0] == (total // world) // 8
        assert max(visits.values()) == 1, "a sample was seen twice in one epoch"
        assert total - len(visits) <= world * 8                     # at most a batch per rank


def test_a_shard_truncated_mid_run_is_one_line_naming_it(tmp_path):
    """Issue 31.6: a shard cut after the start-up check fails the epoch with one line naming
    the shard, not the DataLoader worker's traceback."""
    x, y = digits(60)
    paths = write_shards(str(tmp_path), "train", x, y, 20)
    cfg = _cfg(str(tmp_path), str(tmp_path), "data.num_workers=1", "data.on_corrupt=fail")
    pipe = build_data(cfg, "train")
    size = os.path.getsize(paths[1])
    with open(paths[1], "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(DataError) as err:
        for _ in pipe.loader(0):
            pass
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text and "DataLoader worker" not in text
    assert text.startswith(f"shard {paths[1]!r} cannot be read") and err.value.__cause__ is None


@pytest.mark.parametrize("label", [b"0_3", b"+3", "\u0663".encode(), b"3.0"])
def test_a_label_of_anything_but_digits_is_refused(tmp_path, label):
    """Issue 31.7: int() takes '0_3' as 3; the verifier and the loader take digits only."""
    import webdataset as wds
    from train_helpers import png_bytes
    from train_imagenet.data import verify
    from train_imagenet.data.stream import parse_cls
    x, y = digits(4)
    path = str(tmp_path / "val-000000.tar")
    with wds.TarWriter(path) as sink:
        for i in range(4):
            sink.write({"__key__": f"{i:08d}", "png": png_bytes(x[i]),
                        "cls": label if i == 2 else str(int(y[i])).encode()})
    check = verify.check_shards([path], "data.val", 10)
    assert check.problem and f"has the label {label!r}, not an integer (ASCII digits only)" in check.problem
    with pytest.raises(ValueError, match="not an integer"):
        parse_cls(label)
    assert parse_cls(b"3\n") == 3 and parse_cls(b" 12 ") == 12


@pytest.mark.parametrize("sizes", [[36, 36, 36, 12], [120]])
def test_the_dropped_tail_moves_from_epoch_to_epoch(tmp_path, sizes):
    """Issue 44.3: the samples past each rank's last whole batch (8 of 120 over 2 ranks x 2
    workers, batch 8) are others every epoch, as a DistributedSampler's are: they are not
    the end of a shard every epoch, nor the same samples; the order stays replayable."""
    total = _indexed_shards(str(tmp_path), sizes)
    cfg = _cfg(str(tmp_path), str(tmp_path), "data.num_workers=2", "data.mean=[0,0,0]",
               "data.std=[1,1,1]", "data.crop_pct=1.0")
    ends = {sum(sizes[:s + 1]) for s in range(len(sizes))}
    dropped = []
    for epoch in range(4):
        seen = collections.Counter()
        for rank in range(2):
            seen.update(i for x, _, _ in build_data(cfg, "train", rank, 2).loader(epoch)
                        for i in _indices(x))
        assert max(seen.values()) == 1 and len(seen) == 2 * ((total // 2) // 8) * 8
        dropped.append(frozenset(range(total)) - frozenset(seen))
    assert len(set(dropped)) == len(dropped), "the same samples were dropped in two epochs"
    assert not all(max(d) + 1 in ends and len(d) == max(d) - min(d) + 1 for d in dropped), \
        "every epoch dropped the end of a shard"
    again = [i for x, _, _ in build_data(cfg, "train", 1, 2).loader(3) for i in _indices(x)]
    assert again == [i for x, _, _ in build_data(cfg, "train", 1, 2).loader(3) for i in _indices(x)]
