"""Every fast attention core of DCMHA equals the reference `compose` formulation.

The reference is DCMHA's ``reference`` core (one `Compose` call per stage, `dcvit.compose`
maths); the fast cores are checked against it in float64 (outputs, input gradients and the
gradient of every parameter), against finite differences (gradcheck), and under the
conditions the model meets in use: masks, causal attention, dropout, bf16 autocast,
TorchScript, FX and torch.compile. The Triton core has its own file, tests/test_triton_core.py.
"""
import os

import pytest
import timm
import torch

import dcvit
from dcvit import compose, fused
from dcvit import matrices
from dcvit.fused import attention_impl
from dcvit.matrices import ComposeMatrices, mix
from dcvit.kernels import compose_cpu

HAS_CPP = compose_cpu.load()
FAST_IMPLS = ["compile"] + (["cpp"] if HAS_CPP else [])

OPTIONS = [
    dict(),
    dict(static_proj=True),
    dict(pre_compose=False),
    dict(post_compose=False),
    dict(query_wise=False),
    dict(key_wise=False, rank=1),
    dict(dynamic_proj=False),
    dict(dynamic_gate=False, rank=4),
    dict(dynamic_proj=False, dynamic_gate=False, static_proj=True),
    dict(pre_compose=False, key_wise=False, static_proj=True),
]


def _layer(dim=24, heads=3, dtype=torch.float64, seed=0, std=0.3, **options):
    """A DCMHA whose dynamic weights and static matrices are far from their near-zero init."""
    torch.manual_seed(seed)
    layer = dcvit.DCMHA(dim, heads, qkv_bias=True, **options).to(dtype)
    with torch.no_grad():
        if layer.core.dynamic_weights is not None:
            for p in layer.core.dynamic_weights.parameters():
                p.normal_(0, std)
        for stage in (layer.core.pre_compose, layer.core.post_compose):
            if stage is not None and stage.static is not None:
                stage.static.normal_(0, std)
    return layer


def _run(layer, x, impl, **kwargs):
    """Output, input gradient and parameter gradients of ``layer`` under core ``impl``."""
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with attention_impl(impl):
        y = layer(x, **kwargs)
    weight = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
    (y * weight).sum().backward()
    grads = {n.replace("_orig_mod.", ""): p.grad.detach().clone()
             for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), x.grad.detach(), grads


def _assert_same(ref, out, atol, rtol=0.0):
    torch.testing.assert_close(out[0], ref[0], atol=atol, rtol=rtol)
    torch.testing.assert_close(out[1], ref[1], atol=atol, rtol=rtol)
    assert set(out[2]) == set(ref[2]), set(out[2]) ^ set(ref[2])
    for name in ref[2]:
        torch.testing.assert_close(out[2][name], ref[2][name], atol=atol, rtol=rtol, msg=name)


# ----------------------------------------------------------------- compose matrices

def compose_matrices(num_heads, qw1, qw2, kw1, kw2, qdd, kdd, static, dtype):
    """One Compose stage's arguments merged into per-token H×H matrices (float64 formula):
    mq = I + static + qw1^T qw2 + diag(qdd) (B, T, H, H), mk = kw1^T kw2 + diag(kdd) (B, S, H, H)."""
    mq = torch.eye(num_heads, dtype=dtype).view(1, 1, num_heads, num_heads)
    if static is not None:
        mq = mq + static
    if qw1 is not None:
        mq = mq + torch.einsum("btrg,btrh->btgh", qw1, qw2)
    if qdd is not None:
        mq = mq + torch.diag_embed(qdd)
    mk = None
    if kw1 is not None:
        mk = torch.einsum("bsrg,bsrh->bsgh", kw1, kw2)
    if kdd is not None:
        mk = torch.diag_embed(kdd) if mk is None else mk + torch.diag_embed(kdd)
    return mq, mk


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("branches", ["all", "query", "key", "gates", "static"])
def test_merged_matrices_equal_compose(rank, branches):
    g = torch.Generator().manual_seed(rank)
    B, H, T, S = 2, 5, 4, 7                                                  # T != S
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)        # noqa: E731
    a = r(B, H, T, S)
    args = dict(qw1=r(B, T, rank, H), qw2=r(B, T, rank, H), kw1=r(B, S, rank, H),
                kw2=r(B, S, rank, H), qdd=r(B, T, H), kdd=r(B, S, H), static=r(H, H))
    drop = {"all": [], "query": ["kw1", "kw2", "kdd", "static"], "key": ["qw1", "qw2", "qdd"],
            "gates": ["qw1", "qw2", "kw1", "kw2"], "static": ["qw1", "qw2", "kw1", "kw2", "qdd", "kdd"]}
    for name in drop[branches]:
        args[name] = None
    mq, mk = compose_matrices(H, args["qw1"], args["qw2"], args["kw1"], args["kw2"], args["qdd"],
                              args["kdd"], args["static"], torch.float64)
    expected = compose(a, **args)
    query_major = mix(a.transpose(1, 2), mq, mk).transpose(1, 2)             # mix: (B, T, H, S)
    torch.testing.assert_close(query_major, expected, atol=1e-12, rtol=0)
    one_sample = mix(a[1].transpose(0, 1), mq[min(1, mq.shape[0] - 1)], None if mk is None else mk[1])
    torch.testing.assert_close(one_sample.transpose(0, 1), expected[1], atol=1e-12, rtol=0)


@pytest.mark.parametrize("options,slots", [
    (dict(), (0, 1, 2, 3)),
    (dict(pre_compose=False), (None, None, 0, 1)),
    (dict(query_wise=False), (None, 0, None, 1)),
    (dict(post_compose=False, key_wise=False), (0, None, None, None)),
    (dict(dynamic_proj=False, dynamic_gate=False, static_proj=True), (None, None, None, None)),
])
def test_compose_slots_follow_the_options(options, slots):
    """One ComposeSlots per layer: the slot of each (stage, side) on the dynamic weights' axis,
    and the plain fields the forward reads, taken from it once at construction."""
    layer = dcvit.DCMHA(24, 3, **options)
    assert tuple(layer.core.slots) == slots
    count = 0 if layer.core.dynamic_weights is None else layer.core.dynamic_weights.num_slots
    assert layer.core.slots.count == count == sum(s is not None for s in slots)
    assert layer.core.slots.stage("post") == slots[2:]
    assert layer.core.slots.query_slots == [s for s in (slots[0], slots[2]) if s is not None]
    assert (layer.core.pre_slots, layer.core.post_slots) == (slots[:2], slots[2:])
    assert layer.core.identity_slots == layer.core.slots.query_slots


# ------------------------------------------------------------------- layer vs reference

@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_fast_core_equals_reference_float64(impl, options):
    layer = _layer(**options)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    _assert_same(_run(layer, x, "reference"), _run(layer, x, impl), atol=1e-10)


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("mask_kind", ["bool", "float", "causal", "float_broadcast"])
def test_fast_core_masks(impl, mask_kind):
    layer = _layer()
    B, N = 2, 7
    x = torch.randn(B, N, 24, dtype=torch.float64)
    kwargs = {}
    if mask_kind == "bool":
        keep = torch.rand(B, 1, N, N, generator=torch.Generator().manual_seed(3)) > 0.4
        keep[..., 0] = True                                                  # no empty row
        kwargs["attn_mask"] = keep
    elif mask_kind == "float":
        kwargs["attn_mask"] = torch.randn(B, 3, N, N, dtype=torch.float64)
    elif mask_kind == "float_broadcast":
        kwargs["attn_mask"] = torch.randn(N, N, dtype=torch.float64)
    else:
        kwargs["is_causal"] = True
    _assert_same(_run(layer, x, "reference", **kwargs), _run(layer, x, impl, **kwargs), atol=1e-10)


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_fast_core_float32(impl):
    layer = _layer(dim=384, heads=6, dtype=torch.float32, std=0.05)
    x = torch.randn(2, 30, 384)
    _assert_same(_run(layer, x, "reference"), _run(layer, x, impl), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", ["auto", "compile"])
def test_fast_core_dropout_in_training(impl):
    """Dropout on the weights needs the weights themselves: ``auto`` runs ``compile``
    (weights, dropout, then @ v), the same masks as the reference core draws."""
    layer = _layer(attn_drop=0.3).train()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    torch.manual_seed(11)
    ref = _run(layer, x, "reference")
    torch.manual_seed(11)
    out = _run(layer, x, impl)
    _assert_same(ref, out, atol=1e-10)
    torch.manual_seed(12)
    other = _run(layer, x, impl)
    assert not torch.allclose(other[0], out[0]), "dropout had no effect in training mode"


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_fast_core_bf16_autocast(impl):
    layer = _layer(dim=64, heads=4, dtype=torch.float32)
    x = torch.randn(2, 17, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _run(layer, x, "reference")
        out = _run(layer, x, impl)
    assert out[0].dtype == ref[0].dtype
    scale = ref[0].abs().max().item()
    torch.testing.assert_close(out[0].float(), ref[0].float(), atol=0.05 * scale, rtol=0)
    gscale = ref[1].abs().max().item()
    torch.testing.assert_close(out[1].float(), ref[1].float(), atol=0.05 * gscale, rtol=0)


def test_function_gradcheck_against_finite_differences():
    """The C++ core's recomputing backward and the compile core (also returning the weights)
    against finite differences."""
    g = torch.Generator().manual_seed(0)
    B, H, N, D = 1, 3, 5, 4
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    q, k, v = r(B, H, N, D), r(B, H, N, D), r(B, H, N, D)
    mq1, mk1, mq2, mk2 = r(B, N, H, H), r(B, N, H, H), r(1, 1, H, H), r(B, N, H, H)
    mask = torch.randn(1, 1, N, N, generator=g, dtype=torch.float64)
    cores = [lambda *a: fused.composed_attention(*a, "cpp")] if HAS_CPP else []
    cores += [lambda q, k, v, *a: fused.composed_attention_compile(q, k, v, *a),
              lambda q, k, v, *a: fused.composed_attention_compile(q, k, None, *a)]
    for core in cores:
        def f(q, k, v, mq1, mk1, mq2, mk2):
            return core(q, k, v, mask, ComposeMatrices(mq1, mk1, mq2, mk2))
        assert torch.autograd.gradcheck(f, (q, k, v, mq1, mk1, mq2, mk2), atol=1e-7, fast_mode=True)


@pytest.mark.skipif(not HAS_CPP, reason="C++ kernel not built here")
@pytest.mark.parametrize("rank,with_gate", [(1, True), (2, True), (3, False)])
def test_cpp_slot_matrices_equal_formula(rank, with_gate):
    """The one-pass matrix builder == RMS norm + outer products + gates + identity (float64),
    and its backward passes gradcheck."""
    g = torch.Generator().manual_seed(rank)
    B, N, G, H = 2, 5, 4, 3
    w = torch.randn(B, N, G, 2 * rank, H, generator=g, dtype=torch.float64, requires_grad=True)
    dd = torch.randn(B, N, G, H, generator=g, dtype=torch.float64, requires_grad=True) if with_gate else None
    identity = [0, 2]
    w1, w2 = w.split(rank, dim=-2)
    w1n = w1 / torch.sqrt((w1 ** 2).mean(-1, keepdim=True) + matrices.RMS_EPS)
    want = torch.einsum("bngrh,bngrk->bnghk", w1n, w2)
    eye = torch.eye(H, dtype=torch.float64)
    want = want + torch.stack([eye * (g_ in identity) for g_ in range(G)]).view(1, 1, G, H, H)
    if dd is not None:
        want = want + torch.diag_embed(dd)
    got = matrices.slot_matrices_from_projections(w, dd, identity, torch.float64, cpp=True)
    assert "dcvit_slot_matrices" in type(got.grad_fn).__name__                  # the C++ op ran
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    inputs = (w, dd) if dd is not None else (w,)
    assert torch.autograd.gradcheck(
        lambda *a: matrices.slot_matrices_from_projections(a[0], a[1] if len(a) > 1 else None, identity,
                                                        torch.float64, cpp=True), inputs)


@pytest.mark.skipif(not HAS_CPP, reason="C++ kernel not built here")
def test_more_heads_than_the_cpp_kernel_holds():
    """More heads than the kernel's accumulators (64): ``auto`` says so and runs ``compile``
    (equal to the reference), a forced ``cpp`` and the kernel itself refuse with the reason."""
    H = compose_cpu.MAX_HEADS + 1
    q = torch.zeros(1, H, 3, 2)
    assert fused.select_impl("auto", q) == ("compile", f"{H} heads, more than the C++ kernels' {H - 1}")
    with pytest.raises(ValueError, match="'cpp' cannot run here: 65 heads"):
        fused.select_impl("cpp", q)
    with pytest.raises(ValueError, match=f"up to {H - 1} heads, got {H}; use the 'compile' core"):
        fused.composed_attention(q, q, q, None, ComposeMatrices(None, None, None, None), "cpp")
    layer = _layer(dim=2 * H, heads=H, std=0.05)
    x = torch.randn(1, 3, 2 * H, dtype=torch.float64)
    _assert_same(_run(layer, x, "reference"), _run(layer, x, "auto"), atol=1e-9, rtol=1e-9)


@pytest.mark.skipif(not HAS_CPP, reason="C++ kernel not built here")
def test_strided_qkv_equal_contiguous():
    """q, k, v as views of the qkv projection and a transposed incoming gradient (the layouts
    DCMHA passes, read by the kernel on their strides without copies) give the results of
    contiguous copies."""
    g = torch.Generator().manual_seed(4)
    B, H, N, D = 5, 3, 9, 4
    qkv = torch.randn(B, N, 3, H, D, generator=g, dtype=torch.float64)
    mats = [torch.randn(B, N, H, H, generator=g, dtype=torch.float64) for _ in range(4)]
    grad = torch.randn(B, N, H, D, generator=g, dtype=torch.float64).transpose(1, 2)
    results = []
    for layout in (lambda t: t, torch.Tensor.contiguous):
        leaf = qkv.clone().requires_grad_()
        q, k, v = (layout(t) for t in leaf.permute(2, 0, 3, 1, 4).unbind(0))
        out = fused.composed_attention(q, k, v, None, ComposeMatrices(*mats), "cpp", 0.5)
        results.append((out, *torch.autograd.grad(out, leaf, layout(grad))))
    assert not qkv.permute(2, 0, 3, 1, 4)[0].is_contiguous()
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.skipif(not HAS_CPP, reason="C++ kernel not built here")
@pytest.mark.parametrize("B,H,N,D,threads", [
    (3, 4, 13, 20, 2),     # head dim not a multiple of the GEMM's 16 (8 in float64) columns
    (1, 3, 25, 8, 2),      # fewer batch elements than threads: forward splits the queries
    pytest.param(1, 16, 300, 8, 1,  # a tile over its budget: blocks of queries, key grads summed over them
                 marks=pytest.mark.slow),
])
def test_fused_cpp_core_equals_compile_core(B, H, N, D, threads):
    """The C++ kernel's whole core (its own GEMMs, tiles of queries, output written as
    (B, T, H, D)) gives the plain-PyTorch core's outputs and every gradient in float64."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, N, 3, H, D, generator=g, dtype=torch.float64)
    mats = [torch.randn(B, N, H, H, generator=g, dtype=torch.float64) * 0.3 for _ in range(4)]
    mask = torch.where(torch.rand(B, 1, N, N, generator=g) > 0.2, 0.0, float("-inf")).double()
    mask[..., 0] = 0.0
    up = torch.randn(B, N, H * D, generator=g, dtype=torch.float64)
    calls, ran = [], {}
    results = {}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for impl in ("cpp", "compile"):
            leaves = [qkv.clone().requires_grad_(), *(m.clone().requires_grad_() for m in mats)]
            q, k, v = leaves[0].permute(2, 0, 3, 1, 4).unbind(0)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                if impl == "cpp":
                    out = fused.composed_attention(q, k, v, mask, ComposeMatrices(*leaves[1:]), impl, 0.4)
                    calls.append(out.transpose(1, 2).is_contiguous())
                else:
                    out = fused.composed_attention_compile(q, k, v, mask, ComposeMatrices(*leaves[1:]), 0.4)
                merged = out.transpose(1, 2).reshape(B, N, H * D)
                results[impl] = (out, *torch.autograd.grad(merged, leaves, up))
            ran[impl] = sorted({e.name for e in prof.events() if e.name.startswith("dcvit_cpu::")})
    finally:
        torch.set_num_threads(previous)
    assert calls == [True]                          # heads merge without a copy
    assert ran == {"cpp": ["dcvit_cpu::attention_backward", "dcvit_cpu::attention_forward"], "compile": []}
    for a, b in zip(results["cpp"], results["compile"]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.skipif(not HAS_CPP, reason="C++ kernel not built here")
def test_cpp_backward_computes_only_the_wanted_matrix_gradients():
    """``want`` leaves a matrix gradient out of the kernel's work: it comes back empty, and
    every other gradient is bit-equal to the one computed with all four wanted; through
    autograd, a matrix that needs no gradient gets none asked of the kernel."""
    g = torch.Generator().manual_seed(7)
    B, H, N, D = 2, 3, 11, 8
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    mats = [torch.randn(B, N, H, H, generator=g, dtype=torch.float64) * 0.3 for _ in range(4)]
    grad = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    backward = torch.ops.dcvit_cpu.attention_backward
    full = backward(grad, q, k, v, None, *mats, 0.4, [True] * 4)
    assert all(t.numel() > 0 for t in full)
    for bits in range(16):
        want = [bool(bits >> i & 1) for i in range(4)]
        got = backward(grad, q, k, v, None, *mats, 0.4, want)
        for i, (a, b) in enumerate(zip(got, full)):
            if i >= 3 and not want[i - 3]:
                assert a.numel() == 0, (want, i)
            else:
                assert torch.equal(a, b), (want, i)

    seen = []
    spy = lambda *args: seen.append(list(args[-1])) or fused._cpp_backward(*args)   # noqa: E731
    leaves = [m.clone().requires_grad_(i % 2 == 1) for i, m in enumerate(mats)]   # key-wise only
    qq = q.clone().requires_grad_()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(fused._CORES, ("cpu", "cpp"), fused._Core(fused._cpp_forward, spy, None))
        out = fused.composed_attention(qq, k, v, None, ComposeMatrices(*leaves), "cpp", 0.4)
        dq, dk1, dk2 = torch.autograd.grad(out, [qq, leaves[1], leaves[3]], grad)
    assert seen == [[False, True, False, True]]
    for a, b in zip((dq, dk1, dk2), (full[0], full[4], full[6])):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


# ------------------------------------------------------------------------- dispatch

def test_auto_dispatch_and_forcing():
    layer = _layer(dtype=torch.float32)
    x = torch.zeros(1, 3, 5, 8)                                               # q (B, H, N, D)
    assert fused.select_impl("auto", x) == (("cpp", "CPU: the C++ kernels") if HAS_CPP else
                                            ("compile", fused._refuses("cpp", x, False, None)))
    assert fused.select_impl("compile", x) == ("compile", "forced")
    with attention_impl("reference"):
        assert fused.select_impl("compile", x) == ("reference", "forced")
        with attention_impl("auto"):
            assert fused.select_impl("compile", x) == ("compile", "forced")
    with pytest.raises(ValueError, match="unknown DCMHA attention implementation 'fast'"):
        with attention_impl("fast"):
            pass
    with pytest.raises(ValueError, match="unknown DCMHA attention implementation 'torch'; choose one of"):
        fused.select_impl("torch", x)
    layer.core.attn_impl = "nope"
    with pytest.raises(ValueError, match="'nope'"):
        layer(torch.randn(1, 5, 24))


@pytest.mark.skipif(not HAS_CPP, reason="C++ kernel not built here")
def test_what_no_kernel_takes_runs_compile_and_a_forced_kernel_refuses():
    """The weights themselves (attention dropout in training) and a mask that requires grad:
    ``auto`` picks ``compile`` and says why; a forced kernel raises with the same reason."""
    x = torch.zeros(1, 3, 5, 8)
    mask = torch.zeros(5, 5, requires_grad=True)
    assert fused.select_impl("auto", x, weights=True) == (
        "compile", "the attention weights themselves are needed (attention dropout in training)")
    assert fused.select_impl("auto", x, mask=mask)[0] == "compile"
    assert fused.select_impl("auto", x, mask=mask.detach())[0] == "cpp"
    with pytest.raises(ValueError, match="'cpp' kernels do not return the attention weights"):
        fused.select_impl("cpp", x, weights=True)
    with pytest.raises(ValueError, match="mask requires grad"):
        fused.select_impl("cpp", x, mask=mask)
    assert "run on CPU tensors, got meta" in fused._refuses("cpp", x.to("meta"), False, None)
    with pytest.raises(RuntimeError, match="no 'nope' attention kernels for cpu tensors"):
        fused._attention_op(x, x, x, None, None, None, None, None, "nope", 1.0)
    layer = _layer(attn_drop=0.3).train()
    with pytest.raises(ValueError, match="'cpp' cannot run here"), attention_impl("cpp"):
        layer(torch.randn(1, 5, 24, dtype=torch.float64))
    # A mask that requires grad gets its gradient (the reference's) on the auto core.
    layer = _layer()
    xs = torch.randn(2, 5, 24, dtype=torch.float64)
    grads, m0 = [], torch.randn(2, 3, 5, 5, dtype=torch.float64)
    for impl in ("reference", "auto"):
        m = m0.clone().requires_grad_()
        with attention_impl(impl):
            layer(xs, attn_mask=m).square().sum().backward()
        grads.append(m.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-10, rtol=0)


@pytest.mark.skipif(not HAS_CPP, reason="C++ kernel not built here")
def test_register_core_plugs_a_device_kernel_into_the_ops(monkeypatch):
    """A core's kernels registered for a device (as a CUDA kernel would be) run under the
    custom ops' shared autograd."""
    calls = []

    def forward(*args):
        calls.append("forward")
        return fused._cpp_forward(*args)

    def backward(*args):
        calls.append("backward")
        return fused._cpp_backward(*args)

    layer = _layer()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    ref = _run(layer, x, "reference")
    monkeypatch.setitem(fused._CORES, ("cpu", "cpp"), fused._Core(forward, backward, None))
    out = _run(layer, x, "cpp")
    assert calls == ["forward", "backward"]
    _assert_same(ref, out, atol=1e-10)


@pytest.mark.skipif(not HAS_CPP, reason="C++ kernel not built here")
def test_register_core_carries_a_cores_statistics(monkeypatch):
    """A core that keeps statistics from forward (as the Triton core keeps the row
    log-sum-exp) gets them back in backward, through eager autograd, opcheck's fake-tensor
    rule and a torch.compile graph."""
    seen = []

    def forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale):
        out, _ = fused._cpp_forward(q, k, v, mask, mq1, mk1, mq2, mk2, scale)
        return out, torch.logsumexp(scale * q @ k.transpose(-1, -2), dim=-1).float()

    def backward(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, scale, want):
        seen.append(stats)
        return fused._cpp_backward(grad, q, k, v, mask, mq1, mk1, mq2, mk2, stats, scale, want)

    def stats(q, k, v):
        return q.new_empty(q.shape[:3], dtype=torch.float32)

    monkeypatch.setitem(fused._CORES, ("cpu", "cpp"), fused._Core(forward, backward, stats))
    B, N, H, D = 2, 5, 3, 4
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mats = [torch.randn(B, N, H, H, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    out, kept = fused._attention_op(q, k, v, None, *mats, "cpp", 0.5)
    want = torch.logsumexp(0.5 * q @ k.transpose(-1, -2), dim=-1).float()
    torch.testing.assert_close(kept, want)
    out.sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], kept)
    results = torch.library.opcheck(fused._attention_op, (q, k, v, None, *mats, "cpp", 0.5))
    assert set(results.values()) == {"SUCCESS"}, results

    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: fused.composed_attention(*a, "cpp", 0.5), fullgraph=True,
                             backend="aot_eager")
    seen.clear()
    compiled(q, k, v, None, ComposeMatrices(*mats)).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], kept)


@pytest.mark.skipif(not HAS_CPP, reason="C++ kernel not built here")
def test_a_core_without_statistics_gets_a_zero_size_tensor_back(monkeypatch):
    seen = []

    def backward(*args):
        seen.append(args[9])
        return fused._cpp_backward(*args)

    monkeypatch.setitem(fused._CORES, ("cpu", "cpp"), fused._Core(fused._cpp_forward, backward, None))
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    out, kept = fused._attention_op(q, q, q, None, None, None, None, None, "cpp", 1.0)
    assert kept.numel() == 0 and not kept.requires_grad
    out.sum().backward()
    assert len(seen) == 1 and seen[0].numel() == 0


def test_kernel_build_failure_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(compose_cpu, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("DCVIT_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert compose_cpu.load() is False
    assert fused.select_impl("auto", torch.zeros(1, 3, 5, 8)) == (
        "compile", "the C++ kernels are not built here (see the warning; DCVIT_NO_CPP_KERNEL)")
    layer = _layer(dtype=torch.float64)
    x = torch.randn(1, 5, 24, dtype=torch.float64)
    _assert_same(_run(layer, x, "reference"), _run(layer, x, "auto"), atol=1e-10)


def test_kernel_switch_off(monkeypatch, recwarn):
    monkeypatch.setattr(compose_cpu, "_state", {})
    monkeypatch.setenv("DCVIT_NO_CPP_KERNEL", "1")
    assert compose_cpu.load() is False
    assert not [w for w in recwarn if "could not be built" in str(w.message)]   # asked for: no warning


def test_kernel_cache_is_private_and_refuses_a_foreign_library(monkeypatch, tmp_path):
    """The cache directory is made 0700 (also when it existed wider), and a library file
    there that another user owns is refused, not loaded and not touched."""
    monkeypatch.setattr(compose_cpu, "_state", {})
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o755)
    monkeypatch.setenv("DCVIT_KERNEL_CACHE", str(cache))
    foreign = []
    for openmp in (True, False):
        build = cache / compose_cpu._library_name(openmp)
        build.mkdir(mode=0o700)
        (build / (build.name + ".so")).write_bytes(b"not a library")
        foreign.append(str(build / (build.name + ".so")))
    owner = compose_cpu._owner
    monkeypatch.setattr(compose_cpu, "_owner", lambda p: os.getuid() + 1 if p in foreign else owner(p))
    with pytest.warns(RuntimeWarning, match="refusing .*owned by uid"):
        assert compose_cpu.load() is False
    assert (os.stat(cache).st_mode & 0o777) == 0o700
    assert all(open(p, "rb").read() == b"not a library" for p in foreign)
    fresh = tmp_path / "fresh"
    assert compose_cpu._private_dir(str(fresh)) == str(fresh)
    assert (os.stat(fresh).st_mode & 0o777) == 0o700


def test_attention_maps_use_reference_core():
    model = timm.create_model("dcvit_tiny_patch16_224", img_size=32, patch_size=16, depth=2,
                              num_classes=0)
    for m in model.modules():
        if isinstance(m, dcvit.DCMHA):
            m.core.attn_impl = "compile"
    maps = dcvit.attention_maps(model, torch.randn(1, 3, 32, 32))
    assert len(maps) == 2 and maps[0]["scores_before"].shape == (1, 3, 5, 5)
    assert maps[0]["weights_after"].shape == (1, 3, 5, 5)


def test_torchscript_and_fx_match_fast_eager():
    """Scripted models run the reference core, FX-traced ones the eager core; both equal the
    fast eager model (FX bit-equal: tests/test_deploy.py)."""
    from timm.layers import set_scriptable
    from timm.models import create_feature_extractor, get_graph_node_names
    kwargs = dict(img_size=32, patch_size=16, depth=2, num_classes=5)
    with set_scriptable(True):
        model = timm.create_model("dcvit_tiny_patch16_224", **kwargs).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        eager = model(x)                                                     # auto: fast core
        scripted = torch.jit.script(model)
        torch.testing.assert_close(scripted(x), eager, atol=1e-5, rtol=1e-5)
        _, nodes = get_graph_node_names(model)
        assert "blocks.0.attn" in nodes, "timm's FX tracer keeps each DCMHA layer as one node"
        fx_model = create_feature_extractor(model, [nodes[-1]])
        torch.testing.assert_close(list(fx_model(x).values())[0], eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["auto", "compile"])
def test_torch_compile_fullgraph_matches_reference(impl):
    """No graph break: ``auto`` keeps the C++ core as a custom op (CPU), ``compile`` is the
    plain maths for inductor."""
    torch._dynamo.reset()
    layer = _layer(dtype=torch.float32)
    x = torch.randn(2, 7, 24)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    ref = _run(layer, x, "reference")
    out = _run(compiled, x, impl)
    _assert_same(ref, out, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_CPP, reason="C++ kernel not built here")
def test_torch_compile_keeps_the_cpp_kernels_as_ops():
    torch._dynamo.reset()
    layer = _layer(dtype=torch.float32)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(layer, fullgraph=True, backend=backend)(torch.randn(2, 7, 24))
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    for op in ("dcvit.composed_attention", "dcvit.slot_matrices"):
        assert any(op in t for t in targets), (op, targets)


@pytest.mark.skipif(not HAS_CPP, reason="C++ kernel not built here")
def test_custom_ops_pass_opcheck():
    """The core's custom op: schema, autograd registration, fake-tensor rule (shapes and
    strides of the real outputs) and AOT dispatch, as torch.library checks them."""
    B, N, H, D = 2, 9, 3, 8
    qkv = torch.randn(B, N, 3, H, D, requires_grad=True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    mats = [torch.randn(B, N, H, H, requires_grad=True) for _ in range(4)]
    results = torch.library.opcheck(fused._attention_op, (q, k, v, None, *mats, "cpp", 0.5, 7))
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.slow
def test_torch_compile_inductor_matches_reference():
    torch._dynamo.reset()
    layer = _layer(dtype=torch.float32)
    x = torch.randn(2, 7, 24)
    compiled = torch.compile(layer, fullgraph=True)
    _assert_same(_run(layer, x, "reference"), _run(compiled, x, "auto"), atol=1e-5, rtol=1e-5)


def test_jit_trace_selects_the_reference_core():
    """fvcore and torch.jit.trace record ops: the fast cores would hide them."""
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(fused.select_impl("auto", x)[0])
            return x * 2

    x = torch.randn(1, 3, 5, 8)
    torch.jit.trace(Probe(), x, check_trace=False)
    assert seen and set(seen) == {"reference"}
    assert fused.select_impl("auto", x)[0] != "reference"


@pytest.mark.parametrize("forced", ["layer", "context"])
def test_jit_trace_ignores_a_forced_fast_core(forced):
    """A forced core would be recorded as one opaque PythonOp; tracing takes the reference."""
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(fused.select_impl("compile" if forced == "layer" else "auto", x)[0])
            return x * 2

    x = torch.randn(1, 3, 5, 8)
    with attention_impl("compile" if forced == "context" else "auto"):
        torch.jit.trace(Probe(), x, check_trace=False)
        assert Probe()(x) is not None and seen[-1] == "compile"               # not tracing
    assert seen[:-1] and set(seen[:-1]) == {"reference"}

    torch.manual_seed(0)
    layer = dcvit.DCMHA(12, 3).eval()
    x = torch.randn(1, 5, 12)
    if forced == "layer":
        layer.core.attn_impl = "compile"
        traced = torch.jit.trace(layer, x, check_trace=False)
    else:
        with attention_impl("compile"):
            traced = torch.jit.trace(layer, x, check_trace=False)
    assert "PythonOp" not in str(traced.graph)
    torch.testing.assert_close(traced(x), layer(x), atol=1e-5, rtol=1e-5)
