"""``python -m dcvit.report`` is ``dcvit-report``."""
import sys

from .cli import main

sys.exit(main())
