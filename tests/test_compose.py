"""`dcvit.compose` against docs/spec.md §1.1, term by term, with an independent float64 formula."""
import itertools

import numpy as np
import pytest
import torch

from dcvit import compose

B, H, T, S = 2, 3, 4, 5


def naive_compose(a, qw1=None, qw2=None, kw1=None, kw2=None, qdd=None, kdd=None, static=None):
    """docs/spec.md §1.1 written as explicit loops over indices in NumPy float64."""
    a = a.double().numpy()
    np_ = lambda t: None if t is None else t.double().numpy()  # noqa: E731
    qw1, qw2, kw1, kw2, qdd, kdd, static = map(np_, (qw1, qw2, kw1, kw2, qdd, kdd, static))
    nb, nh, nt, ns = a.shape
    out = np.zeros_like(a)
    for b, h, t, s in itertools.product(range(nb), range(nh), range(nt), range(ns)):
        v = a[b, h, t, s]
        if qw1 is not None:
            for r in range(qw1.shape[2]):
                v += qw2[b, t, r, h] * sum(qw1[b, t, r, g] * a[b, g, t, s] for g in range(nh))
        if kw1 is not None:
            for r in range(kw1.shape[2]):
                v += kw2[b, s, r, h] * sum(kw1[b, s, r, g] * a[b, g, t, s] for g in range(nh))
        if qdd is not None:
            v += qdd[b, t, h] * a[b, h, t, s]
        if kdd is not None:
            v += kdd[b, s, h] * a[b, h, t, s]
        if static is not None:
            v += sum(static[g, h] * a[b, g, t, s] for g in range(nh))
        out[b, h, t, s] = v
    return torch.from_numpy(out)


def make_inputs(rank=2, dtype=torch.float64, t=T, s=S, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return dict(a=r(B, H, t, s), qw1=r(B, t, rank, H), qw2=r(B, t, rank, H),
                kw1=r(B, s, rank, H), kw2=r(B, s, rank, H), qdd=r(B, t, H), kdd=r(B, s, H))


BRANCHES = list(itertools.product([False, True], repeat=4))  # (query low-rank, key low-rank, qdd, kdd)


def select(inputs, q_lr, k_lr, q_gate, k_gate):
    out = dict(inputs)
    if not q_lr:
        out["qw1"] = out["qw2"] = None
    if not k_lr:
        out["kw1"] = out["kw2"] = None
    if not q_gate:
        out["qdd"] = None
    if not k_gate:
        out["kdd"] = None
    return out


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("branches", BRANCHES, ids=lambda b: "".join("QKqk"[i] if on else "-" for i, on in enumerate(b)))
def test_matches_formula_float64(rank, branches):
    inputs = select(make_inputs(rank=rank, t=4, s=6), *branches)
    out = compose(**inputs)
    assert out.dtype == torch.float64 and out.shape == inputs["a"].shape
    torch.testing.assert_close(out, naive_compose(**inputs), rtol=0, atol=1e-10)


def test_each_term_is_what_spec_says():
    """Each branch alone adds exactly its own term: compose(branch) - a is linear in it."""
    inputs = make_inputs(rank=2)
    a = inputs["a"]
    only_q = compose(a, inputs["qw1"], inputs["qw2"]) - a
    only_k = compose(a, kw1=inputs["kw1"], kw2=inputs["kw2"]) - a
    only_qdd = compose(a, qdd=inputs["qdd"]) - a
    only_kdd = compose(a, kdd=inputs["kdd"]) - a
    torch.testing.assert_close(only_qdd, a * inputs["qdd"].permute(0, 2, 1)[..., None], atol=1e-12, rtol=0)
    torch.testing.assert_close(only_kdd, a * inputs["kdd"].permute(0, 2, 1)[:, :, None, :], atol=1e-12, rtol=0)
    # The four terms add up to the full composition.
    torch.testing.assert_close(compose(**inputs), a + only_q + only_k + only_qdd + only_kdd, atol=1e-12, rtol=0)
    # Doubling qw2 doubles the query-wise low-rank term only.
    twice = compose(a, inputs["qw1"], 2 * inputs["qw2"]) - a
    torch.testing.assert_close(twice, 2 * only_q, atol=1e-12, rtol=0)


def test_static_matrix_is_talking_heads():
    inputs = make_inputs()
    w = torch.randn(H, H, dtype=torch.float64)
    out = compose(inputs["a"], static=w)
    torch.testing.assert_close(out, naive_compose(inputs["a"], static=w), atol=1e-10, rtol=0)


def test_cross_attention_t_differs_from_s():
    inputs = make_inputs(rank=4, t=3, s=7)
    torch.testing.assert_close(compose(**inputs), naive_compose(**inputs), atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.15)])
def test_lower_precision_keeps_dtype_and_accuracy(dtype, atol):
    inputs = make_inputs(dtype=dtype)
    out = compose(**inputs)
    assert out.dtype == dtype
    ref = naive_compose(**{k: v.double() for k, v in inputs.items()})
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0.02)


def test_non_contiguous_inputs():
    inputs = make_inputs(rank=2)
    nc = {}
    for k, v in inputs.items():
        # The same values, stored transposed: a view whose strides are not row-major.
        flipped = v.transpose(0, -1).contiguous().transpose(0, -1)
        assert not flipped.is_contiguous() and torch.equal(flipped, v)
        nc[k] = flipped
    torch.testing.assert_close(compose(**nc), compose(**inputs), atol=1e-12, rtol=0)


def test_gradients_match_finite_differences():
    inputs = {k: v.requires_grad_() for k, v in make_inputs(rank=2, t=3, s=4).items()}
    names = list(inputs)
    assert torch.autograd.gradcheck(lambda *xs: compose(**dict(zip(names, xs))),
                                    tuple(inputs[n] for n in names))


def test_gradients_match_formula():
    """Autograd of compose equals autograd of the explicit float64 formula (torch ops)."""
    inputs = {k: v.requires_grad_() for k, v in make_inputs(rank=2).items()}
    a, qw1, qw2, kw1, kw2, qdd, kdd = (inputs[k] for k in ("a", "qw1", "qw2", "kw1", "kw2", "qdd", "kdd"))
    # Independent formula: build the per-(t, s) H×H mixing matrix and apply it.
    mix = (torch.eye(H, dtype=torch.float64)[None, None, None]
           + (qw1.transpose(-1, -2) @ qw2)[:, :, None]                       # (B, T, 1, H, H)
           + (kw1.transpose(-1, -2) @ kw2)[:, None, :]                       # (B, 1, S, H, H)
           + torch.diag_embed(qdd)[:, :, None] + torch.diag_embed(kdd)[:, None, :])
    ref = torch.einsum("bgts,btsgh->bhts", a, mix)
    weight = torch.randn_like(ref)
    grads = torch.autograd.grad((compose(**inputs) * weight).sum(), list(inputs.values()))
    ref_grads = torch.autograd.grad((ref * weight).sum(), list(inputs.values()))
    for name, g, r in zip(inputs, grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0, msg=f"gradient of {name}")


@pytest.mark.parametrize("branches", [(True, True, True, True), (False, True, False, True)])
def test_torch_compile_fullgraph(branches):
    inputs = select(make_inputs(dtype=torch.float32), *branches)
    compiled = torch.compile(compose, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(**inputs), compose(**inputs))


@pytest.mark.slow
def test_torch_compile_inductor():
    inputs = make_inputs(dtype=torch.float32)
    compiled = torch.compile(compose, fullgraph=True)
    torch.testing.assert_close(compiled(**inputs), compose(**inputs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad,pattern", [
    (dict(a=torch.randn(B, H, T)), r"a must have shape \(B, H, T, S\)"),
    (dict(qw2=None), r"qw1 and qw2 must both be given"),
    (dict(qw1=torch.randn(B, T, 2, H + 1)), r"qw1 must have shape \(B=2, T=4, R, H=3\)"),
    (dict(kw2=torch.randn(B, S, 3, H)), r"same rank R"),
    (dict(kdd=torch.randn(B, T, H)), r"kdd must have shape \(B=2, S=5, H=3\)"),
    (dict(qdd=torch.randn(B, T)), r"qdd must have shape"),
])
def test_bad_shapes_name_the_argument(bad, pattern):
    inputs = {**make_inputs(dtype=torch.float32), **bad}
    with pytest.raises(ValueError, match=pattern):
        compose(**inputs)
