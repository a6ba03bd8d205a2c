#!/usr/bin/env python
"""Convert an ImageNet copy into WebDataset shards, or verify shards: the ``dcvit-shards``
command (`train_imagenet.shards`), under the script name older commands use.

    python scripts/make_wds_shards.py --src imagenet/train --out shards   # = dcvit-shards ...
"""
import sys

from train_imagenet.shards.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="make_wds_shards.py"))
