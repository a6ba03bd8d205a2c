"""The ``dcvit-shards`` command: convert an ImageNet copy into WebDataset shards, or verify shards.

Exit status: 0 success, 1 verification found problems, 2 bad input or options (one
``error:`` line naming the value and the fix), 130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import argparse
import os
import random
import re
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Sequence

from dcvit.schema import check_split
from train_imagenet.data import DataError

from .plan import ConversionError, Sample, infer_split, make_keys
from .sources import Options, list_source
from .verify import verify
from .write import write_split

EXAMPLES = """\
examples (docs/data.md lists every source):
  dcvit-shards --src imagenet/train --out shards --workers 16
  dcvit-shards --src ILSVRC2012_img_train.tar --out shards
  dcvit-shards --src ILSVRC2012_img_val.tar --out shards --devkit ILSVRC2012_devkit_t12.tar.gz
  dcvit-shards --src imagenet/val --out shards --labels LOC_val_solution.csv --classes shards/classes.json
  dcvit-shards --src imagenet-1k-wds --out shards --split val --classes LOC_synset_mapping.txt
  dcvit-shards --verify shards
"""


def convert(args: argparse.Namespace) -> dict:
    """Lists ``--src``'s samples for ``args.split``, then writes them as that split of ``--out``."""
    src, out, split = Path(args.src), Path(args.out), args.split
    if args.label_names and not args.labels:
        raise ConversionError("--label-names only applies to the labels of --labels FILE")
    opts = Options(classes=args.classes, labels=args.labels, label_offset=args.label_offset,
                   label_names=args.label_names, devkit=args.devkit)
    if src.is_dir() and (out.resolve() == src.resolve() or src.resolve() in out.resolve().parents):
        raise ConversionError(f"--out {out} lies inside --src {src}, where it would be read as a class "
                              "folder; write the shards outside the image tree")
    with ExitStack() as stack:
        listing = list_source(src, split, opts, stack)
    if args.max_shard_bytes and any(m[3] == 0 for m in listing.members):
        raise ConversionError(f"--max-shard-bytes needs the image sizes, which a {listing.kind} source "
                              "does not list; use --shard-size")
    keys = make_keys([m[0] for m in listing.members])
    samples = [Sample(path, key, label, size, at)
               for (_, label, path, size, at), key in zip(listing.members, keys)]
    listing.members = []  # the samples hold what the writers need
    shuffle = split == "train" if args.shuffle is None else args.shuffle
    if shuffle:
        random.Random(args.seed).shuffle(samples)
    print(f"{split}: {len(samples)} samples from {listing.kind} source {listing.source}", file=sys.stderr)
    return write_split(samples, listing.classes, out, split, listing.source, shard_size=args.shard_size,
                       max_shard_bytes=args.max_shard_bytes, shuffled=shuffle, seed=args.seed,
                       workers=args.workers, other_formats=args.other_formats,
                       overwrite=args.overwrite, progress=args.progress)


def _positive(text: str) -> int:
    value = int(float(text)) if re.fullmatch(r"\d+(\.\d+)?(e\d+)?", text) else -1
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Convert an ImageNet copy into WebDataset shards, or verify shards.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    p.add_argument("--src", help="what you have: class folders, a flat folder with --labels, "
                                 "ILSVRC2012_img_train.tar / ILSVRC2012_img_val.tar, timm's WebDataset or "
                                 "Hugging Face's Parquet release, torchvision's or Kaggle's ImageNet root")
    p.add_argument("--out", help="output folder for <split>-NNNNNN.tar, <split>.json, classes.json")
    p.add_argument("--split", default=None,
                   help="the split to write, and to read from a root holding several (default: from "
                        "--src's name, val for 'val'/'validation', test for 'test', else train)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a split of --out made from another source")
    p.add_argument("--shard-size", type=_positive, default=1000, help="max samples per shard (default 1000)")
    p.add_argument("--max-shard-bytes", type=_positive, default=None,
                   help="also close a shard before it exceeds this many bytes, e.g. 1e9")
    p.add_argument("--workers", type=_positive, default=max(1, min(8, os.cpu_count() or 1)),
                   help="processes writing (and verifying) shards in parallel")
    p.add_argument("--labels", help="labels of a flat folder or tar: 'filename label' lines (Kaggle's "
                                    "LOC_val_solution.csv too), or one label a line in sorted filename order")
    p.add_argument("--label-offset", type=int, default=0,
                   help="subtracted from integer labels: 1 for 1-based files (ILSVRC ground truth)")
    p.add_argument("--label-names", help="what integer labels of --labels refer to: names in order "
                                         "(JSON list or one a line) or the ILSVRC devkit meta.mat")
    p.add_argument("--devkit", help="the ILSVRC2012 devkit (folder or .tar.gz) labelling the val images: "
                                    "its ground truth and meta.mat (needs scipy: the devkit extra)")
    p.add_argument("--classes", help="class names in index order (classes.json, one a line, or "
                                     "LOC_synset_mapping.txt); reuses train's indices")
    p.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=None,
                   help="shuffle samples across shards (default: on for the train split only)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    p.add_argument("--other-formats", choices=("png", "error"), default="png",
                   help="non-JPEG/PNG images: re-encode to PNG (default) or stop with an error")
    p.add_argument("--verify", nargs="?", const=True, default=None, metavar="DIR",
                   help="check shards: alone with DIR, or after writing when given without DIR")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Exit status: 0 success, 1 verification found problems, 2 bad input or options,
    130 interrupted (Ctrl-C)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    # No '-': readers find DIR/<split>.json from the text before the first '-' of a shard name.
    if args.split is not None and check_split(args.split):
        parser.error(f"--split {check_split(args.split)}")
    try:
        if args.src is None and args.out is None:
            if not isinstance(args.verify, str):
                parser.error("pass --src SRC --out DIR to write shards, or --verify DIR to check them")
            splits = [args.split] if args.split else None
            return 1 if verify(Path(args.verify), splits, args.workers, args.progress) else 0
        if args.src is None or args.out is None:
            parser.error("writing shards needs both --src and --out")
        if isinstance(args.verify, str) and Path(args.verify).resolve() != Path(args.out).resolve():
            parser.error(f"--verify {args.verify} differs from --out {args.out}; "
                         "use --verify alone to check what was just written")
        if args.split is None:
            inferred = infer_split(Path(args.src).resolve().name)
            args.split = inferred or "train"
            print(f"--split {args.split} ({'from the name of --src' if inferred else 'the default'}; "
                  "pass --split to choose)", file=sys.stderr)
        convert(args)
        if args.verify:
            return 1 if verify(Path(args.out), [args.split], args.workers, args.progress) else 0
        return 0
    except (ConversionError, DataError) as e:  # DataError: the trainer's readers, labels files
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; the shards being written were removed and every split of the "
              "folder is as it was or complete (<split>.json is written last): re-run the command",
              file=sys.stderr)
        return 130


def console() -> None:
    """The ``dcvit-shards`` console script."""
    sys.exit(main(prog="dcvit-shards"))
