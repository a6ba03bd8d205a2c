"""Reading the evaluation files the trainer writes (``eval.json``, `dcvit.schema.EvalResult`);
the trainer is never imported."""
import json
from pathlib import Path
from typing import Any, Dict

from ..schema import EvalResult, SchemaError
from .model_spec import ModelSpec, ReportError

__all__ = ["read_results", "results_spec"]


def read_results(path: str) -> EvalResult:
    """Read one evaluation file (``eval.json`` of the trainer) and check it against its schema."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ReportError(f"cannot read results file {path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReportError(f"results file {path} is not valid JSON ({e}); expected the eval.json "
                          "the trainer writes") from e
    try:
        return EvalResult.from_dict(data, f"results file {path}")
    except SchemaError as e:
        raise ReportError(str(e)) from e


def results_spec(result: EvalResult, base_kwargs: Dict[str, Any]) -> ModelSpec:
    """The model configuration a results file describes, on top of the CLI's kwargs."""
    kwargs = dict(base_kwargs)
    kwargs.update({k: v for k, v in (("img_size", result.img_size), ("num_classes", result.num_classes))
                   if v is not None})
    kwargs.update(result.model_kwargs)
    convert = result.convert   # {"layers": ..., "options": {...}} of a converted run
    if convert is not None:
        convert = {**(convert.get("options") or {}),
                   **({"layers": convert["layers"]} if convert.get("layers") is not None else {})}
    return ModelSpec.of(result.model, kwargs, convert)
