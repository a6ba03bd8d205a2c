"""conftest for timm's test_models.py (copied beside it by scripts/timm_model_tests.py).

Imports dcvit before timm's test module is collected, so that its models are in timm's
registry when the test parameters are listed, and keeps only the tests of those models.
"""
import timm.models._registry as registry

import dcvit  # noqa: F401  (registers the models)


def dcvit_models():
    """Every model name registered by a module of the dcvit package."""
    return sorted(name for name, fn in registry._model_entrypoints.items()
                  if getattr(fn, "__module__", "").split(".")[0] == "dcvit")


def pytest_collection_modifyitems(config, items):
    ours = set(dcvit_models())
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        (keep if params.get("model_name") in ours else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_report_header(config):
    return "dcvit models under test: " + " ".join(dcvit_models())
