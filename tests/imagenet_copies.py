"""Tiny exact copies of the ImageNet layouts people have, with the truth of every image.

Four real WNIDs, 8 train and 3 val images a class (one CMYK JPEG and one PNG named
``.JPEG`` among the train images, as ImageNet has), each image's bytes unique, so a sample
read back from shards is matched to its source and its class by its bytes alone. The
builders write each layout with its real names, metadata and members:

* `train_folder`, `val_flat`: ``train/<wnid>/<wnid>_<n>.JPEG``, ``val/ILSVRC2012_val_<n>.JPEG``;
* `train_tar`, `val_tar`, `devkit`: image-net.org's ``ILSVRC2012_img_train.tar`` (a tar of
  ``<wnid>.tar``), ``ILSVRC2012_img_val.tar`` and ``ILSVRC2012_devkit_t12`` (``meta.mat``
  written by scipy, the ground truth in the devkit's own class order) or its ``.tar.gz``;
* `kaggle`: ``LOC_synset_mapping.txt``, ``LOC_val_solution.csv``, ``ILSVRC/Data/CLS-LOC/{train,val}``;
* `timm_wds`: ``imagenet1k-{train-NNNN,validation-NN}.tar`` (``jpg``/``cls``/``json``),
  ``_info.json`` and ``_info.yaml``;
* `parquet`: ``data/{train,validation,test}-NNNNN-of-NNNNN.parquet`` (``image{bytes,path}``,
  ``label``; test labels -1) and the dataset card's ``dataset_info``;
* `torchvision_root`: ``meta.bin``, ``train/<wnid>/``, ``val/<wnid>/``.
"""
from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

WNIDS = ["n01440764", "n01443537", "n01484850", "n01491361"]      # sorted: the class indices
WORDS = ["tench, Tinca tinca", "goldfish, Carassius auratus", "great white shark", "tiger shark"]
DEVKIT_ORDER = [2, 0, 3, 1]   # ILSVRC2012_ID 1..4 name WNIDS[2], WNIDS[0], ...: not the sorted order
TRAIN_PER_CLASS, VAL_PER_CLASS = 8, 3


@dataclass
class Copy:
    train: dict = field(default_factory=dict)   # wnid -> [(file name, bytes)]
    val: list = field(default_factory=list)     # [(file name, bytes, wnid)], sorted by name

    def label_of(self) -> dict:
        """{image bytes: class index} over both splits."""
        truth = {data: WNIDS.index(w) for w, files in self.train.items() for _, data in files}
        truth.update({data: WNIDS.index(w) for _, data, w in self.val})
        return truth


def _image(rng, kind: str = "jpeg") -> bytes:
    pixels = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
    buf = io.BytesIO()
    if kind == "cmyk":
        Image.fromarray(pixels).convert("CMYK").save(buf, format="JPEG")
    else:
        Image.fromarray(pixels).save(buf, format="PNG" if kind == "png" else "JPEG", quality=90)
    return buf.getvalue()


def make_copy(seed: int = 0) -> Copy:
    rng = np.random.default_rng(seed)
    copy = Copy()
    for c, wnid in enumerate(WNIDS):
        kinds = {(0, 1): "cmyk", (1, 2): "png"}
        copy.train[wnid] = [(f"{wnid}_{100 + n}.JPEG", _image(rng, kinds.get((c, n), "jpeg")))
                            for n in range(TRAIN_PER_CLASS)]
    order = [WNIDS[i % len(WNIDS)] for i in (3, 1, 0, 2, 2, 0, 1, 3, 0, 1, 3, 2)]
    copy.val = [(f"ILSVRC2012_val_{n + 1:08d}.JPEG", _image(rng), w) for n, w in enumerate(order)]
    return copy


def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 1341000000, 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def train_folder(copy: Copy, root: Path) -> Path:
    for wnid, files in copy.train.items():
        (root / wnid).mkdir(parents=True, exist_ok=True)
        for name, data in files:
            (root / wnid / name).write_bytes(data)
    return root


def val_flat(copy: Copy, root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, data, _ in copy.val:
        (root / name).write_bytes(data)
    return root


def train_tar(copy: Copy, folder: Path) -> Path:
    path = folder / "ILSVRC2012_img_train.tar"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_tar_bytes([(f"{w}.tar", _tar_bytes(files)) for w, files in reversed(copy.train.items())]))
    return path


def val_tar(copy: Copy, folder: Path) -> Path:
    path = folder / "ILSVRC2012_img_val.tar"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_tar_bytes([(name, data) for name, data, _ in copy.val]))
    return path


def ground_truth(copy: Copy) -> str:
    """ILSVRC2012_validation_ground_truth.txt: the 1-based ILSVRC2012_ID of each val image."""
    return "".join(f"{DEVKIT_ORDER.index(WNIDS.index(w)) + 1}\n" for _, _, w in copy.val)


def devkit(copy: Copy, folder: Path, as_tar_gz: bool = False) -> Path:
    """ILSVRC2012_devkit_t12/data/{meta.mat, ILSVRC2012_validation_ground_truth.txt}: meta.mat
    holds the leaf synsets in ILSVRC2012_ID order and two parents (num_children > 0)."""
    from scipy.io import savemat
    root = folder / "ILSVRC2012_devkit_t12"
    (root / "data").mkdir(parents=True, exist_ok=True)
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children",
              "wordnet_height", "num_train_images"]
    rows = [(i + 1, WNIDS[c], WORDS[c], "a fish", 0, np.zeros((0,)), 0, TRAIN_PER_CLASS)
            for i, c in enumerate(DEVKIT_ORDER)]
    rows += [(5, "n02512053", "fish", "parent", 2, np.array([1, 2]), 1, 0),
             (6, "n01473806", "aquatic vertebrate", "parent", 1, np.array([5]), 2, 0)]
    synsets = np.array(rows, dtype=[(f, "O") for f in fields]).reshape(-1, 1)
    savemat(root / "data" / "meta.mat", {"synsets": synsets})
    (root / "data" / "ILSVRC2012_validation_ground_truth.txt").write_text(ground_truth(copy))
    if not as_tar_gz:
        return root
    path = folder / "ILSVRC2012_devkit_t12.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(root, arcname=root.name)
    return path


def kaggle(copy: Copy, root: Path) -> Path:
    images = root / "ILSVRC" / "Data" / "CLS-LOC"
    train_folder(copy, images / "train")
    val_flat(copy, images / "val")
    (root / "LOC_synset_mapping.txt").write_text("".join(f"{w} {t}\n" for w, t in zip(WNIDS, WORDS)))
    rows = [f"{Path(n).stem},{w} 12 7 300 211 {w} 40 40 90 90\n" for n, _, w in reversed(copy.val)]
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "".join(rows))
    return root


def timm_wds(copy: Copy, root: Path, info: bool = True) -> Path:
    """timm/imagenet-1k-wds: train in two shards, validation in one; every sample jpg, cls, json."""
    root.mkdir(parents=True, exist_ok=True)
    train = [(Path(n).stem, d, w) for w, files in copy.train.items() for n, d in files]
    train = [train[i] for i in np.random.default_rng(1).permutation(len(train))]
    val = [(Path(n).stem, d, w) for n, d, w in copy.val]
    splits = {}
    for split, samples, shards in (("train", train, 2), ("validation", val, 1)):
        names, lengths = [], []
        for i, part in enumerate(np.array_split(np.arange(len(samples)), shards)):
            name = f"imagenet1k-{split}-{i:04d}.tar" if split == "train" else f"imagenet1k-{split}-{i:02d}.tar"
            members = []
            for j in part:
                key, data, w = samples[j]
                label = WNIDS.index(w)
                meta = {"filename": f"{key}.JPEG", "label": label, "class_name": w}
                members += [(f"{key}.jpg", data), (f"{key}.cls", str(label).encode()),
                            (f"{key}.json", json.dumps(meta).encode())]
            (root / name).write_bytes(_tar_bytes(members))
            names.append(name)
            lengths.append(len(part))
        splits[split] = {"name": split, "num_samples": len(samples), "filenames": names, "shard_lengths": lengths}
    if info:
        data = {"name": "imagenet-1k", "splits": splits, "num_classes": len(WNIDS)}
        (root / "_info.json").write_text(json.dumps(data))
        (root / "_info.yaml").write_text(yaml.safe_dump(data))
    return root


def parquet(copy: Copy, root: Path) -> Path:
    """ILSVRC/imagenet-1k: two train files, one validation, one test (labels -1)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    (root / "data").mkdir(parents=True, exist_ok=True)
    train = [(n, d, WNIDS.index(w)) for w, files in copy.train.items() for n, d in files]
    val = [(n, d, WNIDS.index(w)) for n, d, w in copy.val]
    test = [(f"ILSVRC2012_test_{i + 1:08d}.JPEG", d, -1) for i, (_, d, _) in enumerate(copy.val[:4])]
    for split, rows, files in (("train", train, 2), ("validation", val, 1), ("test", test, 1)):
        for i, part in enumerate(np.array_split(np.arange(len(rows)), files)):
            table = pa.table({
                "image": pa.array([{"bytes": rows[j][1], "path": rows[j][0]} for j in part],
                                  type=pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                "label": pa.array([rows[j][2] for j in part], type=pa.int64())})
            pq.write_table(table, root / "data" / f"{split}-{i:05d}-of-{files:05d}.parquet", row_group_size=5)
    card = {"dataset_info": {"features": [
        {"name": "image", "dtype": "image"},
        {"name": "label", "dtype": {"class_label": {"names": {str(i): t for i, t in enumerate(WORDS)}}}}],
        "splits": [{"name": "train", "num_examples": len(train)}]}}
    (root / "README.md").write_text("---\n" + yaml.safe_dump(card) + "---\n\n# ImageNet\n")
    return root


def torchvision_root(copy: Copy, root: Path) -> Path:
    """torchvision.datasets.ImageNet's prepared root: meta.bin, train/<wnid>/, val/<wnid>/."""
    import torch
    train_folder(copy, root / "train")
    for name, data, w in copy.val:
        (root / "val" / w).mkdir(parents=True, exist_ok=True)
        (root / "val" / w / name).write_bytes(data)
    torch.save(({w: (t,) for w, t in zip(WNIDS, WORDS)}, [w for _, _, w in copy.val]), root / "meta.bin")
    return root
