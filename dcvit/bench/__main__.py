"""``python -m dcvit.bench``: the same as ``dcvit-bench``."""
from .benchmark import main

main()
