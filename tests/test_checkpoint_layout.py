"""DCMHA's parts live in each layer's core (``attn.core.dynamic_weights.dw1``); state dicts with
them on the layer itself (``attn.dynamic_weights.dw1``) load to the same logits."""
from pathlib import Path

import pytest
import timm
import torch

import dcvit
from dcvit.conversion import core_keys, fit_state_dict
from dcvit.core import DCMHA_PARTS, DCMHACore
from dcvit.models import checkpoint_filter_fn

FIXTURE = Path(__file__).parent / "fixtures" / "dcvit_tiny_layer_keys.pt"


def _layer_keys(state_dict):
    """The state dict with every ``.core.`` dropped from its keys: DCMHA's parts on the layer."""
    return {k.replace(".core.", "."): v for k, v in state_dict.items()}


def test_a_state_dict_with_the_parts_on_the_layer_loads_to_the_same_logits():
    """A dcvit_tiny state dict whose DCMHA tensors sit on the layers (the fixture holds one,
    with its input and logits) loads strictly through checkpoint_filter_fn and gives its logits."""
    saved = torch.load(FIXTURE, weights_only=True)
    assert any(".attn.dynamic_weights." in k for k in saved["state_dict"])
    assert any(".attn.pre_compose.static" in k for k in saved["state_dict"])
    model = timm.create_model(saved["model"], **saved["args"]).eval()
    model.load_state_dict(checkpoint_filter_fn(saved["state_dict"], model), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(saved["input"]), saved["logits"], rtol=1e-5, atol=1e-6)
    assert set(model.state_dict()) == set(core_keys(saved["state_dict"], model.state_dict()))


@pytest.mark.parametrize("name,args", [
    ("eva02_tiny_patch14_224", dict(img_size=28, patch_size=7, embed_dim=48, depth=2, num_heads=4)),
    ("swin_tiny_patch4_window7_224", dict(img_size=64, patch_size=4, embed_dim=24, depths=(2, 2),
                                          num_heads=(2, 4), window_size=4)),
])
def test_converted_families_load_the_layer_layout(name, args):
    torch.manual_seed(0)
    model = dcvit.convert(timm.create_model(name, num_classes=5, **args).eval(), init="paper", static_proj=True)
    x = torch.randn(2, 3, args["img_size"], args["img_size"])
    with torch.no_grad():
        ref = model(x)
    old = _layer_keys(model.state_dict())
    assert any(".dynamic_weights." in k and ".core." not in k for k in old)
    torch.manual_seed(1)
    fresh = dcvit.convert(timm.create_model(name, num_classes=5, **args).eval(), init="paper", static_proj=True)
    fresh.load_state_dict(fit_state_dict(fresh, old), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), ref, rtol=0, atol=0)


def test_core_keys_renames_only_what_the_model_has():
    own = ["blocks.0.attn.core.dynamic_weights.dw1", "blocks.0.attn.qkv.weight", "pre_compose.w"]
    sd = {"blocks.0.attn.dynamic_weights.dw1": 1, "blocks.0.attn.qkv.weight": 2,
          "blocks.1.attn.dynamic_weights.dw1": 3, "pre_compose.w": 4}
    assert core_keys(sd, own) == {"blocks.0.attn.core.dynamic_weights.dw1": 1, "blocks.0.attn.qkv.weight": 2,
                                  "blocks.1.attn.dynamic_weights.dw1": 3, "pre_compose.w": 4}


def test_every_dcmha_layer_holds_a_core_module_with_its_parts():
    model = timm.create_model("dcvit_tiny", img_size=16, patch_size=8, depth=2, num_classes=5)
    swin = dcvit.convert(timm.create_model("swin_tiny_patch4_window7_224", img_size=64, patch_size=4, embed_dim=24,
                                           depths=(2, 2), num_heads=(2, 4), window_size=4))
    for m in (model, swin):
        cores = [c for c in m.modules() if isinstance(c, DCMHACore)]
        assert len(cores) == 2 if m is model else len(cores) == 4
        for core in cores:
            assert core.dynamic_weights is not None and set(DCMHA_PARTS) <= set(dict(core.named_children()))
