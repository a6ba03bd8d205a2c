"""Command-line helpers shared by ``dcvit-report`` and the scripts: ``key=value`` parsing and
the "did you mean" hint of every unknown-name message."""
import ast
import difflib
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence

import yaml

__all__ = ["parse_kwargs", "did_you_mean"]


def _value(text: str) -> Any:
    value = yaml.safe_load(text)
    if isinstance(value, str):
        # YAML leaves Python spellings as strings: 1e-3, None, (1, 2).
        try:
            literal = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return value
        if not isinstance(literal, str):
            return literal
    return value


def parse_kwargs(items: Sequence[str], flag: str = "--model-kwargs") -> Dict[str, Any]:
    """``["img_size=32", "class_token=false", "dcmha_layers=[0,1]"]`` -> keyword arguments.

    Values are YAML (``false`` -> False, ``[0, 1]`` -> a list, ``avg`` -> a string), with
    Python literals YAML reads as strings (``1e-3``, ``None``) taken as Python. An empty
    value (``key=``) is None. Raises ``ValueError`` naming the bad item and ``flag``.
    """
    out: Dict[str, Any] = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key.isidentifier():
            raise ValueError(f"{flag} entry {item!r} is not key=value (e.g. img_size=32)")
        try:
            out[key] = _value(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{flag} entry {item!r}: cannot parse the value {text!r} as YAML "
                             f"({str(e).splitlines()[0]}); quote a string, e.g. {key}='...'") from e
    return out


def did_you_mean(name: str, choices: Iterable[str], n: int = 3, cutoff: float = 0.6,
                 shown: Optional[Mapping[str, str]] = None) -> str:
    """``"; did you mean 'rank'?"`` for the choices close to ``name`` (at most ``n``, the
    closest first: 'a', 'b' or 'c'), or ``""`` when none is. ``shown`` gives the text suggested
    for a choice where it differs (``{"lr": "optim.lr"}``: a key found by its last part is
    suggested whole)."""
    close = [repr((shown or {}).get(c, c))
             for c in difflib.get_close_matches(name, sorted(choices), n=n, cutoff=cutoff)]
    if not close:
        return ""
    listed = close[0] if len(close) == 1 else f"{', '.join(close[:-1])} or {close[-1]}"
    return f"; did you mean {listed}?"
