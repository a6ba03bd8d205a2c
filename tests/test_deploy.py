"""A DCViT through the tools that deploy or inspect timm models: FX (bit-equal to eager),
torch.export, ONNX (checked with onnxruntime), TorchScript scripting and tracing."""
import inspect

import numpy as np
import pytest
import timm
import torch
from timm.models import create_feature_extractor as timm_feature_extractor
from timm.models import FeatureGraphNet, get_graph_node_names
from torch.fx import symbolic_trace
from torchvision.models.feature_extraction import create_feature_extractor

import dcvit  # noqa: F401  (registers the models)
from dcvit import fused

DEFAULTS = ["dcvit_tiny", "dcvit_small"]
SMALL = dict(img_size=32, depth=2)


def _model(name="dcvit_tiny", **kwargs):
    torch.manual_seed(0)
    return timm.create_model(name, **{**SMALL, "num_classes": 7, **kwargs})


def _grads(model, x):
    """Output and the gradients of its sum w.r.t. the input and every parameter (by name: a
    traced graph may hold the parameters in another order)."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    params = [p for _, p in sorted(model.named_parameters()) if p.requires_grad]
    return out, torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(),
                                    [x, *params])


def _assert_bit_equal(a, b):
    assert a.shape == b.shape and torch.equal(a, b), f"max |diff| = {(a - b).abs().max().item()}"


def _relative(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return np.abs(got - want).max() / np.abs(want).max()


# --------------------------------------------------------------------------------- FX

@pytest.mark.parametrize("name", DEFAULTS)
def test_fx_symbolic_trace_is_bit_equal_to_eager(name):
    """The traced graph runs the same attention core as eager (the fast core on CPU)."""
    model = _model(name).train()                          # no dropout: deterministic
    x = torch.randn(2, 3, 32, 32)
    graph = symbolic_trace(model)
    assert fused.select_impl("auto", x)[0] != "reference"    # eager runs a fast core here
    cores = [n for n in graph.graph.nodes if n.op == "call_function" and n.target.__name__ == "run_core"]
    assert len(cores) == 2                                # one call per DCMHA block
    out, grads = _grads(model, x)
    fx_out, fx_grads = _grads(graph, x)
    _assert_bit_equal(fx_out, out)
    assert len(grads) == len(fx_grads)
    for a, b in zip(fx_grads, grads):
        _assert_bit_equal(a, b)


@pytest.mark.parametrize("name", DEFAULTS)
def test_feature_extractors_are_bit_equal_to_eager(name):
    """torchvision's and timm's FX feature extraction, and features_only with feature_cls='fx'."""
    model = _model(name).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        tv = create_feature_extractor(model, {"head": "out"})
        _assert_bit_equal(tv(x)["out"], out)
        _, nodes = get_graph_node_names(model)
        assert "blocks.0.attn" in nodes                   # timm's tracer keeps DCMHA as one node
        tm = timm_feature_extractor(model, {"blocks.1.attn": "attn", nodes[-1]: "out"})
        feats = tm(x)
        _assert_bit_equal(feats["out"], out)
        block = model.blocks[1]
        seen = []
        handle = block.attn.register_forward_hook(lambda m, i, o: seen.append(o))
        model(x)
        handle.remove()
        _assert_bit_equal(feats["attn"], seen[0])
    fx_feats = FeatureGraphNet(model, out_indices=(0, 1))  # what features_only + feature_cls="fx" builds
    blocks = []
    hooks = [model.blocks[i].register_forward_hook(lambda m, i, o: blocks.append(o)) for i in (0, 1)]
    with torch.no_grad():
        feats = fx_feats.eval()(x)
        model(x)
    for h in hooks:
        h.remove()
    assert len(feats) == 2
    for a, b in zip(feats, blocks):
        _assert_bit_equal(a, b)


def test_fvcore_counts_on_the_reference_graph():
    """fvcore traces with torch.jit.trace: the reference core, whose ops it counts."""
    from fvcore.nn import FlopCountAnalysis
    model = _model().eval()
    flops = FlopCountAnalysis(model, torch.randn(1, 3, 32, 32))
    flops.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    assert flops.by_module()["blocks.0.attn.core.pre_compose"] > 0


# ---------------------------------------------------------------------- TorchScript

def test_torchscript_scripting_and_tracing_match_eager():
    from timm.layers import set_scriptable
    with set_scriptable(True):
        model = _model().eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        scripted = torch.jit.script(model)
        traced = torch.jit.trace(model, x)
        for other in (scripted, traced):
            assert _relative(other(x), out) < 1e-5
            assert _relative(other(x[:1]), out[:1]) < 1e-5


# --------------------------------------------------------------------------- export

@pytest.mark.skipif(not hasattr(torch.compiler, "is_exporting"),
                    reason="torch.export of a DCViT needs torch >= 2.5 (2.4's exporter rejects the fast core's autocast block)")
def test_torch_export_reruns_and_matches():
    """The exported program (dcvit.export_core's formulation) equals eager (the fast core)."""
    model = _model(rank=1, dcmha_layers=[1]).eval()
    x = torch.randn(2, 3, 32, 32)
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("dcvit" in t for t in targets), targets       # standard ops only
    assert not any("einsum" in t for t in targets), targets      # dcvit.export_core: MatMuls
    with torch.no_grad():
        for b in (2, 5):
            xb = torch.randn(b, 3, 32, 32)
            assert _relative(program.module()(xb), model(xb)) < 1e-5


def _onnx_export(model, x, path):
    """The default exporter of the installed torch, with a dynamic batch dimension; True when
    that is the torch.export-based one (the TorchScript exporter traces the reference core)."""
    params = inspect.signature(torch.onnx.export).parameters
    if "dynamic_shapes" in params and params["dynamo"].default is not False:
        torch.onnx.export(model, (x,), str(path), input_names=["x"], dynamic_shapes=({0: "batch"},))
        return True
    torch.onnx.export(model, (x,), str(path), input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    return False


@pytest.mark.slow
def test_onnx_export_runs_in_onnxruntime(tmp_path):
    import onnxruntime as ort
    from dcvit.bench.export import onnx_ops
    model = _model().eval()
    path = tmp_path / "dcvit.onnx"
    if _onnx_export(model, torch.randn(2, 3, 32, 32), path):
        ops = onnx_ops(path)
        assert ops["MatMul"] and "Einsum" not in ops, ops       # dcvit.export_core's graph
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b in (2, 5):                                      # the exported batch and another
        x = torch.randn(b, 3, 32, 32)
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        with torch.no_grad():
            assert _relative(got, model(x).numpy()) < 1e-5
