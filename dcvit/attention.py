"""DCMHA: multi-head self-attention whose heads are composed per token (docs/spec.md §1.2-1.3).

`DCMHA` is a drop-in ``attn_layer`` for timm's ``VisionTransformer``: timm's
``Attention`` layout (same constructor arguments and ``forward`` signature, the same
``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``proj``) with DCMHA's attention core,
`dcvit.core.DCMHACore`, as ``core`` in the middle, where timm calls SDPA::

    q, k, v = qkv(x) -> heads, q_norm(q), k_norm(k)
    out = core(q, k, v, x, mask)             # (B, H, N, D): dynamic weights, Compose, softmax
    out = proj(norm(merge heads(out)))
"""
import copy
from typing import Any, Optional, Type

import torch
from timm.layers import Attention, register_notrace_module
from timm.layers.attention import resolve_self_attn_mask
from torch import Tensor, nn

from .core import DCMHA_PARTS, Compose, DCMHACore, DynamicWeights, hidden_width, run_core
from .options import DCMHA_OPTIONS, DYNAMIC_ACTS, STATIC_INITS, DCMHAOptions

__all__ = ["DCMHA", "DCMHAOptions", "DCMHACore", "DynamicWeights", "Compose", "DCMHA_OPTIONS",
           "DCMHA_PARTS", "hidden_width", "check_heads"]


torch.fx.wrap("run_core")   # FX records the core as one call here too (see dcvit.core.run_core)
torch.fx.wrap("resolve_self_attn_mask")   # a traced is_causal/mask reaches it as a value


@torch.fx.wrap
def _check_input(x: Tensor, dim: int) -> None:
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError("DCMHA expects input of shape (B, N, " + str(dim) + "), got "
                         + str(list(x.shape)))


def check_heads(dim: int, num_heads: int) -> None:
    """DCMHA's heads split the width evenly (a ``ValueError`` listing valid counts otherwise)."""
    if num_heads < 1 or dim % num_heads != 0:
        raise ValueError(f"DCMHA: num_heads={num_heads} must divide dim={dim} "
                         f"(valid head counts: {[h for h in range(1, dim + 1) if dim % h == 0][:12]}...)")


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
        self.norm = norm_layer(dim, **dd) if scale_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.core = DCMHACore(dim, num_heads, self.options, self.scale, attn_drop, **dd)

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        _check_input(x, self.dim)
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)                                                  # (B, H, N, D)
        q, k = self.q_norm(q), self.k_norm(k)
        mask = resolve_self_attn_mask(N, q, attn_mask, is_causal)               # additive or None
        if torch.jit.is_scripting():
            x = self.core.reference(q, k, v, x, mask)                           # (B, H, N, D)
        else:
            x = run_core(self.core, q, k, v, x, mask)                            # (B, H, N, D)
        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.norm(x)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x

    @torch.jit.unused
    def as_mha(self) -> Attention:
        """The ``timm.layers.Attention`` with this layer's configuration and qkv/proj weights."""
        ref = next(self.qkv.parameters())
        mha = Attention(**self._mha_args, device=ref.device, dtype=ref.dtype)
        if not self.options.qk_norm_bias:                    # the same (bias-free) q/k norms
            mha.q_norm, mha.k_norm = copy.deepcopy(self.q_norm), copy.deepcopy(self.k_norm)
        missing, unexpected = mha.load_state_dict(
            {k: t for k, t in self.state_dict().items() if not k.startswith("core.")}, strict=False)
        assert not missing, missing
        return mha



# timm's FX tracer (feature extraction, ``features_only=True, feature_cls="fx"``) keeps the
# layer as one node, so that a traced model can also be scripted (the scripted layer runs
# the reference core); torch.fx.symbolic_trace records `run_core` as one call instead.
register_notrace_module(DCMHA)
