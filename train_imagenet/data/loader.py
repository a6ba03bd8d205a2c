"""The loader of one split for one rank (`DataPipe`): a fresh, seeded DataLoader per epoch,
whose batches are ``(images, labels, skipped)``, `skipped` counting the corrupt samples
skipped (or, in evaluation, dropped) on the way to that batch."""
import random
import re
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader

__all__ = ["DataPipe", "collate", "seeded", "worker_message"]

# torch re-raises a worker's exception as its type with the text "Caught <type> in DataLoader
# worker process N.\nOriginal Traceback ...", whose last lines are "<module>.DataError: msg".
_WORKER_ERROR = re.compile(r"^Caught \w+ in DataLoader worker process \d+\.")
_LAST = re.compile(r"^(?:[\w.]+\.)?DataError: ", re.M)


def seeded(*parts: int) -> random.Random:
    """A random generator seeded by (seed, epoch, rank, worker, ...): the data order's only
    source of randomness."""
    return random.Random("-".join(str(p) for p in parts))


def collate(batch: List[Optional[Tuple[Any, int, int]]]) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Stacks (image, label, skipped) samples; a None (a dropped corrupt evaluation sample)
    counts as skipped."""
    kept = [b for b in batch if b is not None]
    skipped = len(batch) - len(kept) + sum(b[2] for b in kept)
    if not kept:
        return torch.empty(0), torch.empty(0, dtype=torch.long), skipped
    return (torch.stack([b[0] for b in kept]), torch.tensor([b[1] for b in kept]), skipped)


def worker_message(text: str) -> Optional[str]:
    """The message of a DataError raised in a DataLoader worker, out of the traceback text
    torch wraps it in; None if `text` is not such a wrapper."""
    if not _WORKER_ERROR.match(text):
        return None
    found = list(_LAST.finditer(text))
    return text[found[-1].end():].strip() if found else None


class _Loader(DataLoader):
    """A DataLoader whose workers' DataErrors come out as the one-line error they are (not
    wrapped in the worker's traceback)."""

    def __iter__(self) -> Iterator[Any]:
        return _unwrapped(super().__iter__())


def _unwrapped(batches: Iterator[Any]) -> Iterator[Any]:
    from .source import DataError
    try:
        yield from batches
    except DataError as e:
        message = worker_message(str(e))
        if message is None:
            raise
        raise DataError(message) from None


class DataPipe:
    """The loader of one split for one rank: `loader(epoch)` is a fresh, seeded DataLoader."""

    def __init__(self, dataset: Any, *, training: bool, batch_size: int, num_workers: int,
                 pin_memory: bool, seed: int, rank: int, world_size: int, num_samples: int,
                 batches_per_epoch: int, sampler_fn: Optional[Callable[[int], Any]] = None,
                 source: Any = None):
        self.dataset, self.training = dataset, training
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.num_samples, self.batches_per_epoch = num_samples, batches_per_epoch
        self.sampler_fn, self.source = sampler_fn, source

    def describe(self) -> str:
        """What this split resolved to (the source's layout, split, files, samples, classes)."""
        return self.source.describe(self.num_samples) if self.source is not None else "?"

    def loader(self, epoch: int = 0) -> DataLoader:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        gen = torch.Generator().manual_seed(seeded(self.seed, epoch, self.rank).getrandbits(62))
        sampler = self.sampler_fn(epoch) if self.sampler_fn else None
        return _Loader(self.dataset, batch_size=self.batch_size, sampler=sampler,
                          num_workers=self.num_workers,
                          pin_memory=self.pin_memory and torch.cuda.is_available(),
                          drop_last=self.training and sampler is not None, generator=gen,
                          collate_fn=collate, persistent_workers=False)
