"""DCMHA's attention core as a module (`DCMHACore`), and the two kinds of module it owns.

`DCMHACore` is what DCMHA adds to multi-head attention (docs/spec.md §1.2-1.3): given the
heads' q, k, v (B, H, N, D) and the layer input x (B, N, C) the dynamic weights are
generated from, ``core(q, k, v, x, mask)`` returns the attention output (B, H, N, D). Every
DCMHA layer (`dcvit.DCMHA` and the converted timm layers of `dcvit.conversion`) holds one as
``core`` between its projections, as ``timm.layers.Attention`` holds SDPA. It owns:

* ``dynamic_weights`` (`DynamicWeights`): the per-token low-rank weights and gates,
* ``pre_compose`` / ``post_compose`` (`Compose`): mixing of scores and of weights,
* ``slots`` (`dcvit.matrices.ComposeSlots`): where each stage's dynamic weights live,
* ``attn_drop``, the attention-weight dropout, and ``attn_impl``, the attention core it runs
  ("auto": `dcvit.fused.select_impl` chooses; one of `dcvit.fused.IMPLS` forces it).

Forward hooks on ``pre_compose``/``post_compose`` see the attention scores/weights before
(input) and after (output) composition only on the ``reference`` core: the fast cores fuse
both Compose stages into one kernel and never call these modules. `dcvit.attention_maps`
forces the reference core itself; around your own hooks use
``with dcvit.attention_impl("reference"): model(x)``.
"""
import contextlib
import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from timm.layers.attention import maybe_add_mask
from torch import Tensor, nn

from .export_core import export_core
from .functional import compose_unchecked
from .fused import composed_attention, composed_attention_compile, select_impl
from .matrices import (ComposeMatrices, ComposeSlots, compose_stage_macs, rms_normalize,
                       slot_matrices, slot_matrices_from_projections, stage_matrices)
from .options import DCMHAOptions

__all__ = ["DCMHACore", "DynamicWeights", "Compose", "DCMHA_PARTS", "hidden_width", "run_core"]

# The submodules of `DCMHACore` that hold DCMHA's own parameters: what a conversion adds to
# a model, and what a plain ViT checkpoint lacks.
DCMHA_PARTS = ("dynamic_weights", "pre_compose", "post_compose")

ComposeWeights = Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor],
                       Optional[Tensor], Optional[Tensor], Optional[Tensor]]


def hidden_width(num_heads: int) -> int:
    """K, the width of `DynamicWeights`' hidden layer: 4H (the authors' setting)."""
    return 4 * num_heads


@torch.fx.wrap
def run_core(core: nn.Module, q: Tensor, k: Tensor, v: Tensor, x: Tensor,
             mask: Optional[Tensor]) -> Tensor:
    """``core(q, k, v, x, mask)``, one call in an FX graph: a symbolically traced model runs
    the same attention core as the eager model (bit-equal outputs and gradients)."""
    return core(q, k, v, x, mask)


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
    (``x @ dw1`` and ``x @ dd_w`` run as one GEMM when both exist; the second projection is
    one GEMM batched over the slots.) The export core
    (`dcvit.export_core`) and every other core take the weights from here. Returns ``(w1, w2, dd)``;
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
        G, K, H, R = self.num_slots, self.hidden_dim, self.num_heads, self.rank
        gate_in: Optional[Tensor] = None
        if self.dw1 is not None and self.qkw is not None:
            if self.dd_w is not None:                        # both input projections in one GEMM
                y = x @ torch.cat([self.dw1.reshape(C, G * K), self.dd_w], dim=1)   # (B, N, GK + GH)
                hidden, gate_in = y[..., :G * K], y[..., G * K:]
            else:
                hidden = x @ self.dw1.reshape(C, G * K)                          # (B, N, GK)
            hidden = self.drop(F.gelu(hidden, approximate=self.approximate))
            # every slot's second projection as one batched GEMM over the slots (as einsum runs
            # it; written out, so that an exported graph holds MatMuls, no Einsum)
            per_slot = hidden.reshape(B * N, G, K).transpose(0, 1)                  # (G, BN, K)
            w = (per_slot @ self.qkw.reshape(G, K, 2 * R * H)).transpose(0, 1)      # (BN, G, 2RH)
            w = w.reshape(B, N, G, 2 * R, H)                                        # (B, N, G, 2R, H)
            if raw:
                w1 = w
            else:
                w1, w2 = w.split(R, dim=-2)                                      # (B, N, G, R, H)
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


class DCMHACore(nn.Module):
    """DCMHA's attention core: ``softmax(compose_pre(scale q k^T) + mask) -> compose_post -> @ v``.

    Args:
        dim: the width C of the layer input the dynamic weights are generated from.
        num_heads: H.
        options: the `DCMHAOptions`.
        scale: multiplies q k^T (the layer's, ``head_dim ** -0.5`` in timm's layers).
        attn_drop: dropout rate on the composed attention weights.

    ``forward(q, k, v (B, H, N, D), x (B, N, C), mask=None) -> (B, H, N, D)``; ``mask`` is
    additive (as `timm.layers.attention.resolve_self_attn_mask` makes it), broadcastable to
    (B, H, N, N), and is applied after pre-compose, before softmax. The core that runs is
    `dcvit.fused.select_impl`'s choice (``attn_impl`` forces one).
    """

    slots: ComposeSlots   # (TorchScript reads the attributes' types from here)
    pre_slots: Tuple[Optional[int], Optional[int]]
    post_slots: Tuple[Optional[int], Optional[int]]
    identity_slots: List[int]

    def __init__(self, dim: int, num_heads: int, options: DCMHAOptions, scale: float,
                 attn_drop: float = 0.0, device=None, dtype=None) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        o = self.options = options
        self.dim, self.num_heads, self.scale = dim, num_heads, scale
        self.slots = o.slots
        # What the forward reads of the slots, as plain fields (ints and tuples, which torch <
        # 2.5's dynamo reads where it cannot call ComposeSlots' methods): each stage's (query,
        # key) slots and the query-side slots, whose matrices carry the identity.
        self.pre_slots, self.post_slots = o.slots.stage("pre"), o.slots.stage("post")
        self.identity_slots = o.slots.query_slots
        self.dynamic_weights = DynamicWeights(
            dim, num_heads, self.slots.count, o.rank, o.dynamic_proj, o.dynamic_gate, o.dynamic_act,
            float(o.dynamic_drop), **dd) if self.slots.count else None
        self.pre_compose = Compose(num_heads, o.static_proj, o.static_init, **dd) if o.composes("pre") else None
        self.post_compose = Compose(num_heads, o.static_proj, o.static_init, **dd) if o.composes("post") else None
        self.attn_drop = nn.Dropout(attn_drop)
        # Both stages' multiply-adds per (batch element, query, key) in the paper's
        # formulation (`dcvit.matrices.compose_stage_macs`), for FLOP counters of the kernel cores.
        self.compose_macs = sum(
            compose_stage_macs(self.slots, name, num_heads, o.rank, o.dynamic_proj, stage.static is not None)
            for name, stage in (("pre", self.pre_compose), ("post", self.post_compose)) if stage is not None)
        self.attn_impl = "auto"

    def weights(self, x: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """The dynamic weights ``(w1, w2, dd)`` of `DynamicWeights` (all None without slots)."""
        if self.dynamic_weights is None:
            return None, None, None
        return self.dynamic_weights(x)

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

    def reference(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        """The paper's formulation through the `Compose` modules (hooks see every map)."""
        w1: Optional[Tensor] = None
        w2: Optional[Tensor] = None
        dd: Optional[Tensor] = None
        if self.dynamic_weights is not None:
            w1, w2, dd = self.dynamic_weights(x)
        attn = (q * self.scale) @ k.transpose(-2, -1)                            # (B, H, N, N)
        if self.pre_compose is not None:
            qw1, qw2, kw1, kw2, qdd, kdd = self._slot(w1, w2, dd, self.pre_slots[0], self.pre_slots[1])
            attn = self.pre_compose(attn, qw1, qw2, kw1, kw2, qdd, kdd)
        attn = maybe_add_mask(attn, mask)
        attn = attn.softmax(dim=-1)
        if self.post_compose is not None:
            qw1, qw2, kw1, kw2, qdd, kdd = self._slot(w1, w2, dd, self.post_slots[0], self.post_slots[1])
            attn = self.post_compose(attn, qw1, qw2, kw1, kw2, qdd, kdd)
        attn = self.attn_drop(attn)
        return attn @ v                                                          # (B, H, N, D)

    @torch.jit.unused
    def forward(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        dropout = self.training and self.attn_drop.p > 0
        impl, _ = select_impl(self.attn_impl, q, weights=dropout, mask=mask)
        if impl == "reference":
            return self.reference(q, k, v, x, mask)
        if impl == "export":
            return export_core(self, q, k, v, x, mask)
        mats = self.matrices(x, q, impl)
        if impl != "compile":
            return composed_attention(q, k, v, mask, mats, impl, self.scale, self.compose_macs)
        if dropout:          # the weights, dropped out (in the reference's memory order), then @ v
            weights = composed_attention_compile(q, k, None, mask, mats, self.scale)
            return self.attn_drop(weights.contiguous()) @ v
        return composed_attention_compile(q, k, v, mask, mats, self.scale)

    @torch.jit.unused
    def matrices(self, x: Tensor, q: Tensor, impl: str) -> ComposeMatrices:
        """Both stages' per-token Compose matrices (`dcvit.matrices`) for the core ``impl``
        (the C++ one builds them with its own kernel), in float32 (float64 for float64 q),
        outside autocast, from the dynamic weights (made under it): (B, N, G, H, H) per slot."""
        w, _, dd = self.dynamic_weights(x, raw=True) if self.dynamic_weights is not None else (None, None, None)
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        # (an exported graph records no autocast region; export runs without autocast)
        outside = contextlib.nullcontext() if impl == "export" else torch.autocast(q.device.type, enabled=False)
        with outside:
            if w is not None:
                m = slot_matrices_from_projections(w, dd, self.identity_slots, dtype, impl == "cpp")
            else:
                m = slot_matrices(None, None, dd, self.identity_slots, dtype)
            return ComposeMatrices(*self._stage(self.pre_compose, m, self.pre_slots, dtype, q.device),
                                   *self._stage(self.post_compose, m, self.post_slots, dtype, q.device))

    @torch.jit.unused
    def _stage(self, stage: Optional[Compose], m: Optional[Tensor],
               slots: Tuple[Optional[int], Optional[int]], dtype: torch.dtype,
               device: torch.device) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """One stage's ``(mq, mk)`` from every slot's matrix ``m`` and the stage's slots."""
        if stage is None:
            return None, None
        return stage_matrices(m, slots[0], slots[1], stage.static, self.num_heads, dtype, device)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options.as_dict().items())
