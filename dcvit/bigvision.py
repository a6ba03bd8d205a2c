"""The authors' vision models: big_vision's plain ViT body, with and without DC attention.

The paper's ImageNet numbers (docs/spec.md §4, §4.1) were measured on the authors' fork of
big_vision ("Better plain ViT baselines" body), not on timm's ViT. `BigVisionViT` is timm's
``VisionTransformer`` configured as that body:

* no class token; fixed 2-D sin-cos position embedding (`posemb_sincos_2d`, a buffer);
* final LayerNorm on every token, then global average pooling (``global_pool="avg"``,
  ``fc_norm=False``);
* ``pre_logits``: Linear(width, width) + tanh before the head (big_vision's ``rep_size``);
* tanh-approximate GELU in the MLP; big_vision's initialisation (`init_weights`): zero head,
  xavier-uniform kernels with flax's fans, lecun-normal patch embedding and pre-logits.

``import dcvit`` registers ``vit_{tiny,small,medium,base}_patch16_bv_224`` (timm attention
with a fused qkv with bias: the same function as the authors' separate q/k/v projections)
and ``dcvit_{tiny,small,medium,base}_patch16_bv_224`` (DCMHA configured as the authors ran
it, `BV_DCMHA_OPTIONS`). Every DCMHA option remains a ``timm.create_model`` keyword.
``pretrained=True, pretrained_cfg_overlay=dict(file="params.npz")`` loads a big_vision
checkpoint through `dcvit.bigvision_npz`.
"""
import functools
import math
from typing import Any, Dict, List, Union

import torch
from timm.layers import lecun_normal_
from timm.models import generate_default_cfgs
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from .models import SIZES, create_vit_family, register_entry_point

__all__ = ["BigVisionViT", "posemb_sincos_2d", "BV_DCMHA_OPTIONS"]

# DCMHA as in the authors' MultiHeadDotProductAttention(dynamic_compose=True): a static
# H×H matrix in both Compose stages initialised N(0, 0.1·sqrt(1/H)), tanh-GELU in the dynamic
# hidden layer, scale-only LayerNorm (eps 1e-6) on q and k per head, q/k/v with bias.
# `dynamic_drop` is their `dynamic_dropout_rate` (0.0 in vit_*_i1k_dc.py, 0.2 in *_D0p2.py).
BV_DCMHA_OPTIONS: Dict[str, Any] = dict(
    static_proj=True,
    static_init="normal",
    dynamic_act="gelu_tanh",
    dynamic_drop=0.0,
    qk_norm=True,
    qk_norm_bias=False,
)

def posemb_sincos_2d(h: int, w: int, width: int, temperature: float = 10_000.,
                     dtype: torch.dtype = torch.float32) -> Tensor:
    """big_vision's fixed position embedding (1, h·w, width), computed in float64.

    For the token at row y, column x and ω_i = temperature^(-i / (width/4 - 1)),
    i < width/4: ``[sin(x·ω), cos(x·ω), sin(y·ω), cos(y·ω)]``. (timm's
    ``build_sincos2d_pos_embed`` divides by width/4 and orders the terms differently.)
    """
    if width % 4 != 0 or width < 8:
        raise ValueError(f"posemb_sincos_2d: width={width} must be a multiple of 4 and >= 8")
    quarter = width // 4
    omega = 1.0 / temperature ** (torch.arange(quarter, dtype=torch.float64) / (quarter - 1))
    y, x = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64),
                          indexing="ij")
    y = y.flatten()[:, None] * omega[None]
    x = x.flatten()[:, None] * omega[None]
    pe = torch.cat([torch.sin(x), torch.cos(x), torch.sin(y), torch.cos(y)], dim=1)
    return pe.to(dtype)[None]


def _xavier_uniform_flax_(weight: Tensor, fan_in: int, fan_out: int) -> None:
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    nn.init.uniform_(weight, -bound, bound)


class BigVisionViT(VisionTransformer):
    """timm's ``VisionTransformer`` as big_vision's plain ViT (module docstring).

    Takes ``VisionTransformer``'s keyword arguments; those that define the big_vision body
    are fixed (``class_token=False``, ``global_pool="avg"``, ``fc_norm=False``,
    ``pos_embed="none"`` replaced by the sin-cos buffer). ``rep_size``: with the
    Linear+tanh ``pre_logits`` layer (True, as in the paper's configs) or without.
    """

    def __init__(self, rep_size: bool = True, **kwargs: Any) -> None:
        fixed = dict(class_token=False, fc_norm=False, pos_embed="none", no_embed_class=True,
                     reg_tokens=0, weight_init="skip")
        for key, value in fixed.items():
            if key in kwargs and kwargs[key] != value:
                raise ValueError(f"{type(self).__name__}: {key}={kwargs[key]!r} is not the big_vision "
                                 f"body (it has {key}={value!r}); use timm's vit_* models instead")
        kwargs = {**dict(act_layer="gelu_tanh", qkv_bias=True, global_pool="avg"), **kwargs, **fixed}
        super().__init__(**kwargs)
        del self.pos_embed                                   # None; becomes the fixed buffer
        h, w = self.patch_embed.grid_size
        ref = self.patch_embed.proj.weight                  # the device and dtype the model is built with
        self.register_buffer("pos_embed", posemb_sincos_2d(h, w, self.embed_dim, dtype=ref.dtype).to(ref.device),
                             persistent=False)
        self.rep_size = bool(rep_size)
        if self.rep_size:
            self.pre_logits = nn.Sequential()
            self.pre_logits.add_module("fc", nn.Linear(self.embed_dim, self.embed_dim, device=ref.device,
                                                       dtype=ref.dtype))
            self.pre_logits.add_module("act", nn.Tanh())
        else:
            self.pre_logits = nn.Identity()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, mode: str = "", needs_reset: bool = True) -> None:
        """big_vision's initialisation (flax defaults where big_vision sets none).

        Patch embedding and ``pre_logits``: lecun-normal kernel, zero bias. Attention
        q/k/v: xavier-uniform with flax's fans for a (C, H, D) kernel (fan_in = C·H,
        fan_out = C·D), zero bias; output projection xavier-uniform, zero bias. MLP:
        xavier-uniform, bias N(0, 1e-6). Head: zeros. LayerNorms: ones/zeros. DCMHA's own
        parameters keep DCMHA's initialisation (docs/spec.md §1.2).
        """
        from .attention import DCMHA  # the attention stack loads with the first model built
        if mode not in ("", "jax", "reset"):
            raise ValueError(f"{type(self).__name__}.init_weights: only big_vision's initialisation "
                             f"is defined, got mode={mode!r}")
        lecun_normal_(self.patch_embed.proj.weight)
        nn.init.zeros_(self.patch_embed.proj.bias)
        for block in self.blocks:
            attn = block.attn
            c, h = attn.qkv.in_features, attn.num_heads
            for i in range(3):
                _xavier_uniform_flax_(attn.qkv.weight[i * c:(i + 1) * c], c * h, c * (c // h))
            if attn.qkv.bias is not None:
                nn.init.zeros_(attn.qkv.bias)
            nn.init.xavier_uniform_(attn.proj.weight)
            if attn.proj.bias is not None:
                nn.init.zeros_(attn.proj.bias)
            for norm in (attn.q_norm, attn.k_norm, block.norm1, block.norm2):
                if isinstance(norm, nn.LayerNorm):
                    norm.reset_parameters()
            for fc in (block.mlp.fc1, block.mlp.fc2):
                nn.init.xavier_uniform_(fc.weight)
                if fc.bias is not None:
                    nn.init.normal_(fc.bias, std=1e-6)
            if isinstance(attn, DCMHA):
                for part in (attn.core.dynamic_weights, attn.core.pre_compose, attn.core.post_compose):
                    if part is not None:
                        part.init_weights()
        if isinstance(self.norm, nn.LayerNorm):
            self.norm.reset_parameters()
        if isinstance(self.pre_logits, nn.Sequential):
            lecun_normal_(self.pre_logits.fc.weight)
            nn.init.zeros_(self.pre_logits.fc.bias)
        if isinstance(self.head, nn.Linear):
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """As big_vision's ``wd_mults`` (kernels only): also no decay on ``qkw`` and the static
        matrices. (``pos_embed`` is a fixed buffer here, not a parameter.)"""
        return (set(super().no_weight_decay()) - {"pos_embed"}) | {"*.dynamic_weights.qkw", "*.static"}

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        """As ``VisionTransformer``'s; ``prune_head`` also removes ``pre_logits`` (part of the head)."""
        take_indices = super().prune_intermediate_layers(indices, prune_norm=prune_norm, prune_head=prune_head)
        if prune_head:
            self.pre_logits = nn.Identity()
        return take_indices

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Average pool, ``pre_logits`` (Linear+tanh), head; ``pre_logits=True`` stops before the head."""
        x = self.pool(x)
        x = self.fc_norm(x)
        x = self.pre_logits(x)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    @torch.jit.ignore
    def load_pretrained(self, checkpoint_path: str, prefix: str = "") -> None:
        """Load a big_vision ``.npz`` checkpoint (`dcvit.bigvision_npz.load_bigvision_npz`)."""
        from .bigvision_npz import load_bigvision_npz
        load_bigvision_npz(self, checkpoint_path)


def _cfg(**kwargs: Any) -> Dict[str, Any]:
    # big_vision's evaluation: resize 256, centre crop 224, inputs in [-1, 1].
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None,
        "crop_pct": 0.875, "interpolation": "bilinear", "fixed_input_size": True,
        "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5),
        "first_conv": "patch_embed.proj", "classifier": "head", "license": "apache-2.0",
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    f"{family}_{size}_patch16_bv_224": _cfg()
    for family in ("vit", "dcvit") for size in SIZES
})


def _create(variant: str, dc: bool, size: str, pretrained: bool = False, **kwargs: Any) -> BigVisionViT:
    overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})
    if str(overlay.get("file", "")).endswith(".npz"):
        overlay.setdefault("custom_load", True)          # -> BigVisionViT.load_pretrained
    options = dict(BV_DCMHA_OPTIONS) if dc else {}
    return create_vit_family(variant, pretrained, model_cls=BigVisionViT, dc=dc,
                             pretrained_cfg_overlay=overlay or None,
                             **{**SIZES[size][0], **options, **kwargs})


def _register_sizes() -> None:
    """``vit_<size>_patch16_bv_224`` and ``dcvit_<size>_patch16_bv_224`` for every row of
    `dcvit.models.SIZES` (big_vision's ``decode_variant`` sizes; the paper's DCViT-S/16 is
    ``dcvit_small_patch16_bv_224``)."""
    for size, (_, paper) in SIZES.items():
        for family, dc, doc in (("vit", False, f"big_vision ViT-{paper} (the authors' baseline body)."),
                                ("dcvit", True, f"big_vision ViT-{paper} with the authors' DC attention "
                                                "(docs/models.md).")):
            name = f"{family}_{size}_patch16_bv_224"
            register_entry_point(__name__, name, doc, functools.partial(_create, name, dc, size))


_register_sizes()
