"""Image files read by index: an ImageFolder (``ROOT/<class>/<image>``, torchvision's
order; also the ``train/``/``val/`` of a torchvision-prepared ImageNet root) or a flat folder
of images with a labels file (`labels`: every format docs/data.md lists), labelled with the
train split's classes. The count, the sample keys, `FolderDataset` (image, label, skipped)
and the per-rank samplers.

Training uses torch's DistributedSampler (or timm's RepeatAugSampler for repeated
augmentation): a fixed, seeded order per epoch and the same number of samples on every rank.
Evaluation gives rank r the samples r, r + world, ...: every sample once, no padding.
"""
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from PIL import Image
from torch.utils.data import Dataset
from timm.data.distributed_sampler import RepeatAugSampler

from dcvit.schema import IMAGE_EXTENSIONS

from ..images import ImageError, open_image
from .source import DataError, Source

__all__ = ["FolderDataset", "count", "dataset", "flat_source", "keys", "files", "class_names"]


def count(source: Source, key: str = "data", num_classes: Optional[int] = None,
          cache_dir: Optional[str] = None) -> Dict[str, int]:
    """A folder's samples and classes, listed. A flat folder resolved without its labels
    file counts its images (`build_data` reads the labels)."""
    if source.layout == "flat":
        n = len(source.samples) if source.samples is not None else len(flat_images(source.root))
        c = len(source.classes) if source.classes else 0
        return {"num_samples": n, "num_classes": c, "classes_exact": int(bool(c))}
    from torchvision.datasets import ImageFolder
    ds = ImageFolder(source.root)
    return {"num_samples": len(ds), "num_classes": len(ds.classes), "classes_exact": 1}


def flat_images(root: str) -> List[str]:
    """The images directly in `root`, sorted by name."""
    return sorted(os.path.join(root, n) for n in os.listdir(root)
                  if not n.startswith(".") and n.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS
                  and os.path.isfile(os.path.join(root, n)))


def class_names(root: str) -> List[str]:
    """An ImageFolder's classes in label order (torchvision's: sorted folder names)."""
    from torchvision.datasets.folder import find_classes
    return find_classes(root)[0]


def flat_source(root: str, labels: str, key: str, classes: Optional[List[str]], offset: int,
                label_names: str, num_classes: int, split: str) -> Source:
    """A flat image folder labelled by `labels` (a file), the labels looked up in `classes`
    (the train split's; integer labels need none)."""
    from .labels import LabelsError, read_label_names, read_labels
    images = flat_images(root)
    if not images:
        raise DataError(f"{key}={root!r} holds no images directly in it for {key}_labels")
    if not os.path.isfile(labels):
        raise DataError(f"{key}_labels={labels!r} does not exist; give the labels file of "
                        f"{root!r} (docs/data.md lists the formats)")
    names = classes or [str(i) for i in range(num_classes)]
    try:
        given = read_label_names(Path(label_names)) if label_names else None
        found = read_labels(Path(labels), [Path(p) for p in images], names, offset, given)
    except LabelsError as e:
        text = str(e).replace("--label-offset", "data.label_offset").replace(
            "--label-names", "data.label_names")
        if not classes:
            text = text.replace("is not in --classes", "is a class name, but the train split "
                                "names no classes (give integer labels)")
        raise DataError(f"{key}_labels: {text.replace('--classes', 'the train split classes')}") from None
    return Source("folder", root=root, layout="flat", split=split,
                  samples=list(zip(images, found)), classes=classes)


def keys(source: Source) -> List[str]:
    """The samples' keys: their file names without the suffix."""
    samples = source.samples if source.samples is not None else (
        [(p, 0) for p in flat_images(source.root)] if source.layout == "flat"
        else _image_folder(source.root).samples)
    return [os.path.splitext(os.path.basename(p))[0] for p, _ in samples]


def files(source: Source) -> List[str]:
    """The real paths of the images the source reads."""
    samples = source.samples if source.samples is not None else (
        [(p, 0) for p in flat_images(source.root)] if source.layout == "flat"
        else _image_folder(source.root).samples)
    return [os.path.realpath(p) for p, _ in samples]


def _image_folder(root: str) -> Any:
    from torchvision.datasets import ImageFolder
    return ImageFolder(root)


class FolderDataset(Dataset):
    """torchvision's ImageFolder that returns (image, label, skipped).

    A corrupt file fails (`on_corrupt='fail'`) or is skipped: for training (`replace=True`) the
    next index is read instead, so every batch stays full; for evaluation None is returned and
    the collate function drops it, so no sample is counted twice."""

    def __init__(self, root: str, transform: Callable, on_corrupt: str = "skip",
                 replace: bool = False, samples: Optional[List[Tuple[str, int]]] = None):
        self.root = root
        self.samples = samples if samples is not None else _image_folder(root).samples
        self.transform, self.on_corrupt, self.replace = transform, on_corrupt, replace

    def __len__(self) -> int:
        return len(self.samples)

    def _open(self, path: str) -> Optional[Image.Image]:
        try:
            return open_image(path)
        except ImageError as e:
            if self.on_corrupt == "fail":
                raise DataError(f"corrupt image {path!r}: {e} (set data.on_corrupt=skip)") from e
            return None

    def __getitem__(self, i: int) -> Optional[Tuple[Any, int, int]]:
        n = len(self.samples)
        for skipped in range(n if self.replace else 1):
            path, label = self.samples[(i + skipped) % n]
            img = self._open(path)
            if img is not None:
                return self.transform(img), label, skipped
        if self.replace:
            raise DataError(f"no readable image in {self.root!r} ({n} corrupt files)")
        return None


def dataset(source: Source, transform: Callable, cfg: Any, training: bool, rank: int,
            world_size: int, batches: int,
            lengths: Optional[List[int]] = None) -> Tuple[FolderDataset, Callable[[int], Any], int]:
    """(the dataset, the sampler of each epoch, batches per epoch) of a folder."""
    if source.layout == "flat" and source.samples is None:
        raise DataError(f"data.{'train' if training else 'val'}={source.root!r} is a flat image "
                        f"folder: give its labels file as data.{'train' if training else 'val'}"
                        f"_labels=FILE (docs/data.md lists the formats)")
    ds = FolderDataset(source.root, transform, cfg.data.on_corrupt, replace=training,
                       samples=source.samples)
    n = len(ds)
    if training:
        def sampler_fn(epoch: int):
            if cfg.aug.repeated_aug > 1:
                s = RepeatAugSampler(ds, num_replicas=world_size, rank=rank, shuffle=True,
                                     num_repeats=cfg.aug.repeated_aug)
            else:
                s = torch.utils.data.DistributedSampler(ds, num_replicas=world_size, rank=rank,
                                                        shuffle=True, seed=cfg.seed, drop_last=True)
            s.set_epoch(epoch)
            return s
        b, accum = cfg.batch_size, cfg.accum_steps
        batches = (len(sampler_fn(0)) // (b * accum)) * accum  # RepeatAugSampler selects fewer
    else:
        def sampler_fn(epoch: int):
            return list(range(rank, n, world_size))  # every sample once, no padding
    return ds, sampler_fn, batches
