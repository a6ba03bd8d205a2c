"""Image files read by index (torchvision's ImageFolder: ``ROOT/<class>/<image>``): the
count, `FolderDataset` (image, label, skipped) and the per-rank samplers.

Training uses torch's DistributedSampler (or timm's RepeatAugSampler for repeated
augmentation): a fixed, seeded order per epoch and the same number of samples on every rank.
Evaluation gives rank r the samples r, r + world, ...: every sample once, no padding.
"""
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from PIL import Image
from torch.utils.data import Dataset
from timm.data.distributed_sampler import RepeatAugSampler

from .source import DataError, Source

__all__ = ["FolderDataset", "count", "dataset"]


def count(source: Source, key: str = "data", num_classes: Optional[int] = None,
          cache_dir: Optional[str] = None) -> Dict[str, int]:
    """An ImageFolder's samples and classes, listed."""
    from torchvision.datasets import ImageFolder
    ds = ImageFolder(source.root)
    return {"num_samples": len(ds), "num_classes": len(ds.classes), "classes_exact": 1}


class FolderDataset(Dataset):
    """torchvision's ImageFolder that returns (image, label, skipped).

    A corrupt file fails (`on_corrupt='fail'`) or is skipped: for training (`replace=True`) the
    next index is read instead, so every batch stays full; for evaluation None is returned and
    the collate function drops it, so no sample is counted twice."""

    def __init__(self, root: str, transform: Callable, on_corrupt: str = "skip",
                 replace: bool = False):
        from torchvision.datasets import ImageFolder
        self.folder = ImageFolder(root)
        self.transform, self.on_corrupt, self.replace = transform, on_corrupt, replace

    def __len__(self) -> int:
        return len(self.folder)

    def _open(self, path: str) -> Optional[Image.Image]:
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except Exception as e:  # PIL raises many types for broken files
            if self.on_corrupt == "fail":
                raise DataError(f"corrupt image {path!r}: {e} (set data.on_corrupt=skip)") from e
            return None

    def __getitem__(self, i: int) -> Optional[Tuple[Any, int, int]]:
        n = len(self.folder)
        for skipped in range(n if self.replace else 1):
            path, label = self.folder.samples[(i + skipped) % n]
            img = self._open(path)
            if img is not None:
                return self.transform(img), label, skipped
        if self.replace:
            raise DataError(f"no readable image in {self.folder.root!r} ({n} corrupt files)")
        return None


def dataset(source: Source, transform: Callable, cfg: Any, training: bool, rank: int,
            world_size: int, batches: int) -> Tuple[FolderDataset, Callable[[int], Any], int]:
    """(the dataset, the sampler of each epoch, batches per epoch) of a folder."""
    ds = FolderDataset(source.root, transform, cfg.data.on_corrupt, replace=training)
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
