"""The authors' big_vision models: equality with their flax code, the body, the options, .npz loading.

The fixtures under tests/fixtures/ were made by tests/fixtures/make_bigvision_fixture.py,
which runs the authors' own model code (github Lisennlp/big_vision); no jax is needed here.
"""
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from timm.layers import set_scriptable

import dcvit
from dcvit.attention import DCMHA, DCMHAOptions
from dcvit.bigvision import BigVisionViT, posemb_sincos_2d
from dcvit.bigvision_npz import load_bigvision_npz, read_npz
from dcvit.fused import attention_impl
from attention_cores import CORES, device_for

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_SIZE = dict(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=4, mlp_ratio=2.0,
                    num_classes=10)
SMALL = dict(img_size=32, depth=2)
BV = ["vit_tiny_patch16_bv_224", "vit_small_patch16_bv_224", "vit_medium_patch16_bv_224",
      "vit_base_patch16_bv_224"]
DCBV = ["dc" + name for name in BV]


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def fixture_model(tag, name):
    return timm.create_model(name, pretrained=True, **FIXTURE_SIZE,
                             pretrained_cfg_overlay=dict(file=str(FIXTURES / f"bigvision_{tag}_params.npz"))).eval()


def fixture_input():
    io = np.load(FIXTURES / "bigvision_io.npz")
    return torch.from_numpy(io["image"]).permute(0, 3, 1, 2).contiguous(), io


# --- equality with the authors' flax code ----------------------------------------------------

def test_fixture_is_from_the_authors_commit_and_compose_matters():
    _, io = fixture_input()
    assert str(io["authors_commit"]) == "23415480d985e7a2a72684e9f585636afb0f4e11"
    assert float(io["compose_effect"]) > 0.2          # zeroing the dynamic weights moves the logits > 20 %


@pytest.mark.parametrize("impl", CORES)
@pytest.mark.parametrize("tag,name", [("dc", "dcvit_small_patch16_bv_224"),
                                      ("vit", "vit_small_patch16_bv_224"),
                                      ("flax", "vit_small_patch16_bv_224")])
def test_logits_equal_the_authors_flax_model(tag, name, impl):
    x, io = fixture_input()
    device = device_for(impl)
    model = fixture_model(tag, name).to(device)
    with torch.no_grad(), attention_impl(impl):
        out = model(x.to(device)).cpu().numpy()
    ref = io[f"logits_{tag}"]
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def test_dc_fixture_depends_on_every_dc_part():
    """The fixture would catch a wrong static matrix, activation, or q/k norm (> 10x the tolerance)."""
    x, io = fixture_input()
    ref = io["logits_dc"]
    for change in (lambda m: m.blocks[0].attn.core.pre_compose.static.data.zero_(),
                   lambda m: setattr(m.blocks[0].attn.core.dynamic_weights, "approximate", "none"),
                   lambda m: m.blocks[1].attn.k_norm.weight.data.fill_(1.0)):
        model = fixture_model("dc", "dcvit_small_patch16_bv_224")
        change(model)
        with torch.no_grad():
            out = model(x).numpy()
        assert np.abs(out - ref).max() > 1e-4 * np.abs(ref).max()


# --- the body and the family -----------------------------------------------------------------

def test_parameter_counts_and_dc_overhead():
    counts = {name: n_params(timm.create_model(name)) for name in BV + DCBV}
    assert counts["vit_small_patch16_bv_224"] == 22_122_472
    assert counts["dcvit_small_patch16_bv_224"] == 22_705_480
    for name, (c, h) in zip(BV, [(192, 3), (384, 6), (512, 8), (768, 12)]):
        # docs/spec.md §1.2 overhead + two static H×H matrices + two scale-only q/k norms, per layer
        per_layer = c * 16 * h + 4 * 4 * h * 4 * h + c * 4 * h + 2 * h * h + 2 * (c // h)
        assert counts["dc" + name] - counts[name] == 12 * per_layer
        assert 1.01 < counts["dc" + name] / counts[name] < 1.03
    # the pos embedding is a fixed buffer, not a parameter
    model = timm.create_model("vit_small_patch16_bv_224")
    assert "pos_embed" not in dict(model.named_parameters()) and "pos_embed" not in model.state_dict()


def test_position_embedding_is_big_visions_sincos():
    h, w, width = 3, 5, 12
    pe = posemb_sincos_2d(h, w, width, dtype=torch.float64)[0].numpy()
    omega = 1.0 / 10000.0 ** (np.arange(3) / 2.0)
    for row in range(h):
        for col in range(w):
            expect = np.concatenate([np.sin(col * omega), np.cos(col * omega),
                                     np.sin(row * omega), np.cos(row * omega)])
            np.testing.assert_allclose(pe[row * w + col], expect, rtol=0, atol=1e-15)
    model = timm.create_model("vit_small_patch16_bv_224", **SMALL)
    torch.testing.assert_close(model.pos_embed, posemb_sincos_2d(2, 2, 384))


def test_body_norms_every_token_before_pooling_and_has_pre_logits():
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_bv_224", **SMALL).eval()
    torch.nn.init.normal_(model.head.weight)
    assert model.cls_token is None and isinstance(model.fc_norm, torch.nn.Identity)
    assert isinstance(model.blocks[0].mlp.act, timm.layers.GELUTanh)
    x = torch.randn(2, 3, 32, 32)
    tokens = model.forward_features(x)                       # normed per token
    manual = model.norm(model.blocks(model.patch_embed(x) + model.pos_embed)).mean(1)
    manual = torch.tanh(model.pre_logits.fc(manual))
    torch.testing.assert_close(model.forward_head(tokens, pre_logits=True), manual)
    torch.testing.assert_close(model(x), model.head(manual))


def test_initialisation_is_big_visions():
    torch.manual_seed(0)
    model = timm.create_model("dcvit_small_patch16_bv_224")
    assert model.head.weight.abs().sum() == 0 and model.head.bias.abs().sum() == 0
    attn = model.blocks[0].attn
    c, h = 384, 6
    bound = math.sqrt(6 / (c * h + c * (c // h)))          # flax xavier_uniform of a (C, H, D) kernel
    assert attn.qkv.weight.abs().max() <= bound and attn.qkv.weight.abs().max() > 0.99 * bound
    assert attn.qkv.bias.abs().sum() == 0
    static = attn.core.pre_compose.static
    assert static.std().item() == pytest.approx(0.1 * math.sqrt(1 / h), rel=0.5)
    assert attn.q_norm.bias is None and attn.q_norm.eps == 1e-6


@pytest.mark.parametrize("name", ["vit_small_patch16_bv_224", "dcvit_small_patch16_bv_224"])
def test_timm_contract(name):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=42, **SMALL)
    x = torch.randn(2, 3, 32, 32)
    model(x).mean().backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]
    model.eval()
    expected = model(x)
    model.set_grad_checkpointing()
    torch.testing.assert_close(model(x), expected)
    final, inter = model.forward_intermediates(x[:1])
    assert len(inter) == 2 and inter[-1].shape == (1, 384, 2, 2)
    model.reset_classifier(0)
    assert model(x).shape == (2, 384)
    unpooled = timm.create_model(name, num_classes=0, global_pool="", **SMALL).eval()
    assert unpooled(x).shape == (2, 4, 384)
    feats = timm.create_model(name, features_only=True, out_indices=(-1,), **SMALL).eval()
    assert feats(x)[0].shape == (2, 384, 2, 2)
    with set_scriptable(True):
        scripted = torch.jit.script(timm.create_model(name, **SMALL).eval())
    assert scripted(x).shape == (2, 1000)


@pytest.mark.parametrize("name", ["vit_small_patch16_bv_224", "dcvit_small_patch16_bv_224"])
def test_no_weight_decay_names_parameters_only(name):
    """Each entry matches a parameter (the sin-cos ``pos_embed`` is a buffer, not one) or names
    an optional part this body leaves out (timm's optimizer factory reads the list)."""
    import fnmatch
    model = timm.create_model(name, **SMALL)
    names = [n for n, _ in model.named_parameters()]
    for pattern in model.no_weight_decay():
        if not any(fnmatch.fnmatch(n, pattern) for n in names):
            assert getattr(model, pattern, None) is None, pattern
    assert "pos_embed" not in model.no_weight_decay()
    if name.startswith("dcvit"):
        assert any(fnmatch.fnmatch(n, "*.core.dynamic_weights.qkw") for n in names)


@pytest.mark.parametrize("name", ["vit_small_patch16_bv_224", "dcvit_small_patch16_bv_224"])
def test_pruning_the_head_removes_pre_logits(name):
    """``prune_intermediate_layers`` (prune_head=True) leaves no parameter without a use."""
    torch.manual_seed(0)
    model = timm.create_model(name, **SMALL)
    x = torch.randn(2, 3, 32, 32)
    taps = model.forward_intermediates(x, indices=[0], intermediates_only=True)
    assert model.prune_intermediate_layers([0]) == [0]
    assert isinstance(model.pre_logits, torch.nn.Identity) and len(model.blocks) == 1
    kept = model.forward_intermediates(x, indices=[0], intermediates_only=True)
    torch.testing.assert_close(kept[0], taps[0])
    sum(f.sum() for f in kept + [model.forward_features(x)]).backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]
    rep = timm.create_model(name, **SMALL)
    rep.prune_intermediate_layers([0], prune_head=False)
    assert isinstance(rep.pre_logits, torch.nn.Sequential)


@pytest.mark.parametrize("name", ["vit_small_patch16_bv_224", "dcvit_small_patch16_bv_224"])
def test_built_on_the_requested_device_and_dtype(name):
    """The sin-cos buffer follows ``device=``/``dtype=`` as the parameters do (timm builds on
    the meta device to read a model's shapes)."""
    meta = timm.create_model(name, device="meta", **SMALL)
    assert {t.device.type for t in [*meta.parameters(), *meta.buffers()]} == {"meta"}
    assert meta(torch.empty(2, 3, 32, 32, device="meta")).shape == (2, 1000)
    half = timm.create_model(name, dtype=torch.bfloat16, **SMALL)
    assert half.pos_embed.dtype == torch.bfloat16
    torch.testing.assert_close(half.pos_embed, posemb_sincos_2d(2, 2, 384).to(torch.bfloat16))


def test_body_arguments_that_are_not_big_vision_are_refused():
    with pytest.raises(ValueError, match="class_token=True is not the big_vision body"):
        timm.create_model("vit_small_patch16_bv_224", class_token=True)
    with pytest.raises(TypeError, match="a baseline has no DCMHA options"):
        timm.create_model("vit_small_patch16_bv_224", rank=2)


# --- the authors' DC options, in both families -----------------------------------------------

@pytest.mark.parametrize("name", ["dcvit_small_patch16_224", "dcvit_small_patch16_bv_224"])
def test_options_reach_the_layers(name):
    model = timm.create_model(name, static_proj=True, static_init="normal", dynamic_act="gelu_tanh",
                              dynamic_drop=0.3, qk_norm=True, qk_norm_bias=False, **SMALL)
    attn = model.blocks[1].attn
    assert attn.options.static_init == "normal" and attn.core.pre_compose.static.abs().sum() > 0
    assert attn.core.dynamic_weights.approximate == "tanh" and attn.core.dynamic_weights.drop.p == 0.3
    assert attn.q_norm.bias is None and attn.k_norm.weight is not None


def test_defaults_of_the_two_families():
    timm_family = timm.create_model("dcvit_small_patch16_224", **SMALL).blocks[0].attn
    bv_family = timm.create_model("dcvit_small_patch16_bv_224", **SMALL).blocks[0].attn
    assert timm_family.options == DCMHAOptions()
    assert timm_family.core.pre_compose.static is None and isinstance(timm_family.q_norm, torch.nn.Identity)
    assert bv_family.options == DCMHAOptions.of(**{k: v for k, v in dcvit.bigvision.BV_DCMHA_OPTIONS.items()
                                                   if k in DCMHAOptions().as_dict()})
    assert bv_family.core.pre_compose.static is not None and bv_family.qkv.bias is not None


def test_static_init_normal_has_the_authors_std():
    torch.manual_seed(0)
    layer = DCMHA(64, num_heads=32, static_proj=True, static_init="normal")
    w = torch.cat([layer.core.pre_compose.static.flatten(), layer.core.post_compose.static.flatten()])
    assert w.std().item() == pytest.approx(0.1 * math.sqrt(1 / 32), rel=0.06)
    assert DCMHA(64, num_heads=32, static_proj=True).core.pre_compose.static.abs().sum() == 0


def test_dynamic_act_gelu_tanh_is_the_tanh_formula():
    torch.manual_seed(0)
    layer = DCMHA(16, num_heads=4, dynamic_act="gelu_tanh", dynamic_gate=False).double()
    dw = layer.core.dynamic_weights
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    u = torch.einsum("bnc,cgk->bngk", x, dw.dw1)
    hidden = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
    w = torch.einsum("bngk,gkih->bngih", hidden, dw.qkw)
    w1 = w[..., :2, :] / torch.sqrt((w[..., :2, :] ** 2).mean(-1, keepdim=True) + 1e-6)
    got1, got2, _ = dw(x)
    torch.testing.assert_close(got1, w1)
    torch.testing.assert_close(got2, w[..., 2:, :])


def test_dynamic_drop_drops_in_training_only():
    torch.manual_seed(0)
    layer = DCMHA(16, num_heads=4, dynamic_drop=0.5)
    x = torch.randn(2, 5, 16)
    _, _, dd = layer.core.dynamic_weights(x)
    assert (dd == 0).float().mean() > 0.3
    layer.eval()
    _, _, dd = layer.core.dynamic_weights(x)
    assert (dd != 0).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(static_init="ones"), "static_init must be one of"),
    (dict(dynamic_act="relu"), "dynamic_act must be one of"),
    (dict(dynamic_drop=1.5), "dynamic_drop must be a rate"),
])
def test_bad_option_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DCMHA(16, num_heads=4, **kwargs)


# --- .npz loading ------------------------------------------------------------------------------

def test_prefix_and_scan_layouts_load_the_same(tmp_path):
    arrays = read_npz(FIXTURES / "bigvision_dc_params.npz")
    assert not any(n.startswith("params/") for n in arrays)
    stacked = {n: a for n, a in arrays.items() if "encoderblock_" not in n}
    for name in {n.split("/", 2)[2] for n in arrays if "encoderblock_" in n}:
        stacked[f"Transformer/encoderblock/{name}"] = np.stack(
            [arrays[f"Transformer/encoderblock_{i}/{name}"] for i in range(2)])
    np.savez(tmp_path / "scan.npz", **{"params/" + n: a for n, a in stacked.items()},
             **{"opt/state/0": np.zeros(3)})
    x, io = fixture_input()
    model = timm.create_model("dcvit_small_patch16_bv_224", pretrained=True, **FIXTURE_SIZE,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / "scan.npz"))).eval()
    with torch.no_grad():
        np.testing.assert_allclose(model(x).numpy(), io["logits_dc"], rtol=0, atol=1e-5)
    again = dcvit.load_weights(timm.create_model("dcvit_small_patch16_bv_224", **FIXTURE_SIZE),
                               tmp_path / "scan.npz").eval()       # the same file through load_weights
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


def _load_error(tmp_path, arrays, name, **size):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    torch.manual_seed(0)
    model = timm.create_model(name, **{**FIXTURE_SIZE, **size})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as err:
        load_bigvision_npz(model, path)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the model was changed"
    return str(err.value)


def test_bad_files_raise_one_clear_error_and_load_nothing(tmp_path):
    dc = read_npz(FIXTURES / "bigvision_dc_params.npz")
    vit = read_npz(FIXTURES / "bigvision_vit_params.npz")
    msg = _load_error(tmp_path, dc, "vit_small_patch16_bv_224")
    assert "a DC checkpoint needs a dcvit_*_bv model" in msg and "dyn_w_proj" in msg
    msg = _load_error(tmp_path, vit, "dcvit_small_patch16_bv_224")
    assert "a baseline checkpoint needs a vit_*_bv model" in msg
    missing = {n: a for n, a in dc.items() if n != "Transformer/encoderblock_1/MlpBlock_0/Dense_0/bias"}
    assert "blocks.1.mlp.fc1.bias" in _load_error(tmp_path, missing, "dcvit_small_patch16_bv_224")
    extra = {**dc, "Transformer/encoderblock_1/extra/kernel": np.zeros(3)}
    assert "Transformer/encoderblock_1/extra/kernel" in _load_error(tmp_path, extra, "dcvit_small_patch16_bv_224")
    msg = _load_error(tmp_path, dc, "dcvit_small_patch16_bv_224", embed_dim=32)
    assert "embedding/kernel" in msg and "embed_dim" in msg
    msg = _load_error(tmp_path, vit, "vit_small_patch16_bv_224", num_heads=2)
    assert "pass num_heads=4" in msg
    msg = _load_error(tmp_path, vit, "vit_small_patch16_bv_224", depth=3)
    assert "blocks.2" in msg
    msg = _load_error(tmp_path, {**vit, "pos_embedding": np.zeros((1, 16, 16))}, "vit_small_patch16_bv_224")
    assert "pos_embedding" in msg and "sincos2d" in msg
    msg = _load_error(tmp_path, vit, "vit_small_patch16_bv_224", num_classes=7)
    assert "head/kernel" in msg and "num_classes" in msg


def test_truncated_file_is_named(tmp_path):
    src = FIXTURES / "bigvision_dc_params.npz"
    path = tmp_path / "truncated.npz"
    path.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"truncated\.npz' is not a readable \.npz"):
        timm.create_model("dcvit_small_patch16_bv_224", pretrained=True, **FIXTURE_SIZE,
                          pretrained_cfg_overlay=dict(file=str(path)))
    shutil.copy(src, tmp_path / "ok.npz")
    with pytest.raises(ValueError, match="does not exist"):
        load_bigvision_npz(timm.create_model("dcvit_small_patch16_bv_224", **FIXTURE_SIZE), tmp_path / "no.npz")


def test_safetensors_roundtrip_of_a_bv_model(tmp_path):
    x, io = fixture_input()
    model = fixture_model("dc", "dcvit_small_patch16_bv_224")
    path = dcvit.save_weights(model, tmp_path / "bv.safetensors")
    again = timm.create_model("dcvit_small_patch16_bv_224", pretrained=True, **FIXTURE_SIZE,
                              pretrained_cfg_overlay=dict(file=str(path), num_classes=10)).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)
    assert isinstance(again, BigVisionViT)


@pytest.mark.parametrize("name", ["vit_small_patch16_bv_224", "dcvit_small_patch16_bv_224"])
def test_accounting_counts_the_pre_logits_layer(name):
    from dcvit.accounting import account, analytic_macs
    model = timm.create_model(name, **SMALL).eval()
    acc = account(model)
    assert analytic_macs(model)["total"] == acc.macs
    plain = timm.create_model(name, rep_size=False, **SMALL).eval()
    assert acc.macs - account(plain).macs == 384 * 384


def test_models_doc_blocks_run_from_the_repository_root(monkeypatch):
    """docs/models.md's python blocks, as pasted at the repository root (the .npz example
    reads tests/fixtures/)."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "models.md").read_text()
    blocks = [b.split("\n", 1)[1] for b in text.split("```python")[1:]]
    blocks = [b[:b.index("```")] for b in blocks]
    assert len(blocks) == 2 and "bigvision_dc_params.npz" in blocks[1]
    monkeypatch.chdir(root)
    for code in blocks:
        exec(compile(code, "docs/models.md", "exec"), {})
