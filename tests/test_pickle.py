"""Whole models survive pickling: torch.save/torch.load and pickle round trips keep the
class, the DCMHA options and the outputs."""
import io
import pickle

import pytest
import timm
import torch

import dcvit
from dcvit import DCMHA

SMALL = dict(img_size=32, depth=3, num_classes=5)
OPTIONS = [dict(), dict(rank=1, dcmha_layers=[0, 2]), dict(static_proj=True, key_wise=False),
           dict(pre_compose=False, dynamic_gate=False)]


def _layers(model):
    return [m for m in model.modules() if isinstance(m, DCMHA)]


def _round_trips(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    yield torch.load(buf, weights_only=False)
    yield pickle.loads(pickle.dumps(model))


LIBRARY_MODELS = sorted(name for name, fn in timm.models._registry._model_entrypoints.items()
                        if fn.__module__.split(".")[0] == "dcvit")


def test_the_library_registers_its_families():
    assert {"dcvit_tiny", "dcvit_base_patch16_224", "vit_medium_patch16_224"} <= set(LIBRARY_MODELS)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if "base" in n else n
                                  for n in LIBRARY_MODELS])      # the base widths in the slow tier
def test_every_registered_model_pickles(name):
    model = timm.create_model(name, **SMALL).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
        for copy in _round_trips(model):
            assert torch.equal(copy(x), want)
            assert [type(m) for m in copy.modules()] == [type(m) for m in model.modules()]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "default")
def test_options_survive_pickling(options):
    model = timm.create_model("dcvit_tiny", **SMALL, **options).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
        for copy in _round_trips(model):
            assert torch.equal(copy(x), want)
            assert [m.options for m in _layers(copy)] == [m.options for m in _layers(model)]
            assert [type(b.attn).__name__ for b in copy.blocks] == [type(b.attn).__name__ for b in model.blocks]


def test_pickled_model_trains_on():
    """A loaded copy is a working module: backward reaches every parameter."""
    model = pickle.loads(pickle.dumps(timm.create_model("dcvit_tiny", **SMALL)))
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
