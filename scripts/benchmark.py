#!/usr/bin/env python
"""DCViT vs ViT speed and memory, side by side: the same as ``dcvit-bench`` (see dcvit/benchmark.py)."""
from dcvit.benchmark import main

if __name__ == "__main__":
    main()
