"""Turn the attention of a (pretrained) timm model into DCMHA, in place (docs/spec.md §1.3).

    import dcvit, timm
    model = timm.create_model("vit_small_patch16_224", pretrained=True)
    dcvit.convert(model)                      # exact: same outputs until fine-tuning moves it

Each supported attention module is replaced by a DCMHA layer that holds the *same* weight
tensors under the same names, plus the DCMHA parameters (``dynamic_weights``,
``pre_compose``, ``post_compose``). A state dict of the original model therefore loads into
the converted one with only the DCMHA tensors missing.

Supported attention modules (`SUPPORTED`):

* ``timm.layers.Attention``: every model built on it (``VisionTransformer``: ViT, DeiT,
  DeiT-III, FlexiViT, ViTs with registers, SigLIP towers, ...) -> `dcvit.DCMHA` itself, the
  layer of the ``dcvit_*`` models (a converted ViT has a DCViT's state-dict keys).
* ``timm.models.eva.EvaAttention`` (EVA, EVA-02, ViTs with rotary embeddings): q/k/v bias
  layout, rotary embeddings, sub-LN kept as they are -> `DCEvaAttention`.
* ``timm.layers.AttentionRope`` (``Eva`` models with ``attn_type='rope'``: the Perception
  Encoder ``vit_pe_*``; grouped-query attention included) -> `DCAttentionRope`.
* ``timm.models.swin_transformer.WindowAttention`` (Swin) -> `DCWindowAttention`.

The last three are modules of their own, built by composition: each takes timm's layer's
submodules and settings, runs timm's forward up to the attention core (a copy of timm's
code, held against timm at ``init="identity"`` under every flag it reads), and holds DCMHA's
core as ``core`` (`dcvit.core.DCMHACore`), as `dcvit.DCMHA` does.

Where position terms and masks sit. DCMHA composes ``scale * q k^T`` (pre-compose), then
adds the mask, softmaxes and composes the weights (post-compose) (docs/spec.md §1.3: masks
after pre-compose). Rotary embeddings rotate q and k, so they are inside the scores that
pre-compose mixes. Swin's relative position bias is added with the window mask *after*
pre-compose, as one additive mask: a head's bias stays that head's own (it is not mixed into
the other heads' scores) and the fast attention cores, which take an additive mask, run.
(They run where that mask needs no gradient: in eval, under ``torch.no_grad()``, or with a
frozen bias table; while the bias table trains, `select_impl` picks the plain-PyTorch
``compile`` core.)

``init="identity"`` makes the converted model compute exactly the original function: the
gates' weights (``dd_w``), the static matrices and the second factor of the low-rank
projections (``qkw[:, :, R:]``, which gives ``qw2``/``kw2``) are zero; the first factor and
``dw1`` keep the authors' initialisation, as LoRA keeps one factor random: the second factor
and the gates get gradients at the first step, the rest from the next (with both factors zero
neither would ever move). ``init="paper"`` keeps the authors'
initialisation of `DynamicWeights` (`DynamicWeights.init_weights`): almost MHA.

The module runs past 400 lines because each supported family's layer carries its copy of
timm's forward up to the core, next to the one conversion and state-dict fitting they share.
"""
import logging
import re
from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from timm.layers import Attention, AttentionRope
from timm.layers.attention import resolve_self_attn_mask
from timm.layers.pos_embed_sincos import apply_rot_embed_cat
from timm.models.eva import EvaAttention
from timm.models.swin_transformer import WindowAttention
from torch import Tensor, nn

from .attention import DCMHA
from .core import DCMHA_PARTS, DCMHACore, run_core
from .options import DCMHAOptions

__all__ = ["convert", "convert_layers", "resolve_layers", "SUPPORTED", "INITS", "DCEvaAttention",
           "DCAttentionRope", "DCWindowAttention", "converted_layers", "is_converted", "is_dcmha_key",
           "dcmha_parameters", "fit_state_dict", "core_keys"]

_logger = logging.getLogger(__name__)

INITS = ("identity", "paper")

# The attention types `convert` replaces, and the models that use them.
SUPPORTED: Dict[str, str] = {
    "timm.layers.Attention": "VisionTransformer: ViT, DeiT, DeiT-III, FlexiViT, ViT with registers, "
                             "SigLIP towers, ...",
    "timm.models.eva.EvaAttention": "EVA, EVA-02, ViTs with rotary embeddings (Eva)",
    "timm.layers.AttentionRope": "Eva models with attn_type='rope' (Perception Encoder vit_pe_*), "
                                 "grouped-query attention included",
    "timm.models.swin_transformer.WindowAttention": "Swin Transformer",
}

# FX records each layer's core as one call (`dcvit.core.run_core`; torch.fx.wrap patches the
# name in the globals of the module that calls it, so each such module registers it).
torch.fx.wrap("run_core")
torch.fx.wrap("resolve_self_attn_mask")   # a traced is_causal/mask reaches it as a value


def _take(layer: nn.Module, module: nn.Module, settings: Tuple[str, ...], optional: Tuple[str, ...]) -> None:
    """Give ``layer`` ``module``'s submodules, parameters and buffers (the very same tensors,
    under the same names and persistence, so the state-dict keys stay timm's), the plain
    ``settings`` its forward reads, and None for each ``optional`` part ``module`` lacks.
    The attention dropout is the core's (`DCMHACore.attn_drop`), so it is not taken."""
    persistent = set(module.state_dict(keep_vars=True))
    for name, child in module.named_children():
        if name != "attn_drop":
            layer.add_module(name, child)
    for name, param in module.named_parameters(recurse=False):
        layer.register_parameter(name, param)
    for name, buf in module.named_buffers(recurse=False):
        layer.register_buffer(name, buf, persistent=name in persistent)
    for name in settings:
        setattr(layer, name, getattr(module, name))
    for name in optional:
        if getattr(module, name, None) is None:
            setattr(layer, name, None)


def _add_core(layer: nn.Module, module: nn.Module, dim: int, options: DCMHAOptions, where: str) -> None:
    """Give ``layer`` (converted from ``module``) its ``core``, a `DCMHACore` with ``module``'s
    heads, scale, dropout rate, device and dtype, and ``options`` and ``dim`` (the input width
    the dynamic weights are generated from), as a `DCMHA` has them."""
    _check_heads(where, dim, module.num_heads)
    layer.options, layer.dim = options, dim
    layer.core = DCMHACore(dim, module.num_heads, options, module.scale, module.attn_drop.p,
                           **_device_dtype(module))


def _rotate(t: Tensor, rope: Tensor, prefix: int, half: bool, like: Tensor) -> Tensor:
    """Rotary embedding on the tokens after the ``prefix`` ones, as timm's EVA layers apply it."""
    return torch.cat([t[:, :, :prefix], apply_rot_embed_cat(t[:, :, prefix:], rope, half=half)], dim=2).type_as(like)


class DCEvaAttention(nn.Module):
    """timm's ``EvaAttention`` (rotary embeddings, q/v biases, sub-LN) with DCMHA's core.

    Built from an ``EvaAttention`` (`from_eva`): it holds that layer's parts under their
    names, ``core`` a `DCMHACore`, and its forward is timm's up to the attention core.
    """

    def __init__(self, attn: EvaAttention, options: DCMHAOptions, where: str = "EvaAttention") -> None:
        super().__init__()
        _take(self, attn, ("num_heads", "head_dim", "scale", "num_prefix_tokens"),
              ("qkv", "q_proj", "k_proj", "v_proj", "q_bias", "k_bias", "v_bias", "gate"))
        self.qkv_bias_separate = getattr(attn, "qkv_bias_separate", False)
        self.rotate_half = getattr(attn, "rotate_half", False)
        self.gate = getattr(attn, "gate", None)
        dim = attn.qkv.in_features if attn.qkv is not None else attn.q_proj.in_features
        _add_core(self, attn, dim, options, where)

    def forward(self, x: Tensor, rope: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False) -> Tensor:
        B, N, C = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        if self.qkv is not None:
            if self.q_bias is None:
                qkv = self.qkv(x)
            else:
                qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
                if self.qkv_bias_separate:
                    qkv = self.qkv(x)
                    qkv += qkv_bias
                else:
                    qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
            q, k, v = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q = self.q_proj(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)    # (B, H, N, D)
            k = self.k_proj(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
            v = self.v_proj(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q = _rotate(q, rope, self.num_prefix_tokens, self.rotate_half, v)
            k = _rotate(k, rope, self.num_prefix_tokens, self.rotate_half, v)
        mask = resolve_self_attn_mask(N, q, attn_mask, is_causal)
        out = run_core(self.core, q, k, v, x, mask)                                  # (B, H, N, D)
        out = out.transpose(1, 2).reshape(B, N, -1)
        out = self.norm(out)
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))


class DCAttentionRope(nn.Module):
    """timm's ``AttentionRope`` (rotary embeddings, grouped-query attention) with DCMHA's core:
    k and v heads are repeated to the query heads before the core, as in the original."""

    def __init__(self, attn: AttentionRope, options: DCMHAOptions, where: str = "AttentionRope") -> None:
        super().__init__()
        _take(self, attn, ("num_heads", "num_kv_heads", "num_kv_groups", "head_dim", "attn_dim", "scale",
                           "num_prefix_tokens"), ("qkv", "q_proj", "k_proj", "v_proj", "gate"))
        self.rotate_half = getattr(attn, "rotate_half", False)
        dim = attn.qkv.in_features if attn.qkv is not None else attn.q_proj.in_features
        _add_core(self, attn, dim, options, where)

    def forward(self, x: Tensor, rope: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False) -> Tensor:
        B, N, C = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        if self.qkv is not None:
            q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q = self.q_proj(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)      # (B, H, N, D)
            k = self.k_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q = _rotate(q, rope, self.num_prefix_tokens, self.rotate_half, v)
            k = _rotate(k, rope, self.num_prefix_tokens, self.rotate_half, v)
        if self.num_kv_groups > 1:
            k = k.repeat_interleave(self.num_kv_groups, dim=1)
            v = v.repeat_interleave(self.num_kv_groups, dim=1)
        mask = resolve_self_attn_mask(N, q, attn_mask, is_causal)
        out = run_core(self.core, q, k, v, x, mask)                                  # (B, H, N, D)
        out = self.norm(out.transpose(1, 2).reshape(B, N, self.attn_dim))
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))


class DCWindowAttention(nn.Module):
    """timm's Swin ``WindowAttention`` with DCMHA's core, per window.

    The relative position bias (1, H, N, N) and the shifted-window mask (nW, N, N) are added
    after pre-compose, as one additive mask.
    """

    def __init__(self, attn: WindowAttention, options: DCMHAOptions, where: str = "WindowAttention") -> None:
        super().__init__()
        _take(self, attn, ("num_heads", "window_size", "window_area", "scale"), ())
        _add_core(self, attn, attn.qkv.in_features, options, where)

    def _rel_pos_bias(self) -> Tensor:
        """(1, H, N, N): the window's relative position bias, as timm's ``_get_rel_pos_bias``."""
        n = self.window_area
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        return bias.permute(2, 0, 1).contiguous().unsqueeze(0)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        B_, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        bias = self._rel_pos_bias()                                                  # (1, H, N, N)
        if mask is not None:
            nw = mask.shape[0]
            bias = bias + mask.unsqueeze(1).to(bias.dtype)                           # (nW, H, N, N)
            bias = bias.unsqueeze(0).expand(B_ // nw, -1, -1, -1, -1).reshape(B_, self.num_heads, N, N)
        out = run_core(self.core, q, k, v, x, bias)                                   # (B_, H, N, D)
        out = out.transpose(1, 2).reshape(B_, N, -1)
        return self.proj_drop(self.proj(out))


# Each converted layer type, and how one is built from its timm original.
CONVERTED = (DCEvaAttention, DCAttentionRope, DCWindowAttention)


def _norm_layer(*norms: nn.Module) -> Optional[Callable[..., nn.Module]]:
    """A constructor like the one that built the first non-identity norm (for `DCMHA.as_mha`)."""
    for m in norms:
        if not isinstance(m, nn.Identity):
            eps = getattr(m, "eps", None)
            return type(m) if eps is None else partial(type(m), eps=eps)
    return None


def _device_dtype(module: nn.Module) -> Dict[str, Any]:
    p = next(module.parameters())
    return {"device": p.device, "dtype": p.dtype}


def _from_attention(attn: Attention, options: DCMHAOptions, where: str) -> DCMHA:
    dim = attn.qkv.in_features
    variants = []
    if getattr(attn, "gate", None) is not None:
        variants.append("gated=True")
    if attn.num_heads * attn.head_dim != dim:
        variants.append(f"attn_head_dim={attn.head_dim} (heads x head_dim != dim={dim})")
    if attn.proj.out_features != dim:
        variants.append(f"dim_out={attn.proj.out_features}")
    if variants:
        raise ValueError(f"convert: {where} is a timm Attention with {', '.join(variants)}, which DCMHA "
                         "does not implement; convert only the other layers with layers=[...]")
    _check_heads(where, dim, attn.num_heads)
    layer = DCMHA(dim, attn.num_heads, qkv_bias=attn.qkv.bias is not None,
                  qk_norm=not isinstance(attn.q_norm, nn.Identity), scale_norm=not isinstance(attn.norm, nn.Identity),
                  proj_bias=attn.proj.bias is not None, attn_drop=attn.attn_drop.p, proj_drop=attn.proj_drop.p,
                  norm_layer=_norm_layer(attn.q_norm, attn.norm), options=options, **_device_dtype(attn))
    taken = ["qkv", "norm", "proj", "proj_drop"]
    if options.qk_norm_bias or getattr(attn.q_norm, "bias", None) is None:
        taken += ["q_norm", "k_norm"]
    else:                          # scale-only q/k norms asked for: DCMHA's own, with the scales
        for name in ("q_norm", "k_norm"):
            norm = getattr(attn, name)
            if norm.bias.device.type != "meta" and bool(norm.bias.any()):
                raise ValueError(f"convert: {where} has a trained {name} bias, which qk_norm_bias=False "
                                 "would drop; convert with qk_norm_bias=True")
            getattr(layer, name).weight = norm.weight
    for name in taken:
        setattr(layer, name, getattr(attn, name))                # the very same modules and weights
    return layer


def _check_heads(where: str, dim: int, num_heads: int) -> None:
    if dim % num_heads:
        raise ValueError(f"convert: {where} has {num_heads} heads over {dim} input channels; "
                         f"DCMHA needs the head count to divide the input width")


# Exact types only: a subclass may compute attention differently.
_CONVERTERS: Dict[type, Callable[[Any, DCMHAOptions, str], nn.Module]] = {
    Attention: _from_attention,
    EvaAttention: DCEvaAttention,
    AttentionRope: DCAttentionRope,
    WindowAttention: DCWindowAttention,
}


def converted_layers(model: nn.Module) -> List[str]:
    """Names of the DCMHA layers (dcvit's own or converted) in ``model``."""
    return [name for name, m in model.named_modules() if isinstance(m, (DCMHA, *CONVERTED))]


def is_converted(model: nn.Module) -> bool:
    return bool(converted_layers(model))


def _supported_text() -> str:
    return "; ".join(f"{k} ({v})" for k, v in SUPPORTED.items())


def _attention_like(model: nn.Module) -> List[Tuple[str, str]]:
    """(name, type) of modules whose class names say attention, other than supported ones."""
    return [(name, type(m).__module__ + "." + type(m).__qualname__) for name, m in model.named_modules()
            if type(m) not in _CONVERTERS and any(w in type(m).__name__ for w in ("Attention", "Attn"))]


def resolve_layers(layers: Optional[Iterable[int]], count: int, where: str = "convert",
                   name: str = "layers") -> List[int]:
    """The sorted indices ``layers`` (None: all; negative ones count from the end) names among
    ``count`` attention layers; a bad entry raises naming ``where`` and the argument ``name``."""
    if layers is None:
        return list(range(count))
    if isinstance(layers, (int, str)):
        raise TypeError(f"{where}: {name}={layers!r} must be a list of attention-layer indices, e.g. "
                        f"{name}=[{layers}] (or None for every layer)")
    out = set()
    for i in layers:
        if not isinstance(i, int) or isinstance(i, bool) or not -count <= i < count:
            raise ValueError(f"{where}: {name} entry {i!r} is not an attention-layer index in [0, {count}) "
                             f"(the model has {count}; negative indices count from the end)")
        out.add(i % count)
    return sorted(out)


@torch.no_grad()
def _identity_init(layer: nn.Module) -> None:
    core = layer.core
    dw = core.dynamic_weights
    if dw is not None:
        if dw.qkw is not None:
            dw.qkw[:, :, dw.rank:].zero_()                       # second low-rank factor: qw2, kw2
        if dw.dd_w is not None:
            dw.dd_w.zero_()                                      # gates
    for stage in (core.pre_compose, core.post_compose):
        if stage is not None and stage.static is not None:
            stage.static.zero_()


def convert(model: nn.Module, layers: Optional[Iterable[int]] = None, init: str = "identity",
            options: Optional[DCMHAOptions] = None, **dcmha_options: Any) -> nn.Module:
    """Replace the attention layers of ``model`` with DCMHA layers holding the same weights.

    Args:
        model: a timm model whose attention layers are of a `SUPPORTED` type.
        layers: indices of the attention layers to convert, in the order the model runs them
            (a ViT's or EVA's block index; Swin counts blocks across its stages); default all.
        init: ``"identity"`` (the converted model computes the original function exactly) or
            ``"paper"`` (the authors' initialisation of the dynamic weights).
        options, **dcmha_options: the DCMHA options of docs/spec.md §1.3, as a
            `DCMHAOptions` and/or by name (``rank``, ``query_wise``, ...).

    Returns ``model`` (changed in place; the replaced modules are left as they were). The
    layers keep ``model``'s device, dtype and train/eval mode.
    """
    options = DCMHAOptions.of("convert", options, **dcmha_options)
    if init not in INITS:
        raise ValueError(f"convert: init={init!r} is not one of {INITS}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: expected a torch.nn.Module (a timm model), got {type(model).__name__}")
    selected, found = convert_layers(model, layers, init, options)
    skipped = [f"{n} ({t})" for n, t in _attention_like(model) if not isinstance(model.get_submodule(n), CONVERTED)]
    if skipped:
        _logger.warning("convert: left %d module(s) of other attention types as they are: %s",
                        len(skipped), ", ".join(skipped))
    _logger.info("convert: %d of %d attention layers of %s now use DCMHA (init=%s, options=%s)",
                 len(selected), found, type(model).__name__, init, options)
    return model


def convert_layers(model: nn.Module, layers: Optional[Iterable[int]], init: str, options: DCMHAOptions,
                   where: str = "convert", name: str = "layers") -> Tuple[List[int], int]:
    """`convert`'s work, without its argument checks and log messages (the ``dcvit_*`` models
    call it while they are built): the indices converted and the number of attention layers."""
    done = converted_layers(model)
    if done:
        raise ValueError(f"{where}: {type(model).__name__} already has {len(done)} DCMHA layer(s) "
                         f"(e.g. {done[0]!r}); it was converted before or is a dcvit model. "
                         "Convert the original model once, with every option at once")
    found = [(n, m) for n, m in model.named_modules() if type(m) in _CONVERTERS]
    if not found:
        others = sorted({t for _, t in _attention_like(model)})
        what = f"its attention modules are of unsupported type(s) {others}" if others else \
            "it has no attention module of a supported type"
        raise ValueError(f"{where}: nothing to convert in {type(model).__name__}: {what}. "
                         f"Supported: {_supported_text()}")
    selected = resolve_layers(layers, len(found), where, name)
    for i in selected:
        module_name, module = found[i]
        layer = _CONVERTERS[type(module)](module, options, f"attention layer {i} ({module_name!r})")
        layer.train(module.training)
        if init == "identity":
            _identity_init(layer)
        parent_name, _, attr = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
    return selected, len(found)


def is_dcmha_key(key: str) -> bool:
    """Whether a state-dict key names a DCMHA tensor (of ``dynamic_weights``/``*_compose``)."""
    return any(f".{part}." in f".{key}" for part in DCMHA_PARTS)


def dcmha_parameters(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs that DCMHA adds to ``model`` (what a conversion adds)."""
    return [(name, p) for name, p in model.named_parameters() if is_dcmha_key(name)]


_PART_KEY = re.compile(r"(^|\.)(" + "|".join(DCMHA_PARTS) + r")\.")


def core_keys(state_dict: Dict[str, Tensor], own: Iterable[str]) -> Dict[str, Tensor]:
    """``state_dict`` with DCMHA tensors saved on the layer itself (``blocks.0.attn.dynamic_weights.dw1``,
    the layout of checkpoints written before the layers held a `DCMHACore`) renamed to the
    layer's core (``blocks.0.attn.core.dynamic_weights.dw1``) where ``own`` (the model's
    keys) has that name and not the old one; other keys as they are, in their order."""
    own = set(own)
    out = {}
    for key, value in state_dict.items():
        new = _PART_KEY.sub(r"\1core.\2.", key, count=1)
        out[new if key not in own and new in own else key] = value
    return out


def fit_state_dict(model: nn.Module, state_dict: Dict[str, Tensor], source: str = "checkpoint") -> Dict[str, Tensor]:
    """``state_dict`` made to load strictly into ``model`` across a conversion.

    A state dict of the unconverted model into a converted one: the DCMHA tensors it lacks
    keep ``model``'s own values (their initialisation) and a warning names them. A state dict
    of a converted model into one that is not converted: ``ValueError`` saying to convert
    the model first. Anything else is returned unchanged (``load_state_dict`` judges it).
    """
    own = model.state_dict()
    state_dict = core_keys(state_dict, own)
    extra = [k for k in state_dict if is_dcmha_key(k) and k not in own]
    if extra and not is_converted(model):
        raise ValueError(f"{source} holds {len(extra)} DCMHA tensors (e.g. {extra[0]!r}): it comes from a model "
                         f"converted to DCMHA, but {type(model).__name__} is not converted; convert it first "
                         f"(dcvit.convert(model, ...) with the options it was converted with)")
    missing = [k for k in own if is_dcmha_key(k) and k not in state_dict]
    if missing and not any(is_dcmha_key(k) for k in state_dict):
        _logger.warning("%s is of a model without DCMHA (a plain ViT, the model before conversion): "
                        "%d DCMHA tensors keep their initialisation: %s",
                        source, len(missing), ", ".join(missing))
        state_dict = {**state_dict, **{k: own[k] for k in missing}}
    return state_dict
