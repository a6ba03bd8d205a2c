"""The ImageNet copies people have, as `data.train`/`data.val` (tests/data_layouts.py builds
tiny exact copies): each resolves to the right split, every sample arrives with the label
the source holds, an epoch of training runs on it, and train/val mixes are refused."""
import collections
import os

import pytest

from train_imagenet.config import load_config
from train_imagenet.data import DataError, build_data, source_of

import data_layouts as L
from train_helpers import TINY_RUN

COMMON = ["data.num_classes=4", "data.img_size=32", "data.mean=[0,0,0]", "data.std=[1,1,1]",
          "data.crop_pct=1.0", "batch_size=4", "data.num_workers=0", "data.shuffle_buffer=8",
          "aug.no_aug=true", "aug.mixup=0", "aug.cutmix=0"]


def _cfg(layout, *extra):
    return load_config(None, [f"data.train={layout.train or layout.root}",
                              f"data.val={layout.val or layout.root}", *layout.args, *COMMON, *extra])


@pytest.fixture(scope="module", params=sorted(L.LAYOUTS))
def layout(request, tmp_path_factory):
    return L.LAYOUTS[request.param](str(tmp_path_factory.mktemp(request.param)))


def _visits(pipe, truth, epoch=0):
    """{sample index: times seen}, checking each sample's label against `truth`."""
    seen = collections.Counter()
    for x, y, _ in pipe.loader(epoch):
        index, label_in_pixels = L.identify(x)
        for i, g, got in zip(index, label_in_pixels, y.tolist()):
            assert got == truth[i] == g, f"sample {i}: label {got}, truth {truth[i]}"
            seen[i] += 1
    return seen


@pytest.mark.parametrize("world", [1, 2])
def test_every_val_sample_once_with_its_label(layout, world):
    cfg = _cfg(layout)
    seen = collections.Counter()
    for rank in range(world):
        seen += _visits(build_data(cfg, "val", rank, world), layout.val_labels)
    assert seen == collections.Counter(range(L.N_VAL))


def test_train_split_reads_its_own_samples_with_their_labels(layout):
    cfg = _cfg(layout)
    pipe = build_data(cfg, "train")
    assert pipe.num_samples == L.N_TRAIN and pipe.batches_per_epoch == L.N_TRAIN // 4
    assert _visits(pipe, layout.train_labels) == collections.Counter(range(L.N_TRAIN))
    assert _visits(pipe, layout.train_labels, epoch=1) == collections.Counter(range(L.N_TRAIN))


def test_what_each_key_resolved_to_is_said(layout, capsys):
    cfg = _cfg(layout)
    train, val = source_of(cfg, "train"), source_of(cfg, "val")
    assert train.split == "train" and val.split in ("val", "validation")
    build_data(cfg, "val")
    err = capsys.readouterr().err
    assert f"data.val: {val.layout}, split {val.split}" in err and f"{L.N_VAL} samples, " in err
    if val.layout != "timm-wds":            # timm's _info names no classes
        assert f"{L.N_VAL} samples, 4 classes" in err


def test_one_epoch_of_training(layout, tmp_path):
    from train_imagenet.__main__ import main
    args = [f"data.train={layout.train or layout.root}", f"data.val={layout.val or layout.root}",
            *layout.args, f"output_dir={tmp_path}", *TINY_RUN, "data.num_classes=4", "epochs=1",
            "aug.no_aug=true", "aug.mixup=0", "aug.cutmix=0"]
    assert main(args) == 0
    assert (tmp_path / "eval.json").exists()


def test_the_order_is_fixed_and_reshuffled_per_epoch(layout):
    cfg = _cfg(layout)

    def order(epoch):
        return [i for x, _, _ in build_data(cfg, "train").loader(epoch) for i in L.identify(x)[0]]
    assert order(0) == order(0) and order(0) != order(1)


# ------------------------------------------------------------------ timm's layout
def test_timm_info_gives_splits_and_counts_without_a_scan(tmp_path, monkeypatch, caplog):
    """The split's files and lengths come from _info without reading a tar; the start-up
    count (issue 44.2) agrees with them, so nothing is said."""
    layout = L.timm_wds(str(tmp_path / "wds"), info="yaml")
    from train_imagenet.data import verify
    with monkeypatch.context() as m:
        m.setattr(verify, "scan_shard", lambda *a, **k: pytest.fail("a tar was scanned"))
        source = source_of(_cfg(layout), "train")
    assert [os.path.basename(s) for s in source.shards] == ["imagenet1k-train-0000.tar",
                                                            "imagenet1k-train-0001.tar"]
    assert source.shard_lengths == [16, 16] and source.num_samples == 32
    assert build_data(_cfg(layout), "train").num_samples == 32
    assert "shard_lengths" not in caplog.text


@pytest.mark.parametrize("train_lengths, val_lengths", [([16, 10], [8]), ([16, 20], [15])])
def test_timm_info_shard_lengths_are_checked_against_the_shards(tmp_path, caplog,
                                                                train_lengths, val_lengths):
    """Issue 44.2: _info.json's shard lengths too small (data never read) or too large
    (samples read twice) are corrected by the start-up count with a warning naming the
    shard; every sample is read once an epoch and eval.json counts every val sample."""
    import json
    from train_imagenet.__main__ import main
    layout = L.timm_wds(str(tmp_path / "wds"), info="json")
    info_path = os.path.join(layout.root, "_info.json")
    with open(info_path) as f:
        info = json.load(f)
    for split, lengths in (("train", train_lengths), ("validation", val_lengths)):
        info["splits"][split]["shard_lengths"] = lengths
        info["splits"][split]["num_samples"] = sum(lengths)
    with open(info_path, "w") as f:
        json.dump(info, f)
    cfg = _cfg(layout)
    pipe = build_data(cfg, "train")
    assert pipe.num_samples == L.N_TRAIN
    assert f"_info.json gives {layout.root}/imagenet1k-train-0001.tar {train_lengths[1]} " \
        f"samples but it holds 16: split train holds 32 samples, not {sum(train_lengths)}" \
        in caplog.text
    for epoch in (0, 1):
        assert _visits(pipe, layout.train_labels, epoch) == collections.Counter(range(L.N_TRAIN))
    assert _visits(build_data(cfg, "val"), layout.val_labels) == collections.Counter(range(L.N_VAL))
    out = tmp_path / "run"
    assert main([f"data.train={layout.root}", f"data.val={layout.root}", f"output_dir={out}",
                 *TINY_RUN, "data.num_classes=4", "epochs=1", "batch_size=4", "aug.no_aug=true",
                 "aug.mixup=0", "aug.cutmix=0"]) == 0
    with open(out / "eval.json") as f:
        assert json.load(f)["num_samples"] == L.N_VAL


def test_timm_names_decide_without_info(tmp_path):
    layout = L.timm_wds(str(tmp_path / "wds"), info="none")
    cfg = _cfg(layout)
    assert source_of(cfg, "val").split == "validation"
    assert [os.path.basename(s) for s in source_of(cfg, "val").shards] == ["imagenet1k-validation-00.tar"]
    assert _visits(build_data(cfg, "val"), L.VAL_LABELS) == collections.Counter(range(L.N_VAL))


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("extra, message", [
    (["data.train_split=validation", "data.val_split=train"], "names the (validation|train) split, which is data.(val|train)'s"),
    (["data.val_split=train"], "names the train split, which is data.train's"),
    (["data.val_split=nope"], "not 'nope'"),
])
def test_swapped_or_unknown_splits_are_refused(layout, extra, message):
    with pytest.raises(DataError, match=message):
        build_data(_cfg(layout, *extra), "val")
        build_data(_cfg(layout, *extra), "train")


def test_timm_brace_patterns_swapped_are_refused(tmp_path):
    root = L.timm_wds(str(tmp_path / "wds")).root
    cfg = load_config(None, [f"data.train={root}/imagenet1k-validation-{{00..00}}.tar",
                             f"data.val={root}", *COMMON])
    with pytest.raises(DataError, match="gives validation shards"):
        build_data(cfg, "train")


def test_the_same_folder_of_one_split_for_both_keys_is_refused(tmp_path):
    layout = L.torchvision_root(str(tmp_path / "tv"))
    train = os.path.join(layout.root, "train")
    cfg = load_config(None, [f"data.train={train}", f"data.val={train}", *COMMON])
    with pytest.raises(DataError, match=r"share 32 files .* validation metric would be measured on training data"):
        build_data(cfg, "val")


def test_copies_of_training_samples_in_validation_are_refused(tmp_path):
    """Two folders, other files, but the same images under the same names."""
    import shutil
    layout = L.torchvision_root(str(tmp_path / "tv"))
    shutil.copytree(os.path.join(layout.root, "train"), tmp_path / "copy")
    cfg = load_config(None, [f"data.train={layout.root}", f"data.val={tmp_path / 'copy'}", *COMMON])
    with pytest.raises(DataError, match=r"hold 32 of the same samples \(keys 'n01440764_10026'"):
        build_data(cfg, "val")


def test_timm_train_split_given_to_val_is_refused(tmp_path):
    root = L.timm_wds(str(tmp_path / "wds")).root
    cfg = load_config(None, [f"data.train={root}", f"data.val={root}", "data.val_split=train",
                             *COMMON])
    with pytest.raises(DataError, match="names the train split"):
        build_data(cfg, "val")
    cfg = load_config(None, [f"data.train={root}/imagenet1k-train-{{0000..0001}}.tar",
                             f"data.val={root}/imagenet1k-train-0001.tar", *COMMON])
    with pytest.raises(DataError, match=r"gives train shards .* not val shards"):
        build_data(cfg, "val")


def test_parquet_test_split_without_labels_is_refused(tmp_path):
    layout = L.hf_parquet(str(tmp_path / "hf"))
    with pytest.raises(DataError, match=r"split 'test' .* no labels for all its samples"):
        build_data(_cfg(layout, "data.val_split=test"), "val")


def test_parquet_class_names_come_from_the_card(tmp_path):
    layout = L.hf_parquet(str(tmp_path / "hf"))
    assert source_of(_cfg(layout), "train").classes == L.NAMES


def _damage_parquet(path, column, group=0):
    """Overwrites the middle third of `column`'s chunk in row group `group` of a Parquet file
    (its compressed pages, or a page header: pyarrow's error then spans lines)."""
    import pyarrow.parquet as pq
    meta = pq.ParquetFile(path).metadata.row_group(group)
    chunk = next(meta.column(c) for c in range(meta.num_columns)
                 if meta.column(c).path_in_schema == column)
    start, size = chunk.dictionary_page_offset or chunk.data_page_offset, chunk.total_compressed_size
    with open(path, "r+b") as f:
        f.seek(start + size // 3)
        f.write(b"\xff" * (size // 3))


@pytest.mark.parametrize("column", ["image.path", "image.bytes", "label"])
def test_parquet_with_damaged_pages_is_named_at_start_up(tmp_path, capsys, column):
    """Issue 44.13: corrupt data pages (`OSError: Corrupt snappy compressed data`) end the
    start with one line naming the file, as a corrupt shard does; nothing is trained."""
    from train_imagenet.__main__ import main
    layout = L.hf_parquet(str(tmp_path / "hf"))
    path = os.path.join(layout.root, "data", "train-00000-of-00002.parquet")
    _damage_parquet(path, column)
    out = tmp_path / "run"
    assert main([f"data.train={layout.root}", f"data.val={layout.root}", f"output_dir={out}",
                 *TINY_RUN, "data.num_classes=4", "epochs=1", "aug.no_aug=true", "aug.mixup=0",
                 "aug.cutmix=0"]) == 2
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"{path!r}" in errors[0] and "download it again" in errors[0], err
    assert "Traceback" not in err and not (out / "log.jsonl").exists()


@pytest.mark.parametrize("workers", [0, 1])
def test_parquet_damaged_while_training_is_one_line_naming_it(tmp_path, workers):
    """A row group damaged after the start fails the epoch as a shard truncated mid-run
    does: one line naming the file and the row group, not pyarrow's lines or the worker's
    traceback."""
    layout = L.hf_parquet(str(tmp_path / "hf"))
    pipe = build_data(_cfg(layout, f"data.num_workers={workers}"), "train")
    path = os.path.join(layout.root, "data", "train-00001-of-00002.parquet")
    _damage_parquet(path, "label")                   # a page header: a message of 3 lines
    with pytest.raises(DataError) as err:
        for _ in pipe.loader(0):
            pass
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text and "DataLoader worker" not in text
    assert text.startswith(f"{path!r} cannot be read (row group 0: OSError: ") and \
        "download it again" in text


def test_parquet_without_pyarrow_says_which_extra(tmp_path, monkeypatch):
    import builtins
    layout = L.hf_parquet(str(tmp_path / "hf"))
    real = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(DataError, match=r"needs pyarrow: pip install 'dcvit\[parquet\]'"):
        build_data(_cfg(layout), "train")


def test_flat_folder_without_its_labels_file_says_which_key(tmp_path):
    layout = L.kaggle(str(tmp_path / "k"))
    cfg = load_config(None, [f"data.train={layout.train}", f"data.val={layout.val}", *COMMON])
    with pytest.raises(DataError, match="flat image folder: give its labels file as data.val_labels=FILE"):
        build_data(cfg, "val")


@pytest.mark.parametrize("fmt", ["index", "index1", "name", "one_a_line"])
def test_flat_folder_takes_every_labels_format(tmp_path, fmt):
    layout = L.kaggle(str(tmp_path / "k"))
    path, extra = tmp_path / "labels.txt", []
    if fmt == "index":
        path.write_text("".join(f"{L.val_key(i)}.JPEG {l}\n" for i, l in enumerate(L.VAL_LABELS)))
    elif fmt == "index1":
        path.write_text("".join(f"{L.val_key(i)} {l + 1}\n" for i, l in enumerate(L.VAL_LABELS)))
        extra = ["data.label_offset=1"]
    elif fmt == "name":
        path.write_text("".join(f"{L.val_key(i)} {L.WNIDS[l]}\n" for i, l in enumerate(L.VAL_LABELS)))
    else:
        path.write_text("".join(f"{l}\n" for l in L.VAL_LABELS))
    cfg = load_config(None, [f"data.train={layout.train}", f"data.val={layout.val}",
                             f"data.val_labels={path}", *extra, *COMMON])
    assert _visits(build_data(cfg, "val"), L.VAL_LABELS) == collections.Counter(range(L.N_VAL))


@pytest.mark.slow
def test_resume_mid_epoch_is_exact_on_each_source(layout, tmp_path):
    """A run restarted from a mid-epoch checkpoint ends with the weights of the uninterrupted
    run, on every kind of source (augmentation on: the order and the random draws replay)."""
    import shutil
    import torch
    from train_imagenet.__main__ import main
    from train_imagenet.checkpoint import list_checkpoints, load_checkpoint

    def run(out, *extra):
        return main([f"data.train={layout.train or layout.root}", f"data.val={layout.val or layout.root}",
                     *layout.args, f"output_dir={out}", *TINY_RUN, "data.num_classes=4", "epochs=2",
                     "batch_size=4", "save_every_steps=3", "keep_checkpoints=20", "aug.mixup=0.8",
                     "aug.cutmix=1.0", *extra])
    full = tmp_path / "full"
    assert run(full) == 0
    mid = [p for p in list_checkpoints(str(full)) if 0 < load_checkpoint(p)["batch"]]
    assert mid, "expected a mid-epoch checkpoint"
    resumed = tmp_path / "resumed"
    os.makedirs(resumed)
    shutil.copy(mid[-1], resumed)
    assert run(resumed, "resume=auto") == 0
    a = load_checkpoint(list_checkpoints(str(full))[-1])
    b = load_checkpoint(list_checkpoints(str(resumed))[-1])
    assert a["update"] == b["update"] == 16
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
