"""Which model is counted, with which options, against which baseline."""
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import timm
from torch import nn

from ..attention import DCMHAOptions
from ..cli import did_you_mean, parse_kwargs
from ..models import DCVIT_MODELS

__all__ = ["ReportError", "ModelSpec", "check_model_name", "parse_model_kwargs", "DEFAULT_MODELS"]

SIZES = ("tiny", "small", "medium", "base")
DEFAULT_MODELS = [f"{family}_{size}_patch16_224" for size in SIZES for family in ("vit", "dcvit")]

_ALIASES = {name.split("_patch")[0]: name for name in DCVIT_MODELS}   # dcvit_small -> ..._224
_MODEL_ONLY = set(DCMHAOptions().as_dict()) | {"dcmha_layers"}       # not given to the baseline


class ReportError(ValueError):
    """A bad model name, option or results file; the message names it and the fix."""


def _freeze(value: Any) -> Any:  # lists (dcmha_layers=[0, 1]) become hashable tuples
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class ModelSpec:
    """A timm model name and the keyword arguments it was built with; with ``convert``, the
    model converted to DCMHA by ``dcvit.convert(model, **convert)`` (``layers`` and options)."""

    name: str
    kwargs: Tuple[Tuple[str, Any], ...] = ()
    convert: Optional[Tuple[Tuple[str, Any], ...]] = None

    @classmethod
    def of(cls, name: str, kwargs: Optional[Dict[str, Any]] = None,
           convert: Optional[Dict[str, Any]] = None) -> "ModelSpec":
        frozen = None if convert is None else tuple(sorted((k, _freeze(v)) for k, v in convert.items()))
        return cls(name, tuple(sorted((k, _freeze(v)) for k, v in (kwargs or {}).items())), frozen)

    @property
    def kwargs_dict(self) -> Dict[str, Any]:
        return dict(self.kwargs)

    @property
    def convert_dict(self) -> Optional[Dict[str, Any]]:
        return None if self.convert is None else {k: list(v) if isinstance(v, tuple) else v
                                                  for k, v in self.convert}

    @property
    def family(self) -> str:
        if self.convert is not None:
            return "dcvit"
        return "dcvit" if self.name.startswith("dcvit") else "vit" if self.name.startswith("vit") else "other"

    def baseline(self) -> "ModelSpec":
        """The plain ViT a DCViT is compared with, the original of a converted model; any
        other model is its own baseline."""
        if self.convert is not None:
            return ModelSpec(self.name, self.kwargs)
        if self.family != "dcvit":
            return self
        canonical = _ALIASES.get(self.name, self.name)
        kwargs = {k: v for k, v in self.kwargs if k not in _MODEL_ONLY}
        return ModelSpec.of("vit" + canonical[len("dcvit"):], kwargs)

    def build(self) -> nn.Module:
        check_model_name(self.name)
        try:
            model = timm.create_model(self.name, **self.kwargs_dict)
        except (TypeError, ValueError, AssertionError) as e:
            raise ReportError(f"cannot build {self.name} with model kwargs {self.kwargs_dict}: {e}") from e
        if self.convert is not None:
            from ..conversion import convert
            try:
                convert(model, **self.convert_dict)
            except (TypeError, ValueError) as e:
                raise ReportError(f"cannot convert {self.name} with {self.convert_dict}: {e}") from e
        return model

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs)
        text = f"{self.name}({args})" if args else self.name
        if self.convert is not None:
            text += " + DCMHA(" + ", ".join(f"{k}={v!r}" for k, v in self.convert) + ")"
        return text


def check_model_name(name: str) -> None:
    """Raise `ReportError` listing close matches if timm does not know ``name``."""
    if timm.is_model(name):
        return
    stem = re.split(r"[_\d]", name, maxsplit=1)[0] or name
    # the closest names, else the names holding its first word, the closest first
    hint = did_you_mean(name, timm.list_models(), n=5) or \
        did_you_mean(name, timm.list_models(f"*{stem}*"), n=8, cutoff=0)
    raise ReportError(f"unknown model {name!r}{hint} (list them with timm.list_models('*{stem}*'))")


def parse_model_kwargs(items: Sequence[str], flag: str = "--model-kwargs") -> Dict[str, Any]:
    """``["img_size=32", "class_token=false"]`` -> a dict of values (`dcvit.cli.parse_kwargs`)."""
    try:
        return parse_kwargs(items, flag)
    except ValueError as e:
        raise ReportError(str(e)) from e
