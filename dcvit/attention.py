"""DCMHA: multi-head self-attention whose heads are composed per token (docs/spec.md §1.2–1.3).

`DCMHA` is a drop-in ``attn_layer`` for timm's ``VisionTransformer``: same constructor
arguments and ``forward`` signature as ``timm.layers.Attention``, same parameter names
(``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``proj``), plus two small submodules:

* ``dynamic_weights`` (`DynamicWeights`): the per-token low-rank weights and gates,
* ``pre_compose`` / ``post_compose`` (`Compose`): mixing of scores and of weights.

Forward hooks on ``pre_compose``/``post_compose`` see the attention scores/weights before
(input) and after (output) composition only on the ``reference`` attention core: the fast
cores of `dcvit.fused` fuse both Compose stages into one kernel and never call these
modules. `dcvit.attention_maps` forces the reference core itself; around your own hooks use
``with dcvit.fused.attention_impl("reference"): model(x)``.
"""
import copy
import math
import warnings
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Dict, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from timm.layers import Attention, register_notrace_module
from timm.layers.attention import maybe_add_mask, resolve_self_attn_mask
from torch import Tensor, nn

from .cli import did_you_mean
from .functional import compose_unchecked
from .export_core import export_core
from .fused import composed_attention, composed_attention_compile, select_impl
from .matrices import (ComposeMatrices, ComposeSlots, compose_stage_macs, rms_normalize,
                       slot_matrices, slot_matrices_from_projections, stage_matrices)

__all__ = ["DCMHA", "DCMHAOptions", "DynamicWeights", "Compose", "DCMHA_OPTIONS", "DCMHA_PARTS",
           "hidden_width", "dcmha_layer"]

# Values of the string options.
STATIC_INITS = ("zeros", "normal")
DYNAMIC_ACTS = ("gelu", "gelu_tanh")

# The submodules that hold DCMHA's own parameters in every DCMHA layer (dcvit's and converted
# ones): what a conversion adds to a model, and what a plain ViT checkpoint lacks.
DCMHA_PARTS = ("dynamic_weights", "pre_compose", "post_compose")


def hidden_width(num_heads: int) -> int:
    """K, the width of `DynamicWeights`' hidden layer: 4H (the authors' setting)."""
    return 4 * num_heads


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

    def __getitem__(self, name: str) -> Any:
        """``options["rank"]``, as when a layer's options were a dict: deprecated."""
        warnings.warn(f"layer.options[{name!r}] is deprecated; use layer.options.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(self, name)

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

ComposeWeights = Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor],
                       Optional[Tensor], Optional[Tensor], Optional[Tensor]]


@torch.fx.wrap
def _check_input(x: Tensor, dim: int) -> None:
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError("DCMHA expects input of shape (B, N, " + str(dim) + "), got "
                         + str(list(x.shape)))


@torch.fx.wrap
def _eager_core(layer: nn.Module, q: Tensor, k: Tensor, v: Tensor, x: Tensor,
                attn_mask: Optional[Tensor], is_causal: bool) -> Tensor:
    """``layer._core(...)``, one call in an FX graph: a symbolically traced model runs the
    same attention core as the eager model (bit-equal outputs and gradients). ``layer`` is a
    `DCMHA` or a converted layer of `dcvit.conversion`."""
    return layer._core(q, k, v, x, attn_mask, is_causal)


def _compose_macs(layer: nn.Module, num_heads: int) -> int:
    """Both Compose stages' multiply-adds per (batch element, query, key) in the paper's
    formulation (`dcvit.matrices.compose_stage_macs`), for FLOP counters of the fused core;
    counted once, when `init_compose` builds the stages."""
    o = layer.options
    return sum(compose_stage_macs(layer.slots, name, num_heads, o.rank, o.dynamic_proj,
                                  stage.static is not None)
               for name, stage in (("pre", layer.pre_compose), ("post", layer.post_compose))
               if stage is not None)


class DynamicWeights(nn.Module):
    """Per-token Compose weights generated from the attention input (docs/spec.md §1.2).

    One "slot" per (stage, side) that is composed, out of
    ``pre-query, pre-key, post-query, post-key``. For x of shape (B, N, C)::

        hidden = gelu(einsum('bnc,cgk->bngk', x, dw1))      # (B, N, G, K), K = 4H (hidden_width)
        hidden = dropout(hidden)                             # dynamic_drop (default 0)
        w      = einsum('bngk,gkih->bngih', hidden, qkw)     # (B, N, G, 2R, H)
        w1, w2 = w.split(R, dim=-2)                          # (B, N, G, R, H) each
        w1     = w1 * rsqrt(mean_h(w1^2) + 1e-6)             # RMS-norm over heads
        dd     = dropout(tanh(x @ dd_w)).view(B, N, G, H)    # (B, N, G, H)

    ``gelu`` is exact (``dynamic_act="gelu"``) or tanh-approximate (``"gelu_tanh"``).
    (``x @ dw1`` and ``x @ dd_w`` run as one GEMM when both exist.) Returns ``(w1, w2, dd)``;
    ``w1``/``w2`` are None without ``dynamic_proj`` and ``dd`` is None without
    ``dynamic_gate``. With ``raw=True`` it returns ``(w, None, dd)``, ``w`` the projections
    (B, N, G, 2R, H) before the split and the norm (the fast attention cores build the
    Compose matrices from them in one kernel).
    """

    def __init__(self, dim: int, num_heads: int, num_slots: int, rank: int = 2,
                 dynamic_proj: bool = True, dynamic_gate: bool = True,
                 dynamic_act: str = "gelu", dynamic_drop: float = 0.0,
                 device=None, dtype=None) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.dim, self.num_heads, self.num_slots, self.rank = dim, num_heads, num_slots, rank
        self.hidden_dim = hidden_width(num_heads)
        # "gelu": exact (erf) GELU; "gelu_tanh": its tanh approximation (flax's nn.gelu).
        self.approximate = "tanh" if dynamic_act == "gelu_tanh" else "none"
        # Dropout on the hidden layer and on the gates (the authors' dynamic_dropout_rate).
        self.drop = nn.Dropout(dynamic_drop)
        if dynamic_proj:
            self.dw1 = nn.Parameter(torch.empty(dim, num_slots, self.hidden_dim, **dd))
            self.qkw = nn.Parameter(torch.empty(num_slots, self.hidden_dim, 2 * rank, num_heads, **dd))
        else:
            self.register_parameter("dw1", None)
            self.register_parameter("qkw", None)
        if dynamic_gate:
            self.dd_w = nn.Parameter(torch.empty(dim, num_slots * num_heads, **dd))
        else:
            self.register_parameter("dd_w", None)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """The initialisation of the authors' training code: DCMHA starts almost as MHA."""
        c, h, k, r = self.dim, self.num_heads, self.hidden_dim, self.rank
        if self.dw1 is not None and self.qkw is not None:
            nn.init.normal_(self.dw1, std=math.sqrt(2.0 / (c + k)))
            nn.init.normal_(self.qkw, std=math.sqrt(1.0 / k) * 2.0 / (h + r) * 0.01)
        if self.dd_w is not None:
            nn.init.normal_(self.dd_w, std=math.sqrt(2.0 / (c + h)) * 0.005)

    def forward(self, x: Tensor, raw: bool = False) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        B, N, C = x.shape
        w1: Optional[Tensor] = None
        w2: Optional[Tensor] = None
        dd: Optional[Tensor] = None
        G, K, H = self.num_slots, self.hidden_dim, self.num_heads
        gate_in: Optional[Tensor] = None
        if self.dw1 is not None and self.qkw is not None:
            if self.dd_w is not None:                        # both input projections in one GEMM
                y = x @ torch.cat([self.dw1.reshape(C, G * K), self.dd_w], dim=1)   # (B, N, GK + GH)
                hidden = F.gelu(y[..., :G * K], approximate=self.approximate).reshape(B, N, G, K)
                gate_in = y[..., G * K:]
            else:
                hidden = F.gelu(torch.einsum("bnc,cgk->bngk", x, self.dw1),      # (B, N, G, K)
                                approximate=self.approximate)
            hidden = self.drop(hidden)
            w = torch.einsum("bngk,gkih->bngih", hidden, self.qkw)              # (B, N, G, 2R, H)
            if raw:
                w1 = w
            else:
                w1, w2 = w.split(self.rank, dim=-2)                              # (B, N, G, R, H)
                w1 = rms_normalize(w1)
        if self.dd_w is not None:
            if gate_in is None:
                gate_in = x @ self.dd_w
            dd = self.drop(torch.tanh(gate_in)).reshape(B, N, G, H)               # (B, N, G, H)
        return w1, w2, dd

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, slots={self.num_slots}, rank={self.rank}"


class Compose(nn.Module):
    """`dcvit.compose` as a module, so hooks and per-module FLOP tables can see it.

    Holds the optional static H×H matrix (``static_proj``: Talking-Heads), initialised to
    zeros (``static_init="zeros"``: composition starts as the identity) or, as in the
    authors' vision models, N(0, 0.1·sqrt(1/H)) (``static_init="normal"``).
    """

    def __init__(self, num_heads: int, static_proj: bool = False, static_init: str = "zeros",
                 device=None, dtype=None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.static_init = static_init
        if static_proj:
            self.static = nn.Parameter(torch.zeros(num_heads, num_heads, device=device, dtype=dtype))
        else:
            self.register_parameter("static", None)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        if self.static is None:
            return
        if self.static_init == "normal":
            nn.init.normal_(self.static, std=0.1 * math.sqrt(1.0 / self.num_heads))
        else:
            nn.init.zeros_(self.static)

    def forward(self, a: Tensor, qw1: Optional[Tensor], qw2: Optional[Tensor],
                kw1: Optional[Tensor], kw2: Optional[Tensor],
                qdd: Optional[Tensor], kdd: Optional[Tensor]) -> Tensor:
        return compose_unchecked(a, qw1, qw2, kw1, kw2, qdd, kdd, self.static)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, static_proj={self.static is not None}"


def check_heads(dim: int, num_heads: int) -> None:
    """DCMHA's heads split the width evenly (a ``ValueError`` listing valid counts otherwise)."""
    if num_heads < 1 or dim % num_heads != 0:
        raise ValueError(f"DCMHA: num_heads={num_heads} must divide dim={dim} "
                         f"(valid head counts: {[h for h in range(1, dim + 1) if dim % h == 0][:12]}...)")


def init_compose(layer: nn.Module, dim: int, num_heads: int, options: DCMHAOptions,
                 device=None, dtype=None) -> None:
    """Give ``layer`` DCMHA's own parts for input width ``dim``: ``dynamic_weights``,
    ``pre_compose``, ``post_compose`` (each None when ``options`` do not use it), ``slots``
    (with ``pre_slots``, ``post_slots`` and ``identity_slots`` read from it once, here)
    and ``attn_impl``, the attention core it runs: "auto" (by device, dtype and context) or
    one of dcvit.fused.IMPLS to force it (``dcvit.fused.attention_impl(...)`` overrides all)."""
    dd = {"device": device, "dtype": dtype}
    o = layer.options = options
    layer.slots = o.slots
    # What the forward reads of the slots, as plain fields (ints and tuples, which torch <
    # 2.5's dynamo reads where it cannot call ComposeSlots' methods): each stage's (query,
    # key) slots and the query-side slots, whose matrices carry the identity.
    layer.pre_slots, layer.post_slots = o.slots.stage("pre"), o.slots.stage("post")
    layer.identity_slots = o.slots.query_slots
    layer.dynamic_weights = DynamicWeights(
        dim, num_heads, layer.slots.count, o.rank, o.dynamic_proj, o.dynamic_gate, o.dynamic_act,
        float(o.dynamic_drop), **dd) if layer.slots.count else None
    layer.pre_compose = Compose(num_heads, o.static_proj, o.static_init, **dd) if o.composes("pre") else None
    layer.post_compose = Compose(num_heads, o.static_proj, o.static_init, **dd) if o.composes("post") else None
    layer.compose_macs = _compose_macs(layer, num_heads)
    layer.attn_impl = "auto"


class DCMHA(nn.Module):
    """Dynamically Composable Multi-Head Attention (self-attention).

    Args (those of ``timm.layers.Attention``):
        dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop,
        norm_layer, device, dtype.
    Args (the paper's ablations, docs/spec.md §1.3):
        options: a `DCMHAOptions` (default: its defaults), and/or
        **option_kwargs: its fields by name (``rank=1, static_proj=True``), over ``options``.

    Shapes: ``forward(x (B, N, dim), attn_mask=None, is_causal=False) -> (B, N, dim)``;
    ``attn_mask`` broadcasts to (B, H, N, N), bool (True = keep) or float (added), and is
    applied after pre-compose, before softmax.
    """

    slots: ComposeSlots   # (TorchScript reads the attributes' types from here)
    pre_slots: Tuple[Optional[int], Optional[int]]
    post_slots: Tuple[Optional[int], Optional[int]]

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            scale_norm: bool = False,
            proj_bias: bool = True,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: Optional[Type[nn.Module]] = None,
            options: Optional[DCMHAOptions] = None,
            device=None,
            dtype=None,
            **option_kwargs: Any,
    ) -> None:
        super().__init__()
        check_heads(dim, num_heads)
        self.options = DCMHAOptions.of("DCMHA", options, **option_kwargs)
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError("DCMHA: norm_layer must be given when qk_norm or scale_norm is True")
        dd = {"device": device, "dtype": dtype}
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        # The same constructor arguments build the matching plain attention (see as_mha).
        self._mha_args = dict(dim=dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm,
                              scale_norm=scale_norm, proj_bias=proj_bias, attn_drop=attn_drop,
                              proj_drop=proj_drop, norm_layer=norm_layer)

        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        qk = {} if self.options.qk_norm_bias else {"bias": False}
        self.q_norm = norm_layer(self.head_dim, **qk, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim, **qk, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(dim, **dd) if scale_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        init_compose(self, dim, num_heads, self.options, **dd)

    def _slot(self, w1: Optional[Tensor], w2: Optional[Tensor], dd: Optional[Tensor],
              q_slot: Optional[int], k_slot: Optional[int]) -> ComposeWeights:
        """One stage's arguments of `compose` from the dynamic weights and its slots."""
        qw1: Optional[Tensor] = None
        qw2: Optional[Tensor] = None
        kw1: Optional[Tensor] = None
        kw2: Optional[Tensor] = None
        qdd: Optional[Tensor] = None
        kdd: Optional[Tensor] = None
        if w1 is not None and w2 is not None:
            if q_slot is not None:
                qw1, qw2 = w1[:, :, q_slot], w2[:, :, q_slot]                    # (B, N, R, H)
            if k_slot is not None:
                kw1, kw2 = w1[:, :, k_slot], w2[:, :, k_slot]                    # (B, N, R, H)
        if dd is not None:
            if q_slot is not None:
                qdd = dd[:, :, q_slot]                                           # (B, N, H)
            if k_slot is not None:
                kdd = dd[:, :, k_slot]                                           # (B, N, H)
        return qw1, qw2, kw1, kw2, qdd, kdd

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        _check_input(x, self.dim)
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)                                                  # (B, H, N, D)
        q, k = self.q_norm(q), self.k_norm(k)

        if torch.jit.is_scripting():
            w1: Optional[Tensor] = None
            w2: Optional[Tensor] = None
            dd: Optional[Tensor] = None
            if self.dynamic_weights is not None:
                w1, w2, dd = self.dynamic_weights(x)
            x = self._reference_core(q, k, v, w1, w2, dd, attn_mask, is_causal)   # (B, H, N, D)
        else:
            x = _eager_core(self, q, k, v, x, attn_mask, is_causal)               # (B, H, N, D)

        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.norm(x)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x

    def _reference_core(self, q: Tensor, k: Tensor, v: Tensor, w1: Optional[Tensor],
                        w2: Optional[Tensor], dd: Optional[Tensor], attn_mask: Optional[Tensor],
                        is_causal: bool) -> Tensor:
        """The paper's formulation through the `Compose` modules (hooks see every map)."""
        N = q.shape[2]
        attn = (q * self.scale) @ k.transpose(-2, -1)                            # (B, H, N, N)
        if self.pre_compose is not None:
            qw1, qw2, kw1, kw2, qdd, kdd = self._slot(w1, w2, dd, self.pre_slots[0], self.pre_slots[1])
            attn = self.pre_compose(attn, qw1, qw2, kw1, kw2, qdd, kdd)
        attn = maybe_add_mask(attn, resolve_self_attn_mask(N, attn, attn_mask, is_causal))
        attn = attn.softmax(dim=-1)
        if self.post_compose is not None:
            qw1, qw2, kw1, kw2, qdd, kdd = self._slot(w1, w2, dd, self.post_slots[0], self.post_slots[1])
            attn = self.post_compose(attn, qw1, qw2, kw1, kw2, qdd, kdd)
        attn = self.attn_drop(attn)
        return attn @ v                                                          # (B, H, N, D)

    @torch.jit.unused
    def _core(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, attn_mask: Optional[Tensor],
              is_causal: bool) -> Tensor:
        """The attention core chosen by `dcvit.fused.select_impl` (``self.attn_impl`` forces one)."""
        dropout = self.training and self.attn_drop.p > 0
        impl, _ = select_impl(self.attn_impl, q, weights=dropout, mask=attn_mask)
        if impl == "export":
            return export_core(self, q, k, v, x, attn_mask, is_causal)
        if impl == "reference":
            w1, w2, dd = self.dynamic_weights(x) if self.dynamic_weights is not None else (None, None, None)
            return self._reference_core(q, k, v, w1, w2, dd, attn_mask, is_causal)
        w, _, dd = self.dynamic_weights(x, raw=True) if self.dynamic_weights is not None else (None, None, None)
        N = q.shape[2]
        mask = resolve_self_attn_mask(N, q, attn_mask, is_causal)               # additive or None
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        with torch.autocast(q.device.type, enabled=False):
            if w is not None:
                m = slot_matrices_from_projections(w, dd, self.identity_slots, dtype)   # (B, N, G, H, H)
            else:
                m = slot_matrices(None, None, dd, self.identity_slots, dtype)
            mats = ComposeMatrices(*self._matrices(self.pre_compose, m, self.pre_slots, dtype, q.device),
                                   *self._matrices(self.post_compose, m, self.post_slots, dtype, q.device))
        if impl != "compile":
            return composed_attention(q, k, v, mask, mats, impl, self.scale, self.compose_macs)
        if dropout:          # the weights, dropped out (in the reference's memory order), then @ v
            weights = composed_attention_compile(q, k, None, mask, mats, self.scale)
            return self.attn_drop(weights.contiguous()) @ v
        return composed_attention_compile(q, k, v, mask, mats, self.scale)

    @torch.jit.unused
    def _matrices(self, stage: Optional[Compose], m: Optional[Tensor],
                  slots: Tuple[Optional[int], Optional[int]], dtype: torch.dtype,
                  device: torch.device) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """One stage's ``(mq, mk)`` from every slot's matrix ``m`` and the stage's slots."""
        if stage is None:
            return None, None
        return stage_matrices(m, slots[0], slots[1], stage.static, self.num_heads, dtype, device)

    @torch.jit.unused
    def as_mha(self) -> Attention:
        """The ``timm.layers.Attention`` with this layer's configuration and qkv/proj weights."""
        ref = next(self.qkv.parameters())
        mha = Attention(**self._mha_args, device=ref.device, dtype=ref.dtype)
        if not self.options.qk_norm_bias:                    # the same (bias-free) q/k norms
            mha.q_norm, mha.k_norm = copy.deepcopy(self.q_norm), copy.deepcopy(self.k_norm)
        missing, unexpected = mha.load_state_dict(self.state_dict(), strict=False)
        assert not missing, missing
        return mha

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options.as_dict().items())


# timm's FX tracer (feature extraction, ``features_only=True, feature_cls="fx"``) keeps the
# layer as one node, so that a traced model can also be scripted (the scripted layer runs
# the reference core); torch.fx.symbolic_trace records `_eager_core` as one call instead.
register_notrace_module(DCMHA)


def dcmha_layer(**options: Any) -> Type[DCMHA]:
    """Deprecated: a `DCMHA` class with ``options`` as its defaults, for timm's ``attn_layer=``.

    Build the timm model and `dcvit.convert` it (as the ``dcvit_*`` models are built), or
    give `DCMHA` a `DCMHAOptions`. Instances are plain `DCMHA` (they pickle).
    """
    warnings.warn("dcvit.dcmha_layer is deprecated: build the timm model and dcvit.convert(model, "
                  "init='paper', **options) it, or pass DCMHA(options=DCMHAOptions(...))",
                  DeprecationWarning, stacklevel=2)
    bound = DCMHAOptions.of("dcmha_layer", **options)

    class ConfiguredDCMHA(DCMHA):
        def __init__(self, dim: int, **kwargs: Any) -> None:
            super().__init__(dim, options=bound, **kwargs)
            self.__class__ = DCMHA       # instances of a class made here could not be pickled

    ConfiguredDCMHA.__name__ = ConfiguredDCMHA.__qualname__ = "DCMHA"
    return ConfiguredDCMHA
