"""dcvit.convert: a timm model's attention becomes DCMHA holding the same weights, exactly."""
import copy
import logging
import pickle

import pytest
import timm
import torch
from timm.models import create_feature_extractor, get_graph_node_names
from torch import nn
from torch.fx import symbolic_trace

import dcvit
from dcvit import DCMHA
from dcvit.conversion import DCAttentionRope, DCEvaAttention, DCWindowAttention, converted_layers
from dcvit.fused import attention_impl, select_impl

# A small random instance of each supported family (timm's own builders, small widths).
FAMILIES = {
    "vit": ("vit_small_patch16_224", dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4)),
    "deit3_reg_qknorm": ("vit_small_patch16_224", dict(img_size=32, patch_size=8, embed_dim=48, depth=2,
                                                       num_heads=4, reg_tokens=2, qk_norm=True,
                                                       init_values=0.1, no_embed_class=True)),
    "deit_distilled": ("deit_tiny_distilled_patch16_224", dict(img_size=32, patch_size=8, embed_dim=48,
                                                               depth=2, num_heads=4)),
    "flexivit": ("flexivit_small", dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4)),
    "siglip": ("vit_base_patch16_siglip_224", dict(img_size=32, patch_size=8, embed_dim=48, depth=2,
                                                   num_heads=4)),
    "eva02": ("eva02_tiny_patch14_224", dict(img_size=28, patch_size=7, embed_dim=48, depth=2, num_heads=4)),
    "eva02_clip_unfused_qkv": ("eva02_base_patch16_clip_224", dict(img_size=32, patch_size=8, embed_dim=48,
                                                                   depth=2, num_heads=4, ref_feat_shape=(4, 4))),
    "pe_rope_gqa": ("vit_pe_core_tiny_patch16_384", dict(img_size=32, patch_size=8, embed_dim=48, depth=2,
                                                        num_heads=4, num_kv_heads=2, qkv_fused=False)),
    "swin": ("swin_tiny_patch4_window7_224", dict(img_size=64, patch_size=4, embed_dim=24, depths=(2, 2),
                                                  num_heads=(2, 4), window_size=4)),
}
LAYER_TYPE = {"eva02": DCEvaAttention, "eva02_clip_unfused_qkv": DCEvaAttention, "swin": DCWindowAttention,
              "pe_rope_gqa": DCAttentionRope}
CORES = ("auto", "compile", "reference")


def build(family, **kwargs):
    name, args = FAMILIES[family]
    torch.manual_seed(0)
    # drop_path_rate=0: deterministic in train mode too (Swin's default is 0.1)
    model = timm.create_model(name, pretrained=False, num_classes=10,
                              **{**args, "drop_path_rate": 0.0, **kwargs}).eval()
    with torch.no_grad():  # weights far from timm's init (zero biases, tiny heads) so every term counts
        for key, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
            elif "relative_position_bias_table" not in key:
                p.add_(0.2 * torch.randn_like(p))
        for m in model.modules():
            if hasattr(m, "relative_position_bias_table"):
                m.relative_position_bias_table.normal_(0, 1.0)
    return model


def sample(family, model, batch=2):
    size = FAMILIES[family][1]["img_size"]
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def rel_err(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_identity_conversion_is_exact_on_every_core(family):
    model = build(family)
    x = sample(family, model)
    with torch.no_grad():
        ref = model(x)
        feats = model.forward_features(x)
    converted = dcvit.convert(copy.deepcopy(model))
    layers = converted_layers(converted)
    assert len(layers) == len([m for m in model.modules() if type(m).__name__ in
                               ("Attention", "EvaAttention", "AttentionRope", "WindowAttention")])
    assert all(isinstance(converted.get_submodule(n), LAYER_TYPE.get(family, DCMHA)) for n in layers)
    for core in CORES:
        with torch.no_grad(), attention_impl(core):
            assert rel_err(converted(x), ref) <= 1e-6, core
            assert rel_err(converted.forward_features(x), feats) <= 1e-6, core


@pytest.mark.parametrize("family", ["vit", "eva02", "swin"])
def test_identity_conversion_is_exact_in_float64(family):
    model = build(family).double()
    x = sample(family, model).double()
    with torch.no_grad():
        ref = model(x)
    converted = dcvit.convert(copy.deepcopy(model))
    for core in CORES:
        with torch.no_grad(), attention_impl(core):
            assert rel_err(converted(x), ref) <= 1e-12, core


@pytest.mark.parametrize("family", ["vit", "eva02", "pe_rope_gqa", "swin"])
def test_identity_conversion_trains_like_the_original(family):
    """Train mode, with autograd: same loss and same gradients for the original weights; the
    DCMHA parameters that start the composition (second low-rank factor, gates) get gradients."""
    model = build(family).train()
    converted = dcvit.convert(copy.deepcopy(model)).train()
    x = sample(family, model)
    model(x).square().mean().backward()
    converted(x).square().mean().backward()
    grads = dict(model.named_parameters())
    for name, p in converted.named_parameters():
        if name in grads:
            g = grads[name].grad
            assert (p.grad - g).abs().max() <= 1e-5 * g.abs().max() + 1e-12, name
    for name in converted_layers(converted):
        dw = converted.get_submodule(name).core.dynamic_weights
        assert dw.qkw.grad[:, :, dw.rank:].abs().sum() > 0
        assert dw.dd_w.grad.abs().sum() > 0


def _output_and_grads(model, x):
    """Output and the gradients of a weighted sum of it w.r.t. the input and every trained
    parameter, by name (a traced graph holds the parameters in another order)."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), [x, *params])
    return out, dict(zip(("input", *names), grads))


@pytest.mark.parametrize("family", ["eva02", "eva02_clip_unfused_qkv", "pe_rope_gqa", "swin"])
def test_fx_traced_converted_model_is_bit_equal_to_eager(family):
    """A converted layer's core is one call in an FX graph (as DCMHA's): the traced model runs
    the eager model's core, so outputs and gradients are equal bit for bit."""
    model = dcvit.convert(build(family), init="paper").train()        # no dropout: deterministic
    for m in model.modules():                   # a trained bias table would make Swin's mask need
        if hasattr(m, "relative_position_bias_table"):   # a gradient: the compile core would run
            m.relative_position_bias_table.requires_grad_(False)
    x = sample(family, model)
    layers = converted_layers(model)
    assert layers and all(isinstance(model.get_submodule(n), LAYER_TYPE[family]) for n in layers)
    assert select_impl("auto", x)[0] != "reference"                   # eager runs a fast core here
    graph = symbolic_trace(model)
    cores = [n for n in graph.graph.nodes if n.op == "call_function" and n.target.__name__ == "run_core"]
    assert len(cores) == len(layers)
    out, grads = _output_and_grads(model, x)
    fx_out, fx_grads = _output_and_grads(graph, x)
    assert torch.equal(fx_out, out), (fx_out - out).abs().max()
    assert fx_grads.keys() == grads.keys()
    for name, g in grads.items():
        assert torch.equal(fx_grads[name], g), (name, (fx_grads[name] - g).abs().max())
    # timm's FX feature extraction (its own tracer) too
    model.eval()
    _, nodes = get_graph_node_names(model)
    features = create_feature_extractor(model, {nodes[-1]: "out"})
    with torch.no_grad():
        assert torch.equal(features(x)["out"], model(x))


def test_identity_and_paper_initialisations():
    model = build("vit")
    ident = dcvit.convert(copy.deepcopy(model), init="identity").blocks[0].attn
    paper = dcvit.convert(copy.deepcopy(model), init="paper").blocks[0].attn
    r = ident.core.dynamic_weights.rank
    assert torch.count_nonzero(ident.core.dynamic_weights.qkw[:, :, r:]) == 0
    assert torch.count_nonzero(ident.core.dynamic_weights.dd_w) == 0
    assert torch.count_nonzero(ident.core.dynamic_weights.qkw[:, :, :r]) > 0   # first factor: gradients flow
    for dw in (paper.core.dynamic_weights,):
        c, h, k = dw.dim, dw.num_heads, dw.hidden_dim
        assert dw.dd_w.std().item() == pytest.approx((2.0 / (c + h)) ** 0.5 * 0.005, rel=0.3)
        assert dw.qkw.std().item() == pytest.approx((1.0 / k) ** 0.5 * 2.0 / (h + r) * 0.01, rel=0.3)
    x = sample("vit", model)
    with torch.no_grad():
        ref = model(x)
        out = dcvit.convert(copy.deepcopy(model), init="paper")(x)
    assert 0 < rel_err(out, ref) < 0.1         # almost MHA, not exactly


def test_options_and_layers_reach_the_layers():
    model = dcvit.convert(build("vit"), layers=[-1], rank=1, pre_compose=False, static_proj=True)
    assert isinstance(model.blocks[0].attn, timm.layers.Attention)
    attn = model.blocks[1].attn
    assert isinstance(attn, DCMHA) and attn.core.pre_compose is None
    assert attn.options.rank == 1 and attn.core.post_compose.static is not None
    swin = dcvit.convert(build("swin"), layers=[1, 2])
    assert converted_layers(swin) == ["layers.0.blocks.1.attn", "layers.1.blocks.0.attn"]


def test_converted_vit_has_a_dcvit_state_dict():
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32)
    dcv = timm.create_model("dcvit_tiny_patch16_224", img_size=32)
    converted = dcvit.convert(vit)
    assert {k: v.shape for k, v in converted.state_dict().items()} == \
        {k: v.shape for k, v in dcv.state_dict().items()}


def test_dcvit_models_are_a_converted_vit_with_the_paper_init():
    torch.manual_seed(0)
    dcv = timm.create_model("dcvit_tiny_patch16_224", img_size=32, qk_norm=True, qk_norm_bias=False, rank=1)
    torch.manual_seed(0)
    vit = dcvit.convert(timm.create_model("vit_tiny_patch16_224", img_size=32, qk_norm=True), init="paper",
                        qk_norm_bias=False, rank=1)
    assert list(dcv.state_dict()) == list(vit.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(dcv.state_dict().values(), vit.state_dict().values()))
    attn = vit.blocks[0].attn
    assert attn.q_norm.bias is None and attn.options.qk_norm_bias is False   # scale-only, as asked


def test_scale_only_conversion_refuses_to_drop_a_trained_bias():
    model = build("deit3_reg_qknorm")
    with pytest.raises(ValueError, match="trained q_norm bias, which qk_norm_bias=False would drop"):
        dcvit.convert(model, qk_norm_bias=False)


@pytest.mark.parametrize("family", ["vit", "eva02", "swin"])
def test_state_dict_and_pickle_round_trip(family):
    original = build(family)
    x = sample(family, original)
    converted = dcvit.convert(copy.deepcopy(original), init="paper")
    with torch.no_grad():
        out = converted(x)
    fresh = dcvit.convert(build(family), init="identity")
    fresh.load_state_dict(converted.state_dict(), strict=True)
    clone = pickle.loads(pickle.dumps(converted))
    with torch.no_grad():
        assert torch.equal(fresh(x), out)
        assert torch.equal(clone(x), out)
    # The original's state dict loads with exactly the DCMHA tensors missing.
    result = fresh.load_state_dict(original.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert result.missing_keys and all(any(f".{p}." in k for p in dcvit.core.DCMHA_PARTS)
                                       for k in result.missing_keys)


def test_converted_layers_keep_device_dtype_and_mode():
    model = build("eva02").to(torch.float64).train()
    dcvit.convert(model)
    attn = model.blocks[0].attn
    assert attn.training and attn.core.dynamic_weights.dw1.dtype == torch.float64


def test_the_replaced_module_is_left_intact():
    model = build("swin")
    before = model.layers[0].blocks[0].attn
    keys = set(before.state_dict())
    dcvit.convert(model)
    assert type(before).__name__ == "WindowAttention" and set(before.state_dict()) == keys


def test_converting_twice_is_an_error():
    model = dcvit.convert(build("vit"))
    with pytest.raises(ValueError, match="already has 2 DCMHA layer"):
        dcvit.convert(model)
    with pytest.raises(ValueError, match="already"):
        dcvit.convert(timm.create_model("dcvit_tiny", img_size=32))


def test_nothing_to_convert_lists_what_is_supported():
    with pytest.raises(ValueError, match="nothing to convert.*no attention module.*EvaAttention"):
        dcvit.convert(nn.Sequential(nn.Linear(4, 4)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2)

    with pytest.raises(ValueError, match=r"unsupported type\(s\) \['torch.nn.modules.activation.MultiheadAttention'\]"
                                         r".*Supported: timm.layers.Attention"):
        dcvit.convert(Net())


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="unknown DCMHA option.*'rnak'"):
        dcvit.convert(build("vit"), rnak=2)
    with pytest.raises(ValueError, match="init='zeros'"):
        dcvit.convert(build("vit"), init="zeros")
    with pytest.raises(ValueError, match="layers entry 5 .*\\[0, 2\\)"):
        dcvit.convert(build("vit"), layers=[5])
    with pytest.raises(ValueError, match="compose nothing"):
        dcvit.convert(build("vit"), pre_compose=False, post_compose=False)


def test_unsupported_attention_variant_is_an_error():
    model = nn.Sequential(timm.layers.Attention(16, num_heads=2, gated=True))
    with pytest.raises(ValueError, match="gated=True"):
        dcvit.convert(model)


def test_other_attention_modules_are_left_with_a_warning(caplog):
    model = build("siglip")  # its attention-pool head is cross-attention: not converted
    with caplog.at_level(logging.WARNING, logger="dcvit.conversion"):
        dcvit.convert(model)
    assert "AttentionPoolLatent" in caplog.text
    assert type(model.attn_pool).__name__ == "AttentionPoolLatent"


@pytest.mark.parametrize("family", ["vit", "eva02", "swin"])
def test_accounting_counts_the_converted_layers(family):
    """fvcore's and FlopCounterMode's extra MACs of a conversion equal the formula of
    docs/spec.md §1.2 per layer (Swin: per window), and the extra parameters too."""
    from dcvit.accounting import _dcmha_macs, account, flop_counter_macs
    model = build(family)
    size = FAMILIES[family][1]["img_size"]
    shape = (1, 3, size, size)
    before, matmul_before = account(model, shape), flop_counter_macs(model, shape)["total"]
    converted = dcvit.convert(copy.deepcopy(model))
    after, matmul_after = account(converted, shape), flop_counter_macs(converted, shape)["total"]
    macs = params = 0
    for name in converted_layers(converted):
        attn = converted.get_submodule(name)
        c, h, r = attn.dim, attn.num_heads, attn.options.rank
        params += c * 4 * 4 * h + 4 * 4 * h * 2 * r * h + c * 4 * h
        if family == "swin":
            block = converted.get_submodule(name.rsplit(".", 1)[0])
            windows = (block.input_resolution[0] // block.window_size[0]) * \
                      (block.input_resolution[1] // block.window_size[1])
            macs += windows * sum(_dcmha_macs(attn, block.window_area).values())
        else:
            tokens = converted.patch_embed.num_patches + converted.num_prefix_tokens
            macs += sum(_dcmha_macs(attn, tokens).values())
    assert after.params - before.params == params
    assert after.macs - before.macs == macs
    assert after.matmul_macs - before.matmul_macs == macs == matmul_after - matmul_before


# --- each converted family against its timm original, under every flag its forward reads ---------

def _as_original(layer_cls, **kwargs):
    torch.manual_seed(0)
    layer = layer_cls(**kwargs).double().eval()
    with torch.no_grad():                             # every parameter, biases included, counts
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def _identity_equal(layer, *args, **kwargs):
    """The converted copy (init="identity") computes what the original does, on every core."""
    holder = nn.ModuleList([layer])
    want = layer(*args, **kwargs)
    dcvit.convert(holder, init="identity")
    assert type(holder[0]) is not type(layer)
    for core in CORES:
        with attention_impl(core):
            torch.testing.assert_close(holder[0](*args, **kwargs), want, rtol=1e-10, atol=1e-10)


EVA_FLAGS = [dict(qkv_fused=f, qkv_bias=b, qkv_bias_separate=s, scale_norm=sn, qk_norm=qn, gated=g,
                  rotate_half=rh)
             for f in (True, False) for b in (True, False) for s in ((False, True) if f and b else (False,))
             for sn, qn, g, rh in ((True, False, False, False), (False, True, True, True))]


@pytest.mark.parametrize("flags", EVA_FLAGS, ids=lambda f: "-".join(k for k, v in f.items() if v) or "plain")
@pytest.mark.parametrize("rope,mask", [(False, False), (True, True)])
def test_eva_attention_matches_timm_under_every_flag(flags, rope, mask):
    from timm.models.eva import EvaAttention
    layer = _as_original(EvaAttention, dim=32, num_heads=4, num_prefix_tokens=1,
                         norm_layer=nn.LayerNorm, **flags)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=gen)
    kw = {}
    if rope:
        kw["rope"] = torch.randn(8, 16, dtype=torch.float64, generator=gen)     # (N - prefix, 2 D)
    if mask:
        kw["attn_mask"] = torch.rand(2, 1, 9, 9, generator=gen) > 0.3
        kw["attn_mask"][..., 0] = True
    _identity_equal(layer, x, **kw)


@pytest.mark.parametrize("fused,kv_heads,extra", [(True, None, {}), (False, 2, dict(qk_norm=True, gated=True)),
                                                   (False, None, dict(scale_norm=True, rotate_half=True))])
def test_attention_rope_matches_timm_under_every_flag(fused, kv_heads, extra):
    from timm.layers import AttentionRope
    layer = _as_original(AttentionRope, dim=32, num_heads=4, qkv_fused=fused, num_kv_heads=kv_heads,
                         num_prefix_tokens=1, norm_layer=nn.LayerNorm, **extra)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=gen)
    rope = torch.randn(8, 16, dtype=torch.float64, generator=gen)
    _identity_equal(layer, x, rope=rope)
    _identity_equal(_as_original(AttentionRope, dim=32, num_heads=4, qkv_fused=fused, num_kv_heads=kv_heads,
                                 num_prefix_tokens=1, norm_layer=nn.LayerNorm, **extra), x, is_causal=True)


@pytest.mark.parametrize("shifted", [False, True])
def test_window_attention_matches_timm_with_and_without_the_shift_mask(shifted):
    from timm.models.swin_transformer import WindowAttention
    layer = _as_original(WindowAttention, dim=32, num_heads=4, window_size=3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 9, 32, dtype=torch.float64, generator=gen)                # 2 images x 2 windows
    mask = torch.where(torch.rand(2, 9, 9, generator=gen) > 0.3, 0.0, -100.0).double() if shifted else None
    _identity_equal(layer, x, mask=mask)
