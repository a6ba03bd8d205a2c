"""Reading the evaluation files the trainer writes (``eval.json``); the trainer is never imported."""
import json
from pathlib import Path
from typing import Any, Dict

from .model_spec import ModelSpec, ReportError

__all__ = ["read_results", "results_spec"]

_RESULT_KWARGS = ("img_size", "num_classes")


def read_results(path: str) -> Dict[str, Any]:
    """Read one evaluation file (``eval.json`` of the trainer) and check its keys."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ReportError(f"cannot read results file {path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReportError(f"results file {path} is not valid JSON ({e}); expected the eval.json "
                          "the trainer writes") from e
    if not isinstance(data, dict):
        raise ReportError(f"results file {path} holds a {type(data).__name__}, expected an object "
                          '{"model": ..., "top1": ..., "top5": ..., "num_samples": ...}')
    missing = [k for k in ("model", "top1") if k not in data]
    if missing:
        raise ReportError(f"results file {path} lacks {missing}; it has keys {sorted(data)}")
    for key in ("top1", "top5"):
        value = data.get(key)
        if value is not None and not (isinstance(value, (int, float)) and 0 <= value <= 100):
            raise ReportError(f"results file {path}: {key}={value!r} is not a percentage in [0, 100]")
    if not isinstance(data.get("model_kwargs", {}), dict):
        raise ReportError(f"results file {path}: model_kwargs must be an object, "
                          f"got {data['model_kwargs']!r}")
    return data


def results_spec(data: Dict[str, Any], base_kwargs: Dict[str, Any]) -> ModelSpec:
    """The model configuration a results file describes, on top of the CLI's kwargs."""
    kwargs = dict(base_kwargs)
    kwargs.update({k: data[k] for k in _RESULT_KWARGS if data.get(k) is not None})
    kwargs.update(data.get("model_kwargs") or {})
    convert = data.get("convert")   # {"layers": ..., "options": {...}} of a converted run
    if isinstance(convert, dict):
        convert = {**(convert.get("options") or {}),
                   **({"layers": convert["layers"]} if convert.get("layers") is not None else {})}
    return ModelSpec.of(data["model"], kwargs, convert if isinstance(convert, dict) else None)
