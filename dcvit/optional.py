"""Optional dependencies: imported when a feature needs them, with the extra that installs them.

``pip install dcvit`` brings what the models, training and accounting need; figures need
matplotlib (``dcvit[report]``) and the quick start's digits need scikit-learn
(``dcvit[quickstart]``, which includes the report's).
"""
import importlib
from types import ModuleType

__all__ = ["require", "EXTRAS"]

# top-level module -> (distribution, extra that installs it)
EXTRAS = {"matplotlib": ("matplotlib", "report"), "sklearn": ("scikit-learn", "quickstart")}


def require(module: str, purpose: str) -> ModuleType:
    """``import module``, or an ImportError that names the package and dcvit's extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        dist, extra = EXTRAS[module.split(".")[0]]
        raise ImportError(f"{purpose} needs {dist}, an optional dependency of dcvit: "
                          f"pip install 'dcvit[{extra}]' (or pip install {dist})") from e
