"""DCMHA against an independent float64 re-derivation of docs/spec.md §1.2–1.3, and the §1.4 identities."""
import math

import pytest
import torch
import torch.nn.functional as F
from timm.layers import Attention

import dcvit
from dcvit import DCMHA

C, H, N, B = 24, 4, 7, 2
D = C // H


def randomize_dynamic(layer: DCMHA, std: float = 0.3, seed: int = 0) -> DCMHA:
    """Give the DCMHA parameters values large enough that composition matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "dynamic_weights" in name or "compose" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return layer


def mixing_matrix(x, params, options, stage, num_heads):
    """Per-(t, s) H×H matrix I + Mq[t] + Mk[s] (+ W) of one stage, from first principles."""
    B_, N_, C_ = x.shape
    R, K = options["rank"], 4 * num_heads
    dynamic = options["dynamic_proj"] or options["dynamic_gate"]
    slots = [f"{st}_{sd}" for st in ("pre", "post") if options[f"{st}_compose"]
             for sd, on in (("q", options["query_wise"]), ("k", options["key_wise"])) if on and dynamic]
    eye = torch.eye(num_heads, dtype=x.dtype)
    mix = eye.expand(B_, N_, N_, num_heads, num_heads).clone()           # (B, T, S, G, H)
    prefix = f"core.{stage}_compose.static"
    if prefix in params:
        mix = mix + params[prefix]
    for slot_index, slot in enumerate(slots):
        st, side = slot.split("_")
        if st != stage:
            continue
        m = torch.zeros(B_, N_, num_heads, num_heads, dtype=x.dtype)    # (B, token, G, H)
        if options["dynamic_proj"]:
            dw1 = params["core.dynamic_weights.dw1"][:, slot_index]             # (C, K)
            qkw = params["core.dynamic_weights.qkw"][slot_index]                # (K, 2R, H)
            hidden = F.gelu(x @ dw1)                                       # (B, N, K)
            w = torch.einsum("bnk,kih->bnih", hidden, qkw)                 # (B, N, 2R, H)
            w1, w2 = w[:, :, :R], w[:, :, R:]
            w1 = w1 / torch.sqrt((w1 ** 2).mean(-1, keepdim=True) + 1e-6)
            m = m + torch.einsum("bnrg,bnrh->bngh", w1, w2)
        if options["dynamic_gate"]:
            dd_w = params["core.dynamic_weights.dd_w"].view(C_, len(slots), num_heads)[:, slot_index]
            m = m + torch.diag_embed(torch.tanh(x @ dd_w))
        mix = mix + (m[:, :, None] if side == "q" else m[:, None, :])
    return mix


def reference_forward(layer: DCMHA, x, attn_mask=None):
    """The whole DCMHA forward in float64, written without dcvit code."""
    x = x.double()
    p = {k: v.double() for k, v in layer.state_dict().items()}
    opts = layer.options.as_dict()
    B_, N_, C_ = x.shape
    h, d = layer.num_heads, C_ // layer.num_heads
    qkv = x @ p["qkv.weight"].T + p.get("qkv.bias", 0)
    q, k, v = qkv.view(B_, N_, 3, h, d).unbind(2)                          # (B, N, H, D)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d)
    if opts["pre_compose"]:
        scores = torch.einsum("bgts,btsgh->bhts", scores, mixing_matrix(x, p, opts, "pre", h))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask.double()
    probs = scores.softmax(-1)
    if opts["post_compose"]:
        probs = torch.einsum("bgts,btsgh->bhts", probs, mixing_matrix(x, p, opts, "post", h))
    out = torch.einsum("bhts,bshd->bthd", probs, v).reshape(B_, N_, C_)
    return out @ p["proj.weight"].T + p["proj.bias"]


OPTION_CASES = {
    "default": {},
    "rank1": dict(rank=1),
    "rank4": dict(rank=4),
    "query_only": dict(key_wise=False),
    "key_only": dict(query_wise=False),
    "pre_only": dict(post_compose=False),
    "post_only": dict(pre_compose=False),
    "proj_only": dict(dynamic_gate=False),
    "gate_only": dict(dynamic_proj=False),
    "static_and_dynamic": dict(static_proj=True),
    "talking_heads": dict(static_proj=True, dynamic_proj=False, dynamic_gate=False),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_forward_matches_independent_reference(case):
    torch.manual_seed(0)
    layer = randomize_dynamic(DCMHA(C, num_heads=H, qkv_bias=True, **OPTION_CASES[case]).double()).eval()
    x = torch.randn(B, N, C, dtype=torch.float64)
    out = layer(x)
    torch.testing.assert_close(out, reference_forward(layer, x), atol=1e-10, rtol=0)
    # The composition matters: the output is not that of plain multi-head attention.
    assert (out - layer.as_mha().double()(x)).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["default", "key_only", "post_only"])
def test_gradients_match_independent_reference(case):
    torch.manual_seed(1)
    layer = randomize_dynamic(DCMHA(C, num_heads=H, qkv_bias=True, **OPTION_CASES[case]).double())
    x = torch.randn(B, N, C, dtype=torch.float64, requires_grad=True)
    grads = torch.autograd.grad(layer(x).square().sum(), [x, *layer.parameters()])
    params = dict(layer.named_parameters())

    def ref_loss():
        # reference_forward reads the state dict; route gradients through the parameters.
        orig = layer.state_dict
        layer.state_dict = lambda: params  # noqa: E731
        try:
            return reference_forward(layer, x).square().sum()
        finally:
            layer.state_dict = orig
    ref_grads = torch.autograd.grad(ref_loss(), [x, *layer.parameters()])
    for (name, _), g, r in zip([("x", None), *layer.named_parameters()], grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-9, rtol=1e-7, msg=f"gradient of {name}")


@pytest.mark.parametrize("qkv_bias,qk_norm", [(True, False), (False, True)])
def test_zero_dynamic_weights_is_timm_attention(qkv_bias, qk_norm):
    """docs/spec.md §1.4 (1): with qkw = 0 and dd_w = 0, DCMHA is multi-head attention."""
    torch.manual_seed(0)
    kw = dict(num_heads=H, qkv_bias=qkv_bias, qk_norm=qk_norm, norm_layer=torch.nn.LayerNorm)
    layer = DCMHA(C, **kw).eval()
    with torch.no_grad():
        layer.core.dynamic_weights.qkw.zero_()
        layer.core.dynamic_weights.dd_w.zero_()
    mha = Attention(C, **kw).eval()
    missing, unexpected = mha.load_state_dict(layer.state_dict(), strict=False)
    assert not missing and all(k.startswith(("core.dynamic_weights.",)) for k in unexpected)
    x = torch.randn(B, N, C)
    torch.testing.assert_close(layer(x), mha(x), atol=1e-5, rtol=1e-5)


def test_default_init_is_close_to_mha_but_not_equal():
    torch.manual_seed(0)
    layer = DCMHA(C, num_heads=H, qkv_bias=True).eval()
    x = torch.randn(B, N, C)
    diff = (layer(x) - layer.as_mha()(x)).abs().max()
    assert 0 < diff < 1e-2


def explicit_mha(x, wq, bq, wk, bk, wv, bv, wo, bo, scale):
    """Multi-head attention from explicit per-head projections (lists over heads)."""
    out = bo.expand(x.shape[0], x.shape[1], -1).clone()
    for h in range(len(wq)):
        q, k, v = x @ wq[h].T + bq[h], x @ wk[h].T + bk[h], x @ wv[h].T + bv[h]
        p = (q @ k.transpose(-1, -2) * scale).softmax(-1)
        out = out + (p @ v) @ wo[h].T
    return out


def _heads(layer):
    p = {k: v.double() for k, v in layer.state_dict().items()}
    w, b = p["qkv.weight"].view(3, H, D, C), p["qkv.bias"].view(3, H, D)
    wo = p["proj.weight"].view(C, H, D).permute(1, 0, 2)                  # (H, C, D)
    return w, b, wo, p["proj.bias"]


def test_theorem_2_1_pre_compose_is_expanded_qk():
    """Pre-composing scores with a static W == attention with H-fold expanded QK projections."""
    torch.manual_seed(0)
    layer = DCMHA(C, num_heads=H, qkv_bias=True, static_proj=True, dynamic_proj=False,
                  dynamic_gate=False, post_compose=False).double().eval()
    with torch.no_grad():
        layer.core.pre_compose.static.copy_(torch.randn(H, H) * 0.7)
    mix = torch.eye(H, dtype=torch.float64) + layer.core.pre_compose.static.detach()  # W'[g, h]
    w, b, wo, bo = _heads(layer)
    # Head h queries with [W'[0,h] q_0, ..., W'[H-1,h] q_{H-1}] and keys with [k_0, ..., k_{H-1}].
    wq = [torch.cat([mix[g, h] * w[0, g] for g in range(H)]) for h in range(H)]      # (H·D, C)
    bq = [torch.cat([mix[g, h] * b[0, g] for g in range(H)]) for h in range(H)]
    wk, bk = [w[1].reshape(H * D, C)] * H, [b[1].reshape(H * D)] * H
    x = torch.randn(B, N, C, dtype=torch.float64)
    expanded = explicit_mha(x, wq, bq, wk, bk, list(w[2]), list(b[2]), list(wo), bo, D ** -0.5)
    torch.testing.assert_close(layer(x), expanded, atol=1e-10, rtol=0)


def test_theorem_2_2_post_compose_is_expanded_vo():
    """Post-composing weights with a static W == attention with H-fold expanded VO projections."""
    torch.manual_seed(0)
    layer = DCMHA(C, num_heads=H, qkv_bias=True, static_proj=True, dynamic_proj=False,
                  dynamic_gate=False, pre_compose=False).double().eval()
    with torch.no_grad():
        layer.core.post_compose.static.copy_(torch.randn(H, H) * 0.7)
    mix = torch.eye(H, dtype=torch.float64) + layer.core.post_compose.static.detach()
    w, b, wo, bo = _heads(layer)
    # Head g keeps its q, k; its value is [W'[g,0] v_0, ..., W'[g,H-1] v_{H-1}] and its output
    # projection is the whole [O_0, ..., O_{H-1}].
    wv = [torch.cat([mix[g, h] * w[2, h] for h in range(H)]) for g in range(H)]      # (H·D, C)
    bv = [torch.cat([mix[g, h] * b[2, h] for h in range(H)]) for g in range(H)]
    wo_full = [torch.cat(list(wo), dim=1)] * H                                         # (C, H·D)
    x = torch.randn(B, N, C, dtype=torch.float64)
    expanded = explicit_mha(x, list(w[0]), list(b[0]), list(w[1]), list(b[1]), wv, bv, wo_full, bo,
                            D ** -0.5)
    torch.testing.assert_close(layer(x), expanded, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_applies_after_pre_compose(kind):
    torch.manual_seed(0)
    layer = randomize_dynamic(DCMHA(C, num_heads=H, qkv_bias=True).double()).eval()
    x = torch.randn(B, N, C, dtype=torch.float64)
    keep = torch.rand(B, 1, N, N) > 0.3
    keep[..., 0] = True                                                   # every row keeps a key
    mask = keep if kind == "bool" else torch.where(keep, 0.0, -1e4).double() * torch.rand(B, 1, N, N)
    torch.testing.assert_close(layer(x, attn_mask=mask), reference_forward(layer, x, mask), atol=1e-9, rtol=0)


def test_is_causal_equals_lower_triangular_mask():
    torch.manual_seed(0)
    layer = randomize_dynamic(DCMHA(C, num_heads=H).double()).eval()
    x = torch.randn(B, N, C, dtype=torch.float64)
    tril = torch.ones(N, N, dtype=torch.bool).tril()
    torch.testing.assert_close(layer(x, is_causal=True), layer(x, attn_mask=tril), atol=1e-12, rtol=0)


def test_initialisation_follows_spec():
    c, h, r = 384, 6, 2
    k = 4 * h
    layer = DCMHA(c, num_heads=h, rank=r)
    dw = layer.core.dynamic_weights
    assert dw.dw1.shape == (c, 4, k) and dw.qkw.shape == (4, k, 2 * r, h) and dw.dd_w.shape == (c, 4 * h)
    assert dw.dw1.std().item() == pytest.approx(math.sqrt(2 / (c + k)), rel=0.05)
    assert dw.qkw.std().item() == pytest.approx(math.sqrt(1 / k) * 2 / (h + r) * 0.01, rel=0.1)
    assert dw.dd_w.std().item() == pytest.approx(math.sqrt(2 / (c + h)) * 0.005, rel=0.05)
    assert sum(p.numel() for p in dw.parameters()) == c * 4 * k + 4 * k * 2 * r * h + c * 4 * h == 48384


@pytest.mark.parametrize("options,slots,has_proj,has_gate", [
    ({}, 4, True, True),
    (dict(query_wise=False), 2, True, True),
    (dict(pre_compose=False), 2, True, True),
    (dict(key_wise=False, post_compose=False), 1, True, True),
    (dict(dynamic_proj=False), 4, False, True),
    (dict(dynamic_gate=False), 4, True, False),
])
def test_options_shape_the_parameters(options, slots, has_proj, has_gate):
    layer = DCMHA(C, num_heads=H, **options)
    dw = layer.core.dynamic_weights
    assert dw.num_slots == slots
    assert (dw.dw1 is not None) == has_proj and (dw.qkw is not None) == has_proj
    assert (dw.dd_w is not None) == has_gate
    assert (layer.core.pre_compose is not None) == options.get("pre_compose", True)
    assert (layer.core.post_compose is not None) == options.get("post_compose", True)
    k, r = 4 * H, options.get("rank", 2)
    expected = slots * ((C * k + k * 2 * r * H) * has_proj + C * H * has_gate)
    assert sum(p.numel() for p in dw.parameters()) == expected


def test_static_proj_starts_at_zero_and_talking_heads_has_no_dynamic_part():
    layer = DCMHA(C, num_heads=H, static_proj=True, dynamic_proj=False, dynamic_gate=False)
    assert layer.core.dynamic_weights is None
    assert torch.equal(layer.core.pre_compose.static, torch.zeros(H, H))
    assert torch.equal(layer.core.post_compose.static, torch.zeros(H, H))


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(dim=30, num_heads=4), r"num_heads=4 must divide dim=30"),
    (dict(dim=24, num_heads=4, rank=0), r"rank must be an integer >= 1, got 0"),
    (dict(dim=24, num_heads=4, query_wise=False, key_wise=False), r"compose nothing"),
    (dict(dim=24, num_heads=4, dynamic_proj=False, dynamic_gate=False), r"compose nothing"),
])
def test_bad_construction_is_explained(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        DCMHA(**kwargs)


@pytest.mark.parametrize("shape", [(B, N), (B, N, C + 1), (B, 1, N, C)])
def test_bad_input_shape_is_explained(shape):
    layer = DCMHA(C, num_heads=H)
    with pytest.raises(ValueError, match=rf"expects input of shape \(B, N, {C}\), got \[{', '.join(map(str, shape))}\]"):
        layer(torch.randn(*shape))


def test_unknown_layer_option_is_explained():
    with pytest.raises(TypeError, match=r"unknown DCMHA option\(s\) \['rnak'\]"):
        DCMHA(C, num_heads=H, rnak=2)


def test_attention_maps_before_and_after_compose():
    import timm
    model = timm.create_model("dcvit_tiny", img_size=32, patch_size=8, depth=2, num_classes=3)
    randomize_dynamic_model(model)
    images = torch.randn(2, 3, 32, 32)
    maps = dcvit.attention_maps(model, images)
    assert [m["name"] for m in maps] == ["blocks.0.attn", "blocks.1.attn"]
    tokens = 1 + (32 // 8) ** 2
    for m in maps:
        for key in ("scores_before", "scores_after", "weights_before", "weights_after"):
            assert m[key].shape == (2, 3, tokens, tokens), key
        torch.testing.assert_close(m["weights_before"].sum(-1), torch.ones(2, 3, tokens))
        assert not torch.allclose(m["weights_before"], m["weights_after"])
        assert not torch.allclose(m["scores_before"], m["scores_after"])
    assert model.training  # left in the mode it was in


def randomize_dynamic_model(model):
    for i, block in enumerate(model.blocks):
        if isinstance(block.attn, DCMHA):
            randomize_dynamic(block.attn, seed=i)


def test_options_are_one_frozen_record():
    from dataclasses import FrozenInstanceError
    from dcvit.attention import DCMHAOptions
    with pytest.raises(TypeError, match=r"unknown DCMHA option\(s\) \['rnak'\]; did you mean 'rank'"):
        DCMHA(C, num_heads=H, rnak=2)
    options = DCMHAOptions(rank=1, static_proj=True)
    layer = DCMHA(C, num_heads=H, options=options, query_wise=False)      # keywords over the record
    assert layer.options == DCMHAOptions(rank=1, static_proj=True, query_wise=False)
    assert layer.core.dynamic_weights.qkw.shape[2] == 2 and layer.core.dynamic_weights.num_slots == 2
    with pytest.raises(FrozenInstanceError):
        layer.options.rank = 3
    with pytest.raises(TypeError, match="static_proj='yes' must be True or False"):
        DCMHAOptions(static_proj="yes")
    from dcvit.attention import DCMHA_OPTIONS
    assert DCMHA_OPTIONS == DCMHAOptions().as_dict()
