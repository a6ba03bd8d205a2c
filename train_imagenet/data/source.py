"""What every data source is: a `Source` (what `data.train`/`data.val` resolved to) and
`DataError`, the one error type of the data package.

A source kind is a module with two functions, the small interface `build_data` uses:
``count(source, key, num_classes, cache_dir)`` gives ``{'num_samples', 'num_classes',
'classes_exact'}`` after checking the source, and ``dataset(source, transform, plan)`` gives
the dataset (and for map-style ones the sampler) of one rank. `shards` (tar files read as
a stream) and `folder` (image files read by index) are the kinds.
"""
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

__all__ = ["DataError", "Source", "is_remote"]


class DataError(ValueError):
    """Missing, empty or inconsistent data; the message names the path and the fix."""


@dataclass
class Source:
    """One split of a data set, as found on disk.

    `kind` says how it is read ('wds': tar shards, streamed; 'folder': image files by
    index), `layout` what it is ('shards': this project's shards, 'imagefolder': class
    sub-folders), `split` the split it holds ('train', 'val', or '' when unknown)."""
    kind: str                                         # 'wds' or 'folder'
    shards: List[str] = field(default_factory=list)   # wds: the tar files, in order
    root: str = ""                                    # folder: the ImageFolder root
    layout: str = ""
    split: str = ""
    num_samples: Optional[int] = None                 # known without a scan, when it is
    classes: Optional[List[str]] = None               # class names in label order, when known
    shard_lengths: Optional[List[int]] = None         # samples per file, when known
    samples: Optional[List[Tuple[str, int]]] = None   # folder: (file, label), when not listed

    def __post_init__(self) -> None:
        if not self.layout:
            self.layout = {"wds": "shards", "folder": "imagefolder"}.get(self.kind, self.kind)

    @property
    def files(self) -> List[str]:
        """The files (or the folder) this source reads."""
        return list(self.shards) if self.shards else [self.root]

    def describe(self, num_samples: Optional[int] = None, num_classes: Optional[int] = None) -> str:
        """One line: the layout, the split, the files, the samples and the classes."""
        files = self.files
        span = files[0] if len(files) == 1 else f"{len(files)} files, {files[0]} .. {files[-1]}"
        n = num_samples if num_samples is not None else self.num_samples
        c = len(self.classes) if self.classes else num_classes
        return (f"{self.layout}, split {self.split or '?'}: {span}; "
                f"{'?' if n is None else n} samples, {'?' if c is None else c} classes")


def is_remote(url: str) -> bool:
    return url.startswith("pipe:") or "://" in url
