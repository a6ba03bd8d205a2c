"""``dcvit-shards``: the ImageNet copies people have, converted into this project's WebDataset
shards, and shards verified (docs/data.md).

Modules, in the order a conversion runs: `sources` finds what ``--src`` is and lists one
split's samples (`folders`, `archives`, `parquet`; class lists and labels files are
`train_imagenet.data.labels`, which the trainer reads too); `plan` gives them keys and cuts them into shards; `write` writes the shards and
moves them in atomically; `verify` checks shards and splits; `cli` is the command line.

Each ``<split>-NNNNNN.tar`` holds samples ``<key>.jpg|png`` (the source's image bytes) and
``<key>.cls`` (the class index as ASCII digits), beside ``<split>.json``
(`dcvit.schema.ShardMeta`) and ``classes.json``.
"""
from .cli import main
from .plan import ConversionError, make_keys

__all__ = ["main", "ConversionError", "make_keys"]
