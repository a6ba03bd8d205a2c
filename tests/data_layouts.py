"""Tiny exact copies of the ImageNet layouts people have (real file names, metadata and
members; 4 classes, 32 train and 12 val images, one CMYK JPEG and one PNG named as a JPEG):
timm's WebDataset release, the Hugging Face Parquet release, a torchvision-prepared root,
Kaggle's CLS-LOC folders with ``LOC_val_solution.csv``, image-net.org's archives and devkit.

Every image is one solid colour that says which sample it is: red = 5 x its index in its
split, green = 60 x its label, blue = 128 (`identify` reads them back from a batch), so a
test can check each sample's label against the truth after the loader.
"""
import io
import json
import os
import tarfile
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np
import torch
from PIL import Image

WNIDS = ["n01440764", "n01443537", "n01484850", "n01491361"]
NAMES = ["tench, Tinca tinca", "goldfish, Carassius auratus",
         "great white shark, white shark, man-eater, man-eating shark, Carcharodon carcharias",
         "tiger shark, Galeocerdo cuvieri"]
N_TRAIN, N_VAL = 32, 12
TRAIN_LABELS = [i % 4 for i in range(N_TRAIN)]
VAL_LABELS = [(i * 3 + 1) % 4 for i in range(N_VAL)]


@dataclass(frozen=True)
class Layout:
    root: str                     # what data.train / data.val are given
    train_labels: List[int]
    val_labels: List[int]
    args: Tuple[str, ...] = ()    # further keys (data.val_labels=...)
    train: str = ""               # data.train when it differs from root
    val: str = ""


def image_bytes(index: int, label: int, fmt: str = "JPEG") -> bytes:
    img = Image.new("RGB", (40, 40), (5 * index, 60 * label, 128))
    buf = io.BytesIO()
    if fmt == "CMYK":
        img.convert("CMYK").save(buf, format="JPEG", quality=100)
    else:
        img.save(buf, format=fmt, **({"quality": 100} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _image(split: str, i: int, label: int) -> bytes:
    """Sample 1 of train is a PNG under a JPEG name, sample 0 of val a CMYK JPEG."""
    fmt = "PNG" if (split, i) == ("train", 1) else "CMYK" if (split, i) == ("val", 0) else "JPEG"
    return image_bytes(i, label, fmt)


def identify(images: torch.Tensor) -> Tuple[List[int], List[int]]:
    """(sample index, label) of each image of a batch normalised with mean 0 and std 1."""
    means = images.mean(dim=(2, 3)) * 255
    return ([int(round(float(r) / 5)) for r in means[:, 0]],
            [int(round(float(g) / 60)) for g in means[:, 1]])


def train_key(i: int) -> str:
    return f"{WNIDS[TRAIN_LABELS[i]]}_{10026 + i}"


def val_key(i: int) -> str:
    return f"ILSVRC2012_val_{i + 1:08d}"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 0
    tar.addfile(info, io.BytesIO(data))


def timm_wds(root: str, info: str = "both") -> Layout:
    """timm/imagenet-1k-wds: imagenet1k-train-{0000..0001}.tar, imagenet1k-validation-00.tar,
    samples jpg/cls/json; `info` 'both', 'json', 'yaml' or 'none' (_info files)."""
    os.makedirs(root, exist_ok=True)
    splits: Dict[str, Dict] = {}
    for split, n, per, labels, key, digits in (("train", N_TRAIN, 16, TRAIN_LABELS, train_key, 4),
                                               ("validation", N_VAL, 12, VAL_LABELS, val_key, 2)):
        names, lengths = [], []
        for s, start in enumerate(range(0, n, per)):
            name = f"imagenet1k-{split}-{s:0{digits}d}.tar"
            with tarfile.open(os.path.join(root, name), "w") as tar:
                for i in range(start, min(start + per, n)):
                    k = key(i)
                    _add(tar, f"{k}.jpg", _image("train" if split == "train" else "val", i, labels[i]))
                    _add(tar, f"{k}.cls", str(labels[i]).encode())
                    _add(tar, f"{k}.json", json.dumps({"filename": f"{k}.JPEG", "label": labels[i],
                                                        "class_name": NAMES[labels[i]]}).encode())
            names.append(name)
            lengths.append(min(start + per, n) - start)
        splits[split] = {"name": split, "num_samples": n, "filenames": names,
                         "shard_lengths": lengths}
    doc = {"name": "imagenet-1k", "splits": splits, "num_classes": 4}
    if info in ("both", "json"):
        with open(os.path.join(root, "_info.json"), "w") as f:
            json.dump(doc, f)
    if info in ("both", "yaml"):
        import yaml
        with open(os.path.join(root, "_info.yaml"), "w") as f:
            yaml.safe_dump(doc, f)
    return Layout(root, TRAIN_LABELS, VAL_LABELS)


def hf_parquet(root: str) -> Layout:
    """ILSVRC/imagenet-1k: data/{train-0000{0,1}-of-00002,validation-00000-of-00001,
    test-00000-of-00001}.parquet, columns image{bytes,path} and label, names in README.md."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    kinds = pa.struct([("bytes", pa.binary()), ("path", pa.string())])

    def write(name: str, rows: List[Tuple[bytes, str, int]]) -> None:
        table = pa.table({"image": pa.array([{"bytes": b, "path": p} for b, p, _ in rows], kinds),
                          "label": pa.array([l for _, _, l in rows], pa.int64())})
        pq.write_table(table, os.path.join(root, "data", name), row_group_size=10)

    train = [(_image("train", i, TRAIN_LABELS[i]), f"{train_key(i)}.JPEG", TRAIN_LABELS[i])
             for i in range(N_TRAIN)]
    write("train-00000-of-00002.parquet", train[:16])
    write("train-00001-of-00002.parquet", train[16:])
    write("validation-00000-of-00001.parquet",
          [(_image("val", i, VAL_LABELS[i]), f"{val_key(i)}.JPEG", VAL_LABELS[i]) for i in range(N_VAL)])
    write("test-00000-of-00001.parquet",
          [(image_bytes(i, 0), f"ILSVRC2012_test_{i + 1:08d}.JPEG", -1) for i in range(4)])
    names = "\n".join(f"          '{i}': {n}" for i, n in enumerate(NAMES))
    with open(os.path.join(root, "README.md"), "w") as f:
        f.write(f"---\nannotations_creators:\n- crowdsourced\nlicense: other\ndataset_info:\n"
                f"  config_name: default\n  features:\n  - name: image\n    dtype: image\n"
                f"  - name: label\n    dtype:\n      class_label:\n        names:\n{names}\n"
                f"  splits:\n  - name: train\n    num_examples: {N_TRAIN}\n"
                f"  - name: validation\n    num_examples: {N_VAL}\n---\n\n# ImageNet\n")
    return Layout(root, TRAIN_LABELS, VAL_LABELS)


def _class_folders(root: str, split: str, labels: List[int], key) -> None:
    for i, label in enumerate(labels):
        d = os.path.join(root, WNIDS[label])
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{key(i)}.JPEG"), "wb") as f:
            f.write(_image(split, i, label))


def torchvision_root(root: str) -> Layout:
    """torchvision.datasets.ImageNet's prepared root: meta.bin, train/<wnid>/, val/<wnid>/."""
    os.makedirs(root, exist_ok=True)
    _class_folders(os.path.join(root, "train"), "train", TRAIN_LABELS, train_key)
    _class_folders(os.path.join(root, "val"), "val", VAL_LABELS, val_key)
    torch.save(({w: tuple(n.split(", ")) for w, n in zip(WNIDS, NAMES)},
                [WNIDS[l] for l in VAL_LABELS]), os.path.join(root, "meta.bin"))
    return Layout(root, TRAIN_LABELS, VAL_LABELS)


def kaggle(root: str) -> Layout:
    """Kaggle's ILSVRC: Data/CLS-LOC/train/<wnid>/, a flat Data/CLS-LOC/val/ and
    LOC_val_solution.csv (label then boxes), LOC_synset_mapping.txt."""
    base = os.path.join(root, "ILSVRC", "Data", "CLS-LOC")
    _class_folders(os.path.join(base, "train"), "train", TRAIN_LABELS, train_key)
    os.makedirs(os.path.join(base, "val"), exist_ok=True)
    rows = ["ImageId,PredictionString"]
    for i, label in enumerate(VAL_LABELS):
        with open(os.path.join(base, "val", f"{val_key(i)}.JPEG"), "wb") as f:
            f.write(_image("val", i, label))
        rows.append(f"{val_key(i)},{WNIDS[label]} 11 18 441 291 {WNIDS[label]} 1 2 30 40 ")
    solution = os.path.join(root, "LOC_val_solution.csv")
    with open(solution, "w") as f:
        f.write("\n".join(rows) + "\n")
    with open(os.path.join(root, "LOC_synset_mapping.txt"), "w") as f:
        f.write("".join(f"{w} {n}\n" for w, n in zip(WNIDS, NAMES)))
    return Layout(root, TRAIN_LABELS, VAL_LABELS, (f"data.val_labels={solution}",),
                  train=os.path.join(base, "train"), val=os.path.join(base, "val"))


def _tar_bytes(members: List[Tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            _add(tar, name, data)
    return buf.getvalue()


DEVKIT_ORDER = [2, 0, 3, 1]  # ILSVRC2012_ID 1..4 name WNIDS[2], WNIDS[0], ...: not the sorted order


def imagenet_org(root: str) -> Layout:
    """image-net.org's downloads: ILSVRC2012_img_train.tar (a tar of <wnid>.tar, each a flat
    tar of that class's JPEGs), ILSVRC2012_img_val.tar (flat), and the devkit both as
    ILSVRC2012_devkit_t12/ and ILSVRC2012_devkit_t12.tar.gz: data/meta.mat (written by
    scipy; the leaf synsets in ILSVRC2012_ID order, two parents) and
    data/ILSVRC2012_validation_ground_truth.txt (1-based ids in the devkit's order)."""
    from scipy.io import savemat
    os.makedirs(root, exist_ok=True)
    per_class: Dict[int, List[Tuple[str, bytes]]] = {}
    for i, label in enumerate(TRAIN_LABELS):
        per_class.setdefault(label, []).append((f"{train_key(i)}.JPEG", _image("train", i, label)))
    with open(os.path.join(root, "ILSVRC2012_img_train.tar"), "wb") as f:
        f.write(_tar_bytes([(f"{WNIDS[c]}.tar", _tar_bytes(per_class[c])) for c in sorted(per_class, reverse=True)]))
    with open(os.path.join(root, "ILSVRC2012_img_val.tar"), "wb") as f:
        f.write(_tar_bytes([(f"{val_key(i)}.JPEG", _image("val", i, label)) for i, label in enumerate(VAL_LABELS)]))
    kit = os.path.join(root, "ILSVRC2012_devkit_t12")
    os.makedirs(os.path.join(kit, "data"), exist_ok=True)
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images"]
    rows = [(i + 1, WNIDS[c], NAMES[c], "a fish", 0, np.zeros((0,)), 0, TRAIN_LABELS.count(c))
            for i, c in enumerate(DEVKIT_ORDER)]
    rows += [(5, "n02512053", "fish", "parent", 2, np.array([1, 2]), 1, 0),
             (6, "n01473806", "aquatic vertebrate", "parent", 1, np.array([5]), 2, 0)]
    savemat(os.path.join(kit, "data", "meta.mat"),
            {"synsets": np.array(rows, dtype=[(f, "O") for f in fields]).reshape(-1, 1)})
    with open(os.path.join(kit, "data", "ILSVRC2012_validation_ground_truth.txt"), "w") as f:
        f.write("".join(f"{DEVKIT_ORDER.index(label) + 1}\n" for label in VAL_LABELS))
    with tarfile.open(kit + ".tar.gz", "w:gz") as tar:
        tar.add(kit, arcname=os.path.basename(kit))
    return Layout(os.path.join(root, "ILSVRC2012_img_train.tar"), TRAIN_LABELS, VAL_LABELS,
                  val=os.path.join(root, "ILSVRC2012_img_val.tar"))


LAYOUTS = {"timm-wds": timm_wds, "parquet": hf_parquet, "torchvision": torchvision_root,
           "kaggle": kaggle}


def shards_of_same_images(root: str) -> Layout:
    """This project's shards holding the same images: train-00000{0,1}.tar, val-000000.tar."""
    os.makedirs(root, exist_ok=True)
    for split, labels, per in (("train", TRAIN_LABELS, 16), ("val", VAL_LABELS, 12)):
        for s, start in enumerate(range(0, len(labels), per)):
            with tarfile.open(os.path.join(root, f"{split}-{s:06d}.tar"), "w") as tar:
                for i in range(start, min(start + per, len(labels))):
                    _add(tar, f"{i:08d}.jpg", _image(split, i, labels[i]))
                    _add(tar, f"{i:08d}.cls", str(labels[i]).encode())
    return Layout(root, TRAIN_LABELS, VAL_LABELS)


def as_array(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))
