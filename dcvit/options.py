"""The DCMHA options (`DCMHAOptions`): the paper's ablations (docs/spec.md §1.3), their
defaults and their checks, shared by `dcvit.DCMHA`, `dcvit.convert` and the model builders."""
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Dict, Optional

from .cli import did_you_mean
from .matrices import ComposeSlots

__all__ = ["DCMHAOptions", "DCMHA_OPTIONS", "STATIC_INITS", "DYNAMIC_ACTS"]

# Values of the string options.
STATIC_INITS = ("zeros", "normal")
DYNAMIC_ACTS = ("gelu", "gelu_tanh")


@dataclass(frozen=True)
class DCMHAOptions:
    """The DCMHA options: the paper's ablations (docs/spec.md §1.3) and their defaults.

    Attributes:
        rank: R of the low-rank dynamic projections (>= 1).
        query_wise, key_wise: compose with weights generated per query / per key token.
        pre_compose, post_compose: compose the scores (before softmax) / weights (after).
        dynamic_proj, dynamic_gate: use the low-rank projections / the diagonal gates.
        static_proj: add a learned static H×H matrix (Talking-Heads) in each Compose stage.
        static_init: its initialisation, "zeros" or "normal" (N(0, 0.1·sqrt(1/H)), the
            authors' vision models).
        dynamic_act: activation of the dynamic-weight hidden layer, "gelu" (exact) or
            "gelu_tanh" (tanh approximation, the authors' vision models).
        dynamic_drop: dropout rate on the dynamic hidden layer and on the gates.
        qk_norm_bias: with ``qk_norm``, whether the q/k norms have a bias (False: the
            authors' scale-only LayerNorm).

    Every option is a keyword of `DCMHA`, `dcvit.convert` and ``timm.create_model`` for the
    DCViT models; a bad value or a combination that composes nothing raises on construction.
    (Which blocks get DCMHA, ``dcmha_layers``, is a model option of `dcvit.models`.)
    """

    rank: int = 2
    query_wise: bool = True
    key_wise: bool = True
    pre_compose: bool = True
    post_compose: bool = True
    dynamic_proj: bool = True
    dynamic_gate: bool = True
    static_proj: bool = False
    static_init: str = "zeros"
    dynamic_act: str = "gelu"
    dynamic_drop: float = 0.0
    qk_norm_bias: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"DCMHA: rank must be an integer >= 1, got {self.rank!r}")
        if self.static_init not in STATIC_INITS:
            raise ValueError(f"DCMHA: static_init must be one of {STATIC_INITS}, got {self.static_init!r}")
        if self.dynamic_act not in DYNAMIC_ACTS:
            raise ValueError(f"DCMHA: dynamic_act must be one of {DYNAMIC_ACTS}, got {self.dynamic_act!r}")
        if not isinstance(self.dynamic_drop, (int, float)) or not 0.0 <= self.dynamic_drop < 1.0:
            raise ValueError(f"DCMHA: dynamic_drop must be a rate in [0, 1), got {self.dynamic_drop!r}")
        not_bool = {f.name: getattr(self, f.name) for f in fields(self)
                    if f.type is bool and not isinstance(getattr(self, f.name), bool)}
        if not_bool:  # a string such as "no" would read as True
            raise TypeError(f"DCMHA: {', '.join(f'{k}={v!r}' for k, v in not_bool.items())} must "
                            f"be True or False")
        if not (self.composes("pre") or self.composes("post")):
            raise ValueError(f"DCMHA: options {self} compose nothing; enable at least one of "
                             "pre_compose/post_compose, one of query_wise/key_wise and one of "
                             "dynamic_proj/dynamic_gate/static_proj (or use timm.layers.Attention)")

    @classmethod
    def of(cls, where: str = "DCMHA", base: Optional["DCMHAOptions"] = None,
           **options: Any) -> "DCMHAOptions":
        """``base`` (default: the defaults) with ``options`` replaced; an unknown name raises
        ``TypeError`` naming ``where``, the closest option and all of them."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"{where}: unknown DCMHA option(s) {unknown}{did_you_mean(unknown[0], names)} "
                            f"(valid options: {names})")
        return replace(base or cls(), **options)

    def as_dict(self) -> Dict[str, Any]:
        """The options as keyword arguments (for ``timm.create_model``, records, JSON)."""
        return asdict(self)

    @property
    def slots(self) -> ComposeSlots:
        """The dynamic (stage, side) slots these options give (`ComposeSlots`)."""
        return ComposeSlots.from_options(self.pre_compose, self.post_compose, self.query_wise,
                                         self.key_wise, self.dynamic_proj or self.dynamic_gate)

    def composes(self, stage: str) -> bool:
        """Whether Compose stage ``"pre"`` or ``"post"`` exists (with a dynamic or static term)."""
        on = self.pre_compose if stage == "pre" else self.post_compose
        return on and (self.static_proj or self.slots.stage(stage) != (None, None))


# The defaults by name (for code that reads a dict; `DCMHAOptions` is the source).
DCMHA_OPTIONS: Dict[str, Any] = DCMHAOptions().as_dict()
