"""The graph exports record (dcvit.export_core): batched MatMuls, no Einsum, no dcvit op, and
the reference core's values (float64: to rounding; float32: within the export tolerances),
for every ablation that changes the graph, masks and converted layers included."""
import pytest
import torch
from torch.export import Dim

import dcvit
from dcvit import export_core
from dcvit.fused import attention_impl
from dcvit.kernels import compose_cpu

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "is_exporting"),
                                reason="torch.export of a DCMHA layer needs torch >= 2.5")

ABLATIONS = {
    "default": {},
    "pre_only": dict(post_compose=False),
    "post_only": dict(pre_compose=False),
    "query_wise_only": dict(key_wise=False),
    "key_wise_only": dict(query_wise=False),
    "static_proj": dict(static_proj=True, static_init="normal"),
    "static_key_wise_only": dict(static_proj=True, static_init="normal", query_wise=False),
    "static_only": dict(static_proj=True, static_init="normal", dynamic_proj=False, dynamic_gate=False),
    "no_gate": dict(dynamic_gate=False),
    "gate_only": dict(dynamic_proj=False),
    "rank3_gelu_tanh": dict(rank=3, dynamic_act="gelu_tanh"),
}


def _layer(dtype=torch.float64, **options):
    torch.manual_seed(0)
    layer = dcvit.DCMHA(48, 6, **options).to(dtype).eval()
    with torch.no_grad():                     # far from the near-identity init: every term counts
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def _targets(program):
    """Every op the program calls, inside its subgraphs (the per-sample scan's body) too."""
    return [str(n.target) for m in program.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function"]


def _export(module, args, dynamic_shapes=None):
    with torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes)


def _assert_engine_graph(program):
    targets = _targets(program)
    assert not [t for t in targets if "einsum" in t or "dcvit" in t], targets
    assert any("matmul" in t or "bmm" in t for t in targets), targets


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_exported_layer_is_matmuls_and_equals_the_reference_in_float64(name):
    layer = _layer(**ABLATIONS[name])
    program = _export(layer, (torch.randn(2, 11, 48, dtype=torch.float64),),
                      dynamic_shapes=({0: Dim("batch", min=1, max=16)},))
    _assert_engine_graph(program)
    x = torch.randn(3, 11, 48, dtype=torch.float64)             # another batch than exported
    with torch.no_grad(), attention_impl("reference"):
        want = layer(x)                                         # the paper's einsums (dcvit.compose)
    torch.testing.assert_close(program.module()(x), want, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("name", ["default", "static_only", "key_wise_only", "post_only"])
def test_onnx_export_scans_the_batch_and_equals_the_reference_in_float64(name, monkeypatch):
    """In an ONNX export an unmasked layer makes its maps one sample at a time (a scan over
    the batch, ONNX's Scan): the same values as the reference, at any batch size."""
    layer = _layer(**ABLATIONS[name])
    monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
    program = _export(layer, (torch.randn(2, 11, 48, dtype=torch.float64),),
                      dynamic_shapes=({0: Dim("batch", min=1, max=16)},))
    _assert_engine_graph(program)
    assert _scans(program) == export_core._onnx_exports_scan()
    monkeypatch.undo()
    x = torch.randn(3, 11, 48, dtype=torch.float64)
    with torch.no_grad(), attention_impl("reference"):
        want = layer(x)
    torch.testing.assert_close(program.module()(x), want, rtol=1e-11, atol=1e-11)


def test_onnx_exporter_without_scan_gets_the_batched_graph(monkeypatch):
    """An ONNX exporter that cannot convert a scan (older torch) gets the batched graph."""
    layer = _layer()
    monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
    monkeypatch.setattr(export_core, "_onnx_exports_scan", lambda: False)
    program = _export(layer, (torch.randn(2, 11, 48, dtype=torch.float64),))
    _assert_engine_graph(program)
    assert not _scans(program)


def _scans(program) -> bool:
    return "scan" in [t.split(".")[-1] for t in _targets(program)]


@pytest.mark.parametrize("mask_kind", ["bool", "float", "causal"])
def test_exported_layer_with_masks_equals_the_reference(mask_kind):
    layer = _layer()
    x = torch.randn(2, 11, 48, dtype=torch.float64)
    if mask_kind == "causal":
        args, kwargs = (x,), {"is_causal": True}
    else:
        mask = torch.rand(2, 1, 11, 11) > 0.3 if mask_kind == "bool" else torch.randn(2, 6, 11, 11, dtype=torch.float64)
        args, kwargs = (x, mask), {}
    with torch.no_grad():
        program = torch.export.export(layer, args, kwargs)
        _assert_engine_graph(program)
        with attention_impl("reference"):
            want = layer(*args, **kwargs)
        torch.testing.assert_close(program.module()(*args, **kwargs), want, rtol=1e-11, atol=1e-11)


def test_forced_cores_under_export_keep_their_graph():
    """attention_impl("reference") exports the paper's graph (Einsum); "cpp" keeps the C++
    custom op in the program (for AOTInductor packages that run with dcvit imported)."""
    layer = _layer(torch.float32)
    x = torch.randn(2, 11, 48)
    with attention_impl("reference"):
        assert any("einsum" in t for t in _targets(_export(layer, (x,))))
    if compose_cpu.available():
        with attention_impl("cpp"):
            assert any("dcvit.composed_attention" in t for t in _targets(_export(layer, (x,))))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["eva02", "swin"])
def test_converted_layers_export_the_same_formulation(family):
    """Converted layers share DCMHA's core: rotary EVA and Swin's windows with their additive
    bias and shifted-window mask export without Einsum and equal the reference in float64."""
    from test_conversion import build, sample
    model = dcvit.convert(build(family), init="paper").to(torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in ("dynamic_weights", "compose")):
                p.normal_(0, 0.3)
    x = sample(family, model).to(torch.float64)
    program = _export(model, (x,))
    _assert_engine_graph(program)
    with torch.no_grad(), attention_impl("reference"):
        want = model(x)
    torch.testing.assert_close(program.module()(x), want, rtol=1e-10, atol=1e-10)


@pytest.mark.slow
def test_dcvit_bench_onnx_exports_both_formulations_and_times_them(tmp_path):
    """`dcvit-bench --onnx --onnx-before` on a one-block model: the DCViT file holds no
    Einsum, the reference one does, and every batch gets its medians and ratios."""
    import json
    from dcvit.bench import benchmark
    path = tmp_path / "onnx.json"
    benchmark.run(["--onnx", "--onnx-before", "--depth", "1", "--img-size", "32", "--steps", "1",
                   "--onnx-batches", "1,3", "--json", str(path)])
    result = json.loads(path.read_text())["onnx"]
    exports = result["exports"]
    assert exports["dcvit"]["ops"].get("Einsum", 0) == 0 and exports["dcvit"]["ops"]["MatMul"] > 0
    assert exports["dcvit_reference"]["ops"]["Einsum"] == 8        # the paper's Compose, one block (its
    # dynamic weights' second projection is a batched GEMM: a MatMul)
    assert exports["vit"]["ops"].get("Einsum", 0) == 0
    for b in ("b1", "b3"):
        fig = result["figures"][b]
        assert fig["ratio"] == pytest.approx(fig["vit_ms"] / fig["dcvit_ms"])
        assert fig["ratio_best"] == pytest.approx(fig["vit_best_ms"] / fig["dcvit_best_ms"])
        assert fig["ratio_reference"] > 0


def test_exported_models_are_timed_in_turn_each_after_the_settle_pause(monkeypatch):
    """Timed runs alternate (order reversed every other round), each after `SETTLE_S`, so that
    one session's spinning threads do not run into the other's timing; a figure carries the
    median and best-run ratios."""
    import time
    from dcvit.bench import export as export_bench
    monkeypatch.setattr(export_bench, "SETTLE_S", 0.02)
    calls = []
    runs = {name: (lambda name=name: calls.append((name, time.perf_counter()))) for name in ("vit", "dcvit")}
    timed = export_bench._timed(runs, warmup=1, steps=4)
    calls = calls[2:]                                                 # after the warm-up
    assert [n for n, _ in calls] == ["vit", "dcvit", "dcvit", "vit"] * 2
    assert min(b - a for (_, a), (_, b) in zip(calls, calls[1:])) >= 0.02
    fig = export_bench._figure(timed)
    assert fig["ratio"] == pytest.approx(fig["vit_ms"] / fig["dcvit_ms"])
    assert fig["ratio_best"] == pytest.approx(fig["vit_best_ms"] / fig["dcvit_best_ms"])
    assert fig["dcvit_best_ms"] <= fig["dcvit_ms"] and fig["vit_best_ms"] <= fig["vit_ms"]


def test_dcvit_bench_rejects_bad_onnx_batches():
    from dcvit.bench import benchmark
    with pytest.raises(SystemExit, match="--onnx-batches"):
        benchmark.run(["--onnx", "--onnx-batches", "1,x"])
