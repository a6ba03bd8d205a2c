"""The DCViT family in timm's registry: parameter counts, timm's model contract, checkpoints."""
import logging

import pytest
import timm
import torch
from timm.layers import Attention, set_scriptable
from timm.layers import create_feature_extractor, get_graph_node_names

import dcvit
import dcvit.models
import dcvit.weights
from dcvit import DCMHA

VARIANTS = list(dcvit.models.DCVIT_MODELS)          # every row of dcvit.models.SIZES
# The baseline of each and its parameter count, written out (a new size needs its row here).
BASELINES = {"dcvit_tiny_patch16_224": ("vit_tiny_patch16_224", 5_717_416),
             "dcvit_small_patch16_224": ("vit_small_patch16_224", 22_050_664),
             "dcvit_medium_patch16_224": ("vit_medium_patch16_224", 38_837_736),
             "dcvit_base_patch16_224": ("vit_base_patch16_224", 86_567_656)}
SMALL = dict(img_size=32)  # 2×2 patches + class token: the real widths at a tiny cost
# The contract tests run tiny and small (the paper's model) by default, medium and base in the
# slow tier: the four differ only in width, depth and head count.
TIERED = [*VARIANTS[:2], *(pytest.param(name, marks=pytest.mark.slow) for name in VARIANTS[2:])]


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def dcmha_overhead(dim, heads, rank=2, depth=12):
    k = 4 * heads
    return depth * (dim * 4 * k + 4 * k * 2 * rank * heads + dim * 4 * heads)


def test_registered_names_and_aliases():
    names = set(timm.list_models("dcvit*"))
    assert set(VARIANTS) | {"dcvit_tiny", "dcvit_small", "dcvit_medium", "dcvit_base"} <= names
    assert "vit_medium_patch16_224" in timm.list_models("vit_medium*")


def test_dcvit_small_has_the_papers_parameter_count():
    model = timm.create_model("dcvit_small")
    assert n_params(model) == 22_631_272
    assert n_params(model) / 22_050_664 == pytest.approx(1.026, abs=5e-4)


@pytest.mark.parametrize("name", TIERED)
def test_parameter_counts_match_formula(name):
    base_name, base_count = BASELINES[name]
    base = timm.create_model(base_name)
    model = timm.create_model(name)
    assert n_params(base) == base_count
    cfg = dcvit.models.DCVIT_MODELS[name]
    assert n_params(model) - base_count == dcmha_overhead(cfg["embed_dim"], cfg["num_heads"])
    assert 1.01 < n_params(model) / base_count < 1.03


def test_alias_builds_the_same_model():
    a, b = timm.create_model("dcvit_tiny", **SMALL), timm.create_model("dcvit_tiny_patch16_224", **SMALL)
    assert [(k, v.shape) for k, v in a.state_dict().items()] == [(k, v.shape) for k, v in b.state_dict().items()]
    assert a.pretrained_cfg["architecture"] == "dcvit_tiny_patch16_224"


def test_create_model_kwargs_reach_the_model():
    model = timm.create_model("dcvit_small", num_classes=10, img_size=64, patch_size=8, dynamic_img_size=True,
                              drop_path_rate=0.1, rank=1, query_wise=False, depth=3)
    assert model.head.out_features == 10 and len(model.blocks) == 3
    attn = model.blocks[0].attn
    assert isinstance(attn, DCMHA)
    assert attn.options.rank == 1 and attn.options.query_wise is False
    assert attn.core.dynamic_weights.num_slots == 2 and attn.core.dynamic_weights.qkw.shape[2] == 2
    assert model.blocks[2].drop_path1.drop_prob == pytest.approx(0.1)
    out = model(torch.randn(1, 3, 48, 80))  # dynamic image size
    assert out.shape == (1, 10)


def test_dcmha_layers_mixes_plain_and_dcmha_blocks():
    model = timm.create_model("dcvit_tiny", dcmha_layers=[0, -1], depth=4, **SMALL)
    kinds = [type(b.attn) for b in model.blocks]
    assert issubclass(kinds[0], DCMHA) and issubclass(kinds[3], DCMHA)
    assert kinds[1] is Attention and kinds[2] is Attention
    plain = timm.create_model("vit_tiny_patch16_224", depth=4, **SMALL)
    assert n_params(model) - n_params(plain) == dcmha_overhead(192, 3, depth=2)
    assert torch.isfinite(model(torch.randn(1, 3, 32, 32))).all()


@pytest.mark.parametrize("kwargs,error,pattern", [
    (dict(rnak=1), TypeError, r"unknown option 'rnak'; did you mean 'rank'"),
    (dict(query_wsie=False), TypeError, r"did you mean 'query_wise'"),
    (dict(num_heads=5), ValueError, r"num_heads=5 must divide dim=384"),
    (dict(rank=0), ValueError, r"rank must be an integer >= 1"),
    (dict(dcmha_layers=[12]), ValueError, r"dcmha_layers entry 12 is not an attention-layer index in \[0, 12\)"),
])
def test_bad_options_are_explained(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        timm.create_model("dcvit_small", **SMALL, **kwargs)


# --- timm's model contract (timm/tests/test_models.py), for every variant ---------------------

@pytest.mark.parametrize("name", TIERED)
def test_forward_backward_reaches_every_parameter(name):
    model = timm.create_model(name, num_classes=42, **SMALL)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 42) and torch.isfinite(out).all()
    out.mean().backward()
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not no_grad, f"parameters without gradient: {no_grad}"
    zero = [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.abs().sum() > 0
            and "dynamic_weights" in n]
    assert not zero, f"DCMHA parameters with an all-zero gradient: {zero}"


@pytest.mark.parametrize("name", TIERED)
def test_grad_checkpointing_leaves_output_unchanged(name):
    torch.manual_seed(0)
    model = timm.create_model(name, **SMALL).eval()
    x = torch.randn(2, 3, 32, 32)
    expected = model(x)
    model.set_grad_checkpointing()
    torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize("name", TIERED)
def test_classifier_reset_and_features(name):
    model = timm.create_model(name, **SMALL).eval()
    x = torch.randn(1, 3, 32, 32)
    assert model.num_features == model.head_hidden_size == model.embed_dim
    state = model.state_dict()
    cfg = model.pretrained_cfg
    assert cfg["classifier"] + ".weight" in state and cfg["first_conv"] + ".weight" in state
    model.reset_classifier(0)
    assert model(x).shape == (1, model.num_features)
    unpooled = timm.create_model(name, num_classes=0, global_pool="", **SMALL).eval()
    assert unpooled(x).shape == (1, 1 + 4, unpooled.num_features)
    final, intermediates = model.forward_intermediates(x)
    assert len(intermediates) == len(model.blocks)
    assert intermediates[-1].shape == (1, model.embed_dim, 2, 2)
    feats = timm.create_model(name, features_only=True, out_indices=(-2, -1), **SMALL).eval()
    missing, _ = feats.load_state_dict({"model." + k: v for k, v in model.state_dict().items()}, strict=False)
    assert not missing
    outs = feats(x)
    assert [o.shape for o in outs] == [(1, model.embed_dim, 2, 2)] * 2
    torch.testing.assert_close(outs[-1], intermediates[-1])


@pytest.mark.parametrize("name", TIERED)
def test_torchscript(name):
    with set_scriptable(True):
        model = timm.create_model(name, **SMALL).eval()
    scripted = torch.jit.script(model)
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(scripted(x), model(x))


@pytest.mark.parametrize("name", TIERED)
def test_fx_trace_equals_eager(name):
    model = timm.create_model(name, **SMALL).eval()
    _, eval_nodes = get_graph_node_names(model)
    fx_model = create_feature_extractor(model, [eval_nodes[-1]])
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(list(fx_model(x).values())[0], model(x), rtol=0, atol=0)


def test_bfloat16_autocast_forward_backward():
    model = timm.create_model("dcvit_tiny", **SMALL)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 3, 32, 32))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    out.float().mean().backward()
    assert model.blocks[0].attn.core.dynamic_weights.dw1.grad is not None


# --- checkpoints -----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_vit_checkpoint_loads_into_dcvit(tmp_path, caplog, fmt):
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", **SMALL)
    path = tmp_path / f"vit.{fmt}"
    if fmt == "pth":
        torch.save(vit.state_dict(), path)
    else:
        dcvit.save_weights(vit, path)
    with caplog.at_level(logging.WARNING, logger="dcvit"):
        model = timm.create_model("dcvit_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **SMALL)
    assert "36 DCMHA tensors keep their initialisation" in caplog.text
    assert "blocks.11.attn.core.dynamic_weights.dd_w" in caplog.text
    torch.testing.assert_close(model.blocks[3].attn.qkv.weight, vit.blocks[3].attn.qkv.weight)
    torch.testing.assert_close(model.head.weight, vit.head.weight)
    # The DCMHA tensors are initialised as docs/spec.md §1.2 says (not zeros, not timm's 0.02 Linear init).
    dw1 = model.blocks[0].attn.core.dynamic_weights.dw1
    assert dw1.std().item() == pytest.approx((2 / (192 + 12)) ** 0.5, rel=0.1)
    # And the same load through dcvit.load_weights.
    model2 = dcvit.load_weights(timm.create_model("dcvit_tiny", **SMALL), path)
    torch.testing.assert_close(model2.blocks[3].attn.proj.weight, vit.blocks[3].attn.proj.weight)


def test_dcvit_weights_roundtrip_as_safetensors(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model("dcvit_tiny", **SMALL).eval()
    path = dcvit.save_weights(model, tmp_path / "sub" / "dcvit_tiny.safetensors")
    assert path.is_file() and not list(path.parent.glob("*.tmp"))
    fresh = dcvit.load_weights(timm.create_model("dcvit_tiny", **SMALL).eval(), path)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(fresh(x), model(x), atol=0, rtol=0)
    from_pretrained = timm.create_model("dcvit_tiny", pretrained=True, **SMALL,
                                        pretrained_cfg_overlay=dict(file=str(path))).eval()
    torch.testing.assert_close(from_pretrained(x), model(x), atol=0, rtol=0)


def test_checkpoint_of_another_size_is_explained(tmp_path):
    path = dcvit.save_weights(timm.create_model("vit_small_patch16_224", **SMALL), tmp_path / "s.safetensors")
    with pytest.raises(ValueError, match=r"checkpoint tensor '[\w.]+' has shape \([\d, ]*384[\d, ]*\) but the "
                                         r"model expects \([\d, ]*192[\d, ]*\): the checkpoint is for a model of "
                                         r"another size"):
        dcvit.load_weights(timm.create_model("dcvit_tiny", **SMALL), path)


def test_checkpoint_of_another_architecture_is_explained(tmp_path):
    path = tmp_path / "other.pth"
    torch.save({"conv.weight": torch.zeros(3)}, path)
    with pytest.raises(ValueError, match=r"checkpoint lacks \d+ tensors the model needs"):
        dcvit.load_weights(timm.create_model("dcvit_tiny", **SMALL), path)


def test_missing_weights_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        dcvit.weights.read_state_dict(tmp_path / "nope.safetensors")
