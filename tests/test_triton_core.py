"""The Triton attention core (`dcvit.kernels.triton_core`, run through the custom op
``dcvit::composed_attention`` as the core ``"triton"``) equals the attention formula.

Without a GPU the kernels run on CPU in Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``); with one they are compiled and run on CUDA, so the same file is
the GPU check's kernel test. The reference is the formula of docs/spec.md §1.1 written
directly (einsum per Compose stage, PyTorch softmax) and evaluated in float64; the kernels
run in float32 (products in full precision) and must match it to 1e-5 in the output and
every gradient (q, k, v, each stage's query- and key-side matrices, a static matrix through
them), on small shapes chosen to hit the kernels' edges: sequence lengths that are not
multiples of the blocks, T ≠ S, 1 to 16 heads, masks, each optional stage. bf16/fp16
operands must match the float32 reference within 2e-2 of the largest reference value.
"""
import pytest
import torch

triton = pytest.importorskip("triton")

import dcvit  # noqa: E402
from dcvit import fused  # noqa: E402
from dcvit.fused import attention_impl  # noqa: E402
from dcvit.matrices import ComposeMatrices  # noqa: E402
from dcvit.kernels import triton_attention, triton_core  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not triton_core.interpreted():
    pytest.skip("no CUDA device and Triton not in interpreter mode", allow_module_level=True)

NAMES = ("q", "k", "v", "mq1", "mk1", "mq2", "mk2")


def _mix(a, mq, mk):
    """``out[b,h,t,s] = Σ_g a[b,g,t,s] (mq[b,t,g,h] + mk[b,s,g,h])`` (docs/spec.md §1.1)."""
    B, H, T, S = a.shape
    out = torch.einsum("bgts,btgh->bhts", a, mq.expand(B, T, H, H))
    if mk is not None:
        out = out + torch.einsum("bgts,bsgh->bhts", a, mk)
    return out


def reference(q, k, v, mask, mq1, mk1, mq2, mk2, scale):
    """The core written out: (B, T, H, D)."""
    a = scale * q @ k.transpose(-1, -2)
    if mq1 is not None:
        a = _mix(a, mq1, mk1)
    if mask is not None:
        a = a + mask
    a = a.softmax(-1)
    if mq2 is not None:
        a = _mix(a, mq2, mk2)
    return (a @ v).transpose(1, 2)


def _case(B, H, T, S, D, pre=True, post=True, mk=True, mask="float", seed=0, strided=False):
    """Random operands on DEVICE (float32): q, k, v, mask and the four matrices (None when
    the stage or its key side is off). ``strided``: q, k, v are views of one qkv tensor."""
    g = torch.Generator().manual_seed(seed)
    if strided:
        assert T == S
        qkv = torch.randn(B, T, 3, H, D, generator=g).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.to(DEVICE).unbind(0)                                   # (B, H, N, D) views
    else:
        q, k, v = (torch.randn(B, H, n, D, generator=g).to(DEVICE) for n in (T, S, S))

    def mats():
        mq = torch.eye(H) + 0.5 * torch.randn(B, T, H, H, generator=g)
        mkk = 0.5 * torch.randn(B, S, H, H, generator=g)
        return mq.to(DEVICE), (mkk.to(DEVICE) if mk else None)
    mq1, mk1 = mats() if pre else (None, None)
    mq2, mk2 = mats() if post else (None, None)
    m = None
    if mask == "float":                                                      # (T, S), -inf and finite
        m = torch.where(torch.rand(T, S, generator=g) > 0.3, 0.0, float("-inf"))
        m[:, 0] = 0.0
        m = (m + 0.5 * torch.randn(T, S, generator=g)).to(DEVICE)
    elif mask == "large":                 # (1, 1, T, S), large positive logits: padded heads stay 0
        m = torch.where(torch.rand(1, 1, T, S, generator=g) > 0.8, 100.0, 0.0).to(DEVICE)
    elif mask == "full":                                                     # (B, H, T, S)
        m = torch.randn(B, H, T, S, generator=g).to(DEVICE)
    elif mask == "bool":
        m = torch.rand(B, 1, T, S, generator=g) > 0.4
        m[..., 0] = True
        m = m.to(DEVICE)
    return [q, k, v], m, [mq1, mk1, mq2, mk2]


def _additive(mask):
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))


def _grads(fn, inputs, mask, mats, scale, grad_seed=1):
    """Output and gradients of every present operand, through ``fn``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    mleaves = [None if m is None else m.detach().clone().requires_grad_() for m in mats]
    out = fn(*leaves, mask, *mleaves, scale)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out)
    present = [t for t in leaves + mleaves if t is not None]
    return out, torch.autograd.grad(out, present, g)


def _triton(q, k, v, mask, mats, scale):
    """The core through the dispatcher's op: (B, H, T, D)."""
    return fused.composed_attention(q, k, v, mask, ComposeMatrices(*mats), "triton", scale)


def _kernel(q, k, v, mask, mq1, mk1, mq2, mk2, scale):
    return _triton(q, k, v, mask, (mq1, mk1, mq2, mk2), scale).transpose(1, 2)


def _reference64(q, k, v, mask, mq1, mk1, mq2, mk2, scale):
    d = [None if t is None else t.double() for t in (q, k, v, _additive(mask), mq1, mk1, mq2, mk2)]
    return reference(*d, scale)


def _assert_matches(inputs, mask, mats, scale=0.35, atol=1e-5, rtol=1e-5):
    out, grads = _grads(_kernel, inputs, mask, mats, scale)
    want, wgrads = _grads(_reference64, inputs, mask, mats, scale)
    names = [n for n, t in zip(NAMES, inputs + mats) if t is not None]
    for name, a, b in zip(["output", *("d" + n for n in names)], [out, *grads], [want, *wgrads]):
        torch.testing.assert_close(a.double(), b.double(), atol=_scaled(atol, b), rtol=rtol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _scaled(atol: float, b) -> float:
    """An absolute tolerance in units of the tensor's largest entry (at least 1): float32
    sums round to about eps x their magnitude, whichever element they land in (gradients of
    the mixing matrices reach tens here)."""
    return atol * max(1.0, float(b.detach().abs().max()))


# ------------------------------------------------------------------------ float32 == formula

@pytest.mark.parametrize("H", [1, 3, *(pytest.param(h, marks=pytest.mark.slow) for h in (6, 12, 16))])
def test_all_stages_and_a_mask_any_head_count(H):
    """T ≠ S, neither a multiple of the 16-row blocks, several key blocks."""
    T, S = (19, 21) if H >= 12 else (19, 37)
    _assert_matches(*_case(2 if H < 12 else 1, H, T, S, 8, seed=H))


@pytest.mark.parametrize("pre,post,mk", [(True, False, True), (False, True, True), (True, True, False),
                                         (True, False, False), (False, True, False)],
                         ids=["pre_only", "post_only", "query_wise_only", "pre_query_only", "post_query_only"])
def test_each_stage_optional(pre, post, mk):
    _assert_matches(*_case(2, 3, 17, 23, 8, pre=pre, post=post, mk=mk, seed=3))


@pytest.mark.parametrize("T,S", [(32, 64), (64, 32), (5, 7)])
def test_whole_blocks_alone_and_a_partial_block_alone(T, S):
    """The kernels loop over whole blocks unmasked and take a partial last block on its own:
    lengths that are multiples of every block size (no partial block) and lengths below one
    block (nothing but the partial one), with a mask."""
    _assert_matches(*_case(1, 3, T, S, 8, seed=T + S))


@pytest.mark.parametrize("T,S", [(7, 52), (7, 28)])
def test_the_forward_takes_its_last_keys_in_steps_of_sixteen(T, S):
    """Without a mask the forward's 32-key blocks leave their last, partial block to steps of
    `EDGE_BLOCK` (16) keys: 20 keys after a whole block are two such steps, 28 keys alone
    too; every gradient still agrees (the backward's blocks are 16 wide)."""
    assert triton_core.block_sizes(3)[0]["BS"] == 32 and triton_attention.EDGE_BLOCK.value == 16
    _assert_matches(*_case(1, 3, T, S, 8, mask=None, seed=T + S))


@pytest.mark.parametrize("T", [37, 48, 49])
def test_a_last_block_at_most_half_full_takes_the_half_height_body(T):
    """Without a mask the forward's and the query kernel's 32-query blocks leave a last block
    that holds at most 16 queries to a body of 16 rows (``TAIL``): 5 and 16 queries there
    (37 and 48 tokens), 17 in the full body (49)."""
    assert [triton_core.block_sizes(3, k)[0].get("TAIL") for k in (
        "forward_kernel", "backward_query_kernel", "backward_key_kernel")] == [True, True, None]
    _assert_matches(*_case(1, 3, T, 21, 8, mask=None, seed=T))


@pytest.mark.parametrize("mins,tails", [((1, 1, 8), (True, True)), ((1, 1, 16), (True, False)),
                                        ((16, 16, 16), (False, False))],
                         ids=["triton3.8-3.9", "triton3.5-3.7", "triton3.4"])
def test_which_candidates_take_the_half_height_body(monkeypatch, mins, tails):
    """``TAIL`` is set by `block_sizes` alone (the kernels and the count read it): for 32-row
    blocks, in the query kernel only where Compose's mixing is not padded in its contraction
    (under 3.5-3.7 its two bodies spilled), and never with a mask (16-row blocks)."""
    monkeypatch.setattr(triton_core, "dot_min", lambda bits, arch=90: mins)
    for kernel, tail in zip(("forward_kernel", "backward_query_kernel"), tails):
        first, *rest = triton_core.block_sizes(6, kernel)
        assert first["TAIL"] == tail and first["BT"] == (32 if tail or mins[0] == 1 else 16), kernel
        assert not any(c["TAIL"] for c in rest + triton_core.block_sizes(6, kernel, mask=True)), kernel


def test_only_the_key_kernels_16_by_16_blocks_on_sm90_load_a_step_ahead(monkeypatch):
    """Two pipeline stages (each step's loads issued during the step before) for the key
    kernel's 16 × 16 candidate on sm_90 alone: on sm_80 it spilled, elsewhere the loaded
    tiles would double in shared memory. One stage for every other candidate."""
    monkeypatch.setattr(triton_core, "dot_min", lambda bits, arch=90: (1, 1, 8))      # 3.8-3.9
    for arch in (80, 90):
        for H in (3, 6, 12):
            for kernel in ("forward_kernel", "backward_query_kernel", "backward_key_kernel"):
                for mask in (False, True):
                    for c in triton_core.block_sizes(H, kernel, arch, mask):
                        ahead = (kernel == "backward_key_kernel" and arch == 90 and (c["BT"], c["BS"]) == (16, 16))
                        assert c["num_stages"] == (2 if ahead else 1), (arch, H, kernel, mask, c)
    assert triton_core.block_sizes(6, "backward_key_kernel", 90)[0]["num_stages"] == 2


@pytest.mark.parametrize("mask,H", [(None, 3), ("full", 3), ("full", 9), ("bool", 3), ("large", 3)])
def test_masks(mask, H):
    """Per head ("full"; 9 heads: 16 padded, the key kernel's heads in two groups) or one for
    all heads, which the kernels load once for every head ("large": logits of 100, whose
    float32 rounding the tolerance allows, would overflow in the padded heads if the mask
    reached them)."""
    tol = 1e-3 if mask == "large" else 1e-5
    _assert_matches(*_case(2, H, 18, 18, 8, mask=mask, seed=4), atol=tol, rtol=tol)


def test_key_wise_only_identity_query_side():
    """No query-wise terms: mq is the identity broadcast (1, 1, H, H) without a gradient."""
    inputs, mask, (_, mk1, _, mk2) = _case(2, 3, 9, 13, 8, seed=5)
    eye = torch.eye(3, device=DEVICE).view(1, 1, 3, 3)
    out, grads = _grads(_kernel, inputs, mask, [eye, mk1, eye, mk2], 0.5)
    want, wgrads = _grads(_reference64, inputs, mask, [eye, mk1, eye, mk2], 0.5)
    torch.testing.assert_close(out.double(), want.double(), atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, wgrads):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)


def test_static_matrix_folded_into_mq():
    """Talking-heads: mq = I + W (broadcast), its gradient reaches W (summed over tokens)."""
    H = 3
    inputs, mask, (_, mk1, _, _) = _case(2, H, 11, 11, 8, seed=6)
    w = (0.3 * torch.randn(H, H, generator=torch.Generator().manual_seed(7))).to(DEVICE)
    got = []
    for fn in (_kernel, _reference64):
        wl = w.clone().requires_grad_()
        leaves = [t.clone().requires_grad_() for t in inputs]
        mq = (torch.eye(H, device=DEVICE) + wl).view(1, 1, H, H)
        out = fn(*leaves, mask, mq, mk1, mq, None, 0.4)
        gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(out)
        got.append((out, *torch.autograd.grad(out, [wl, *leaves], gout)))
    for a, b in zip(*got):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)


def test_strided_qkv_views():
    """q, k, v as the qkv projection leaves them (non-contiguous views), head dim 12 (padded)."""
    _assert_matches(*_case(2, 3, 13, 13, 12, strided=True, seed=9))


def test_head_dim_loaded_in_halves():
    """Head dim 40 (padded to 64): the kernels load the operand of q·kᵀ and dO·vᵀ that
    changes along their loops in two halves of the head dim (the second partly padding)."""
    _assert_matches(*_case(2, 3, 13, 11, 40, seed=16), scale=40 ** -0.5)


@pytest.mark.parametrize("fwd", range(len(triton_core.block_sizes(9, "forward_kernel"))))
def test_sixteen_padded_heads_every_block_candidate(monkeypatch, fwd):
    """9 heads (16 padded), head dim 40, a mask, with each forward block candidate: with a
    mask the key kernel splits its heads between programs (`block_sizes`' G) and the query
    kernel owns 8 queries; dq and dk come from the kernels (no score-gradient map)."""
    sizes = triton_core.block_sizes
    monkeypatch.setattr(triton_core, "block_sizes", lambda H, kernel="forward_kernel", arch=90, mask=False: (
        sizes(H, kernel, arch, mask)[fwd:] + sizes(H, kernel, arch, mask)[:fwd] if kernel == "forward_kernel"
        else sizes(H, kernel, arch, mask)))
    assert triton_core.block_sizes(9, "backward_key_kernel", mask=True)[0]["G"] == 2
    assert not triton_core.score_grad_map(9, mask=True)
    assert triton_core.block_sizes(9, "backward_query_kernel", mask=True)[0]["BT"] == 8
    _assert_matches(*_case(1, 9, 19, 17, 40, seed=17), scale=40 ** -0.5)


@pytest.mark.parametrize("H,candidate", [(6, 0), (6, 1), (9, 0), (9, 1)])
def test_unmasked_block_candidates_and_the_score_gradient_map(monkeypatch, H, candidate):
    """Without a mask each kernel has larger blocks first (`block_sizes`): 32 queries in the
    forward, 32 queries in the query kernel and 16 keys in the key kernel at 8 padded heads; at
    16 padded heads 16 queries in the query kernel and all heads in one key-kernel program,
    where dq and dk come from the score-gradient map (`score_grad_map`) instead of the
    kernels. Each candidate (the second
    where a kernel has one), strided q/k/v as the qkv projection gives them, every stage,
    against the float64 formula: the same output and gradients."""
    sizes = triton_core.block_sizes
    assert triton_core.score_grad_map(H) == (H > 8)
    firsts = {k: sizes(H, k)[0] for k in ("forward_kernel", "backward_query_kernel", "backward_key_kernel")}
    assert (firsts["forward_kernel"]["BT"], firsts["backward_query_kernel"]["BT"],
            firsts["backward_key_kernel"]["BS"]) == ((32, 32, 16) if H <= 8 else (16, 16, 8))
    if H > 8:
        assert firsts["backward_key_kernel"]["G"] == 1
        assert sizes(H, "backward_key_kernel", mask=True)[0]["G"] == 2   # a mask keeps the smaller ones
    monkeypatch.setattr(triton_core, "block_sizes", lambda H, kernel="forward_kernel", arch=90, mask=False: [
        sizes(H, kernel, arch, mask)[min(candidate, len(sizes(H, kernel, arch, mask)) - 1)]])
    _assert_matches(*_case(2, H, 37, 37, 32, mask=None, seed=31, strided=True), scale=32 ** -0.5)


def test_gpus_with_99_kib_of_shared_memory_get_blocks_that_fit(monkeypatch):
    """On sm_86, sm_89 and sm_120 (`small_shared`) at 16 padded heads, without a mask: the
    forward in 8 × 16 blocks, the query kernel in 8 × 8 and the key kernel in 16 × 8 with its
    heads in two groups, both with the score-gradient map; run as there (9 heads, 21 queries, 37 keys:
    partial blocks on both axes), the formula's output and gradients."""
    assert [triton_core.small_shared(a) for a in (80, 86, 89, 90, 100, 120)] == [0, 1, 1, 0, 0, 1]
    monkeypatch.setattr(triton_core, "_arch", lambda device: 86)
    firsts = [triton_core.block_sizes(9, k, 86)[0] for k in ("forward_kernel", "backward_query_kernel",
                                                                  "backward_key_kernel")]
    assert [(c["BT"], c["BS"], c["G"]) for c in firsts] == [(8, 16, 1), (8, 8, 1), (16, 8, 2)]
    assert triton_core.score_grad_map(9, 86)
    _assert_matches(*_case(2, 9, 21, 37, 32, mask=None, seed=41), scale=32 ** -0.5)


def test_a_mask_at_9_to_16_heads_is_declined_on_gpus_with_99_kib(monkeypatch):
    """There the backward kernels with a mask need 100-112 KiB at 16 padded heads: a forced
    Triton core refuses a mask, with the reason, and the one-time check runs without one
    (what will run); up to 8 heads, and on other GPUs, a mask is taken and checked."""
    monkeypatch.setattr(triton_core, "_arch", lambda device: 86)
    q = torch.zeros(1, 9, 5, 8, device=DEVICE)
    mask = torch.zeros(5, 5, device=DEVICE)
    with pytest.raises(ValueError, match=r"sm_86 \(99 KiB of shared memory a block\).*without a mask they fit"):
        fused.select_impl("triton", q, mask=mask)
    assert fused.select_impl("triton", q) == ("triton", "forced")
    assert fused.select_impl("triton", q[:, :6], mask=mask) == ("triton", "forced")
    checked = []
    monkeypatch.setattr(triton_core, "_checked", {})
    monkeypatch.setattr(triton_core, "_self_check", lambda *a, masked: checked.append(masked) or 0.0)
    assert triton_core.works_on(q) and triton_core.works_on(q[:, :6])
    assert checked == [False, True]
    monkeypatch.setattr(triton_core, "_arch", lambda device: 80)
    assert triton_core.mask_unsupported(str(DEVICE), 9) is None


@pytest.mark.parametrize("max_keys", [256, 16], ids=["one-kernel", "two-products"])
def test_score_gradient_map_products(monkeypatch, max_keys):
    """dq and dk from the score-gradient map: by `score_grad_products_kernel`, which reads
    the map once with all keys in one program (S ≤ `PRODUCTS_MAX_KEYS`), or else by two
    batched products; 21 queries (a partial block) by 37 keys (padded to 64):
    the formula's gradients either way. For the one kernel the map's rows are laid out 48
    keys apart (`score_grad_map_row`: aligned for vector stores), for the products 37."""
    launched = []
    run = triton_core._launch_products
    monkeypatch.setattr(triton_core, "_launch_products",
                        lambda *a: (launched.append((*a[1:3], a[3][0].stride(2))), run(*a)))
    monkeypatch.setattr(triton_core, "PRODUCTS_MAX_KEYS", max_keys)
    assert triton_core.score_grad_map(9)
    assert triton_core.score_grad_map_row(37) == (48 if max_keys >= 37 else 37)
    _assert_matches(*_case(2, 9, 21, 37, 32, mask=None, seed=37), scale=32 ** -0.5)
    assert launched == ([(2, 9, 48)] if max_keys >= 37 else [])


def test_matrices_padded_once_a_layer(monkeypatch):
    """Where the kernels take the matrices zero-padded (`pads_matrices`: up to 7 heads, Triton
    3.8 on) the dispatcher pads them before its op (`kernel_matrices`), so that autograd keeps
    the padded ones: the forward pads each matrix once, the backward none, and the gradients
    reach the unpadded matrices as the formula gives them."""
    if not triton_core.pads_matrices(3):
        pytest.skip("this Triton's kernels take the matrices unpadded")
    inputs, mask, mats = _case(1, 3, 13, 11, 16, seed=19)
    leaves = [t.detach().clone().requires_grad_() for t in inputs + mats]
    padded, pad = [], torch.nn.functional.pad
    monkeypatch.setattr(torch.nn.functional, "pad",
                        lambda x, *a, **k: (padded.append(tuple(x.shape)), pad(x, *a, **k))[1])
    out = _kernel(*leaves[:3], mask, *leaves[3:], 0.35)
    assert sorted(padded) == sorted(tuple(m.shape) for m in mats)
    padded.clear()
    grads = torch.autograd.grad(out, leaves, torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    assert padded == []
    _, want = _grads(_reference64, inputs, mask, mats, 0.35)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a.double(), b.double(), atol=_scaled(1e-5, b), rtol=1e-5)


def test_head_groups_in_every_kernel(monkeypatch):
    """Every kernel takes a head split (G = 2: each program accumulates and writes half the
    heads), though only the key kernel's candidates use one: the same output and gradients
    as without."""
    inputs, mask, mats = _case(1, 9, 13, 11, 16, seed=18)
    want = _grads(_kernel, inputs, mask, mats, 0.35)
    sizes = triton_core.block_sizes
    monkeypatch.setattr(triton_core, "block_sizes", lambda H, kernel="forward_kernel", arch=90, mask=False: [
        {**c, "G": 2} for c in sizes(H, kernel, arch, mask)])
    got = _grads(_kernel, inputs, mask, mats, 0.35)
    for a, b in zip([got[0], *got[1]], [want[0], *want[1]]):   # the split products round differently
        torch.testing.assert_close(a, b, atol=_scaled(1e-6, b), rtol=1e-5)


@pytest.mark.parametrize("mins,candidate", [((1, 1, 16), 0), ((16, 16, 16), 0), ((16, 16, 16), 1)],
                         ids=["triton3.5-3.7", "triton3.4", "triton3.4-8-rows"])
@pytest.mark.parametrize("H", [3, pytest.param(9, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_products_padded_to_what_older_triton_takes(monkeypatch, mins, candidate, H, dtype):
    """Where the running Triton's `tl.dot` wants a contraction of 16 (3.5-3.7), or 16 rows
    and columns too (3.4), Compose's head mixing over 8 padded heads and the matrix
    gradients are padded with zeros: the same formula. Under 3.4 each backward kernel has a
    16-row candidate and an 8-row one whose q/k/v products pad their 8 columns; each is run
    here. With bf16 or fp16 operands the padded mixing runs in bf16 (`triton_attention._mm`):
    within the half-precision tolerance of `test_half_precision_within_tolerance`. float32
    with a mask per head, which the key kernel loads in another layout under 3.4."""
    monkeypatch.setattr(triton_core, "dot_min", lambda bits, arch=90: mins)
    sizes = triton_core.block_sizes
    if mins[0] == 16:
        assert [[(c["BT"], c["BS"]) for c in sizes(H, k)] for k in (
            "forward_kernel", "backward_query_kernel", "backward_key_kernel")] == [
            [(16, 16)], [(16, 16), (8, 16)], [(16, 16), (16, 8)]]
    monkeypatch.setattr(triton_core, "block_sizes", lambda H, kernel="forward_kernel", arch=90, mask=False: [
        sizes(H, kernel, arch, mask)[min(candidate, len(sizes(H, kernel, arch, mask)) - 1)]])
    inputs, mask, mats = _case(1, H, 19, 21, 16, mask="full" if dtype == torch.float32 else "float", seed=23)
    if dtype == torch.float32:                          # a mask per head: a load of its own
        _assert_matches(inputs, mask, mats, scale=16 ** -0.5)
        return
    inputs = [t.to(dtype) for t in inputs]
    out, grads = _grads(_kernel, inputs, mask, mats, 16 ** -0.5)
    want, wgrads = _grads(_reference64, [t.float() for t in inputs], mask, mats, 16 ** -0.5)
    for name, a, b in zip(("out",) + NAMES, (out,) + tuple(grads), (want,) + tuple(wgrads)):
        err = (a.double() - b).abs().max().item()
        assert err <= 2e-2 * b.abs().max().item(), f"{name}: {err} vs max {b.abs().max().item()}"


def test_padded_mixing_in_bf16_rounds_its_operands(monkeypatch):
    """With bf16 operands and a contraction the running Triton takes only padded (dot_min
    as 3.5-3.7 state it), Compose's head mixing multiplies bf16-rounded operands: the row
    statistics (lse, float32) of pre-compose equal a float64 formula that rounds the scores
    and both matrices to bf16 before mixing, and differ from the float32 operands' (full
    precision, padded with zeros) by a bf16-sized amount. q and k on a grid of 1/16 make
    the scores exact in float32 whatever the order of their sums, so both roundings see
    the same scores."""
    monkeypatch.setattr(triton_core, "dot_min", lambda bits, arch=90: (1, 1, 16))
    g = torch.Generator().manual_seed(31)
    H, T, S, D = 3, 19, 21, 16
    q, k = (torch.round(16 * torch.randn(1, H, n, D, generator=g)) / 16 for n in (T, S))
    v = torch.randn(1, H, S, D, generator=g)
    mq = torch.eye(H) + 0.5 * torch.randn(1, T, H, H, generator=g)
    mk = 0.5 * torch.randn(1, S, H, H, generator=g)
    scale = 0.25

    def lse(dtype):
        qkv = [t.to(DEVICE, dtype) for t in (q, k, v)]
        return triton_core.attention_forward(*qkv, None, mq.to(DEVICE), mk.to(DEVICE), None, None,
                                             scale)[1].double().cpu()

    def formula(r):
        s0 = scale * q.double() @ k.double().transpose(-1, -2)              # exact in float32
        a = r(s0)
        x = torch.einsum("bgts,btgh->bhts", a, r(mq.double())) + torch.einsum("bgts,bsgh->bhts", a, r(mk.double()))
        return torch.logsumexp(x, -1)
    assert torch.equal(q.bfloat16().float(), q) and torch.equal(k.bfloat16().float(), k)
    bf16, fp32 = lse(torch.bfloat16), lse(torch.float32)
    rounded, exact = formula(lambda x: x.float().bfloat16().double()), formula(lambda x: x)
    top = float(exact.abs().max())
    assert (bf16 - rounded).abs().max() <= 2e-6 * top
    assert (fp32 - exact).abs().max() <= 2e-6 * top
    gap = float((bf16 - fp32).abs().max())
    assert 2 ** -14 * top <= gap <= 2 ** -6 * top, gap


def test_matrix_gradients_are_skipped_when_not_needed(monkeypatch):
    """Only requested gradients are computed (the kernels are told which); the others come
    back as None, and those computed still equal the formula's: the query kernel takes
    delta's post-compose query-side term from dMq2 (``DELTA_BY_DMQ2``) whether or not dMq2
    is wanted."""
    inputs, mask, mats = _case(1, 3, 9, 9, 8, seed=10)
    q, k, v = (t.clone().requires_grad_() for t in inputs)
    mleaves = [mats[0], mats[1].clone().requires_grad_(), mats[2], mats[3]]
    seen = []
    real = triton_core.attention_backward

    def spy(*args):
        seen.append(args[-1])
        return real(*args)
    monkeypatch.setattr(triton_core, "attention_backward", spy)
    _triton(q, k, v, mask, mleaves, 0.5).sum().backward()
    assert all(t.grad is not None for t in (q, k, v)) and mleaves[1].grad is not None
    assert seen == [[False, True, False, False]]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, mleaves[1])]
    want = _reference64(*leaves[:3], mask, mats[0], leaves[3], mats[2], mats[3], 0.5)
    wgrads = torch.autograd.grad(want.sum(), leaves)
    for got, w in zip((q.grad, k.grad, v.grad, mleaves[1].grad), wgrads):
        torch.testing.assert_close(got.double(), w, atol=_scaled(1e-5, w), rtol=1e-5)


def test_backward_needs_the_forward_statistics():
    """The backward takes the forward's log-sum-exp; without it, an error naming the fix."""
    inputs, mask, mats = _case(1, 3, 9, 9, 8, seed=15)
    grad = torch.zeros(1, 9, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="attention_forward"):
        triton_core.attention_backward(grad, *inputs, mask, *mats, None, 0.5)


# --------------------------------------------------------------------- half precision

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_tolerance(dtype):
    """bf16/fp16 q, k, v (float32 matrices and accumulation) against the float32 formula
    of the same rounded operands: every value within 2e-2 of the largest reference value."""
    inputs, mask, mats = _case(2, 6, 19, 21, 16, seed=11)
    inputs = [t.to(dtype) for t in inputs]
    out, grads = _grads(_kernel, inputs, mask, mats, 0.25)
    want, wgrads = _grads(_reference64, [t.float() for t in inputs], mask, mats, 0.25)
    assert out.dtype == dtype and grads[0].dtype == dtype
    for name, a, b in zip(("out",) + NAMES, (out,) + tuple(grads), (want,) + tuple(wgrads)):
        err = (a.double() - b).abs().max().item()
        assert err <= 2e-2 * b.abs().max().item(), f"{name}: {err} vs max {b.abs().max().item()}"


# ------------------------------------------------------------------ through the DCMHA layer

@pytest.mark.parametrize("options", [dict(), dict(static_proj=True, query_wise=False)],
                         ids=["default", "static_key_wise"])
def test_dcmha_layer_triton_equals_reference(options):
    """A whole layer (causal mask) forced onto the Triton core: output, input gradient and
    the gradient of every parameter (dynamic-weight generator, static matrices) in float32."""
    torch.manual_seed(0)
    layer = dcvit.DCMHA(24, 3, qkv_bias=True, **options).to(DEVICE)
    with torch.no_grad():
        for p in layer.core.dynamic_weights.parameters():
            p.normal_(0, 0.3)
        for stage in (layer.core.pre_compose, layer.core.post_compose):
            if stage is not None and stage.static is not None:
                stage.static.normal_(0, 0.3)
    x = torch.randn(2, 9, 24, device=DEVICE)
    runs = []
    for impl in ("reference", "triton"):
        xi = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        with attention_impl(impl):
            y = layer(xi, is_causal=True)
        y.square().sum().backward()
        runs.append([y, xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*runs):                          # both float32: rounding of each side
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------- launch counts

def _count_launches(monkeypatch):
    """Count Triton kernel launches (compiled or interpreted: both go through
    ``KernelInterface.__getitem__``)."""
    launches = []
    original = triton.runtime.jit.KernelInterface.__getitem__

    def counted(self, grid):
        launch = original(self, grid)

        def run(*args, **kwargs):
            fn = self
            while hasattr(fn, "fn"):                           # autotuner -> kernel -> function
                fn = fn.fn
            launches.append(fn.__name__)
            return launch(*args, **kwargs)
        return run
    monkeypatch.setattr(triton.runtime.jit.KernelInterface, "__getitem__", counted)
    return launches


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts every op that reaches the dispatcher (aten ops and the core's custom ops)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_launch_count_is_fixed(monkeypatch):
    """One Triton launch forward, two backward, and the same number of ops for the whole
    DCMHA layer whatever the batch size and sequence length."""
    launches = _count_launches(monkeypatch)
    torch.manual_seed(0)
    layer = dcvit.DCMHA(24, 3).to(DEVICE)
    counts = {}
    for B, N in ((1, 5), (3, 37)):
        layer.zero_grad(set_to_none=True)
        x = torch.randn(B, N, 24, device=DEVICE, requires_grad=True)
        with attention_impl("triton"):
            launches.clear()
            with _OpCounter() as fwd:
                y = layer(x)
            fwd_launches = list(launches)
            launches.clear()
            with _OpCounter() as bwd:
                y.sum().backward()
            bwd_launches = list(launches)
        counts[(B, N)] = (len(fwd.ops), len(bwd.ops), fwd_launches, bwd_launches)
        assert fwd_launches == ["forward_kernel"]
        assert bwd_launches == ["backward_query_kernel", "backward_key_kernel"]
        assert "dcvit.composed_attention.default" in fwd.ops
        assert "dcvit.composed_attention_backward.default" in bwd.ops
    assert counts[(1, 5)] == counts[(3, 37)], counts


# ---------------------------------------------------------------- custom op and compile

def test_custom_op_passes_opcheck():
    """The core "triton" of dcvit::composed_attention: schema, fake-tensor rule (the output
    and the (B, H, T) statistics, shapes and strides as the kernels return them), autograd."""
    inputs, mask, mats = _case(1, 3, 7, 9, 8, seed=12)
    inputs = [t.requires_grad_() for t in inputs]
    mats = [m.requires_grad_() for m in mats]
    out, stats = fused._attention_op(*inputs, mask, *mats, "triton", 0.5)
    assert out.shape == (1, 7, 3, 8) and stats.shape == (1, 3, 7) and stats.dtype == torch.float32
    assert not stats.requires_grad
    torch.library.opcheck(torch.ops.dcvit.composed_attention.default, (*inputs, mask, *mats, "triton", 0.5),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_the_separate_triton_op_is_gone():
    """One op for every core: the Triton core has no op of its own."""
    assert not hasattr(torch.ops.dcvit, "triton_attention")


def test_errors_name_the_fix():
    q = torch.randn(1, 17, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="up to 16 heads"):
        triton_core.attention_forward(q, q, q, None, None, None, None, None, 1.0)
    q = torch.randn(1, 2, 4, 8, device=DEVICE, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        triton_core.attention_forward(q, q, q, None, None, None, None, None, 1.0)


# ----------------------------------------------------------------------------- dispatch

def test_self_check_passes_and_is_remembered(monkeypatch):
    monkeypatch.setattr(triton_core, "_checked", {})
    q = torch.zeros(2, 2, 5, 8, device=DEVICE)
    assert triton_core.works_on(q)
    monkeypatch.setattr(triton_core, "_self_check", lambda *a, **k: pytest.fail("checked twice"))
    assert triton_core.works_on(q)
    assert not triton_core.works_on(torch.zeros(1, 17, 5, 8, device=DEVICE))   # too many heads
    assert not triton_core.works_on(q.double())


def test_triton_3_4_is_declined_where_it_spills(monkeypatch):
    """Under a Triton whose `tl.dot` takes 16 rows at least (3.4) the check declines 9-16
    heads before compiling anything, with one warning naming the release and the fix; up to
    8 heads, and from 3.5 on, it runs the check."""
    monkeypatch.setattr(triton_core, "_checked", {})
    monkeypatch.setattr(triton_core, "dot_min", lambda bits, arch=90: (16, 16, 16))
    assert triton_core.known_to_spill(90, 6) is None
    monkeypatch.setattr(triton_core, "_self_check", lambda *a, **k: pytest.fail("compiled where it spills"))
    with pytest.warns(RuntimeWarning, match=r"9-16 heads; Triton 3.5 or newer"):
        assert not triton_core.works_on(torch.zeros(1, 9, 5, 8, device=DEVICE))
    monkeypatch.setattr(triton_core, "dot_min", lambda bits, arch=90: (1, 1, 16))     # 3.5-3.7
    assert triton_core.known_to_spill(90, 9) is None


def test_auto_runs_triton_inside_torch_compile(monkeypatch):
    """Where "auto" runs the Triton core in eager mode, it runs it inside ``torch.compile``
    too (full graph, dynamic shapes): one custom op of the traced graph, after the one-time
    check that ran while the graph was traced; the compiled layer's output and gradients are
    the eager reference core's."""
    monkeypatch.setattr(fused, "_TRITON_DEVICES", ("cuda", DEVICE.type))
    monkeypatch.setattr(triton_core, "_checked", {})
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = dcvit.DCMHA(16, num_heads=2).to(DEVICE)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)                   # far from the near-identity init
    x = torch.randn(2, 5, 16, device=DEVICE, requires_grad=True)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    out = torch.compile(layer, backend=keep, fullgraph=True, dynamic=True)(x)
    ops = [n for gm in graphs for n in gm.graph.nodes
           if n.op == "call_function" and "composed_attention" in str(n.target)]
    assert len(ops) == 1 and "triton" in ops[0].args, [n.args for n in ops]
    assert list(triton_core._checked) == [(str(DEVICE), torch.float32, 2, 8)]
    grad, = torch.autograd.grad(out.sum(), x)
    with attention_impl("reference"):
        want = layer(x)
    want_grad, = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("failure", ["raises", "wrong"])
def test_self_check_failure_warns_once_and_declines(monkeypatch, failure):
    def check(*args, masked):
        if failure == "raises":
            raise RuntimeError("out of resources: shared memory")
        return 0.5
    monkeypatch.setattr(triton_core, "_checked", {})
    monkeypatch.setattr(triton_core, "_self_check", check)
    q = torch.zeros(1, 3, 4, 8, device=DEVICE)
    with pytest.warns(RuntimeWarning, match="using the 'compile' core"):
        assert not triton_core.works_on(q)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not triton_core.works_on(q)


def test_forced_triton_core_refuses_what_it_cannot_take():
    """A forced Triton core is an error, with the reason, where its kernels cannot run."""
    from dcvit import fused
    with pytest.raises(ValueError, match="'triton' cannot run here: .*got torch.float64"):
        fused.select_impl("triton", torch.zeros(1, 3, 4, 8, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="17 heads, more than the Triton kernels' 16"):
        fused.select_impl("triton", torch.zeros(1, 17, 4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="do not return the attention weights"):
        fused.select_impl("triton", torch.zeros(1, 3, 4, 8, device=DEVICE), weights=True)
    assert fused.select_impl("triton", torch.zeros(1, 3, 4, 8, device=DEVICE)) == ("triton", "forced")


def test_a_triton_without_the_kernels_api_is_declined_with_its_version(monkeypatch):
    """A Triton older than the kernels' API (no triton.knobs, say 3.2) is declined before
    any launch: the automatic choice names its version, a forced core raises with it."""
    assert triton_core.unsupported_reason() is None
    monkeypatch.setattr(triton_core, "triton", None)
    monkeypatch.setattr(triton_core, "_TRITON_VERSION", "3.2.0")
    why = triton_core.unsupported_reason()
    assert "Triton 3.2.0" in why and "3.4 or newer" in why
    q = torch.zeros(1, 3, 4, 8, device=DEVICE)
    assert fused._refuses("triton", q, False, None) == why
    with pytest.raises(ValueError, match="Triton 3.2.0 lacks"):
        fused.select_impl("triton", q)
    monkeypatch.setattr(triton_core, "_TRITON_VERSION", None)
    assert "missing" in triton_core.unsupported_reason()


def test_dot_sizes_come_from_the_running_triton():
    """`dot_min` is what the NVIDIA backend of this Triton states, and the block candidates
    follow it: 8 queries in the forward only where `tl.dot` takes 8 columns (its P·V product
    is not padded)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import min_dot_size
    import triton.language as tl
    for bits, ty in ((16, tl.bfloat16), (32, tl.float32)):
        assert triton_core.dot_min(bits) == tuple(min_dot_size(GPUTarget("cuda", 90, 32))(ty, ty))
    rows = max(*triton_core.dot_min(16)[:2], *triton_core.dot_min(32)[:2])
    for H in (3, 6, 12, 16):
        assert all(c["BT"] >= rows for c in triton_core.block_sizes(H, "forward_kernel"))


# ---------------------------------------------------------------------------- slow tier

@pytest.mark.slow
def test_vit_small_shape():
    """ViT-S's real attention shape (6 heads, 197 tokens, head dim 64): 13 query and 7 key
    blocks, every stage and a mask."""
    _assert_matches(*_case(1, 6, 197, 197, 64, seed=13), scale=64 ** -0.5, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_vit_base_shape():
    """ViT-B's real attention shape (12 heads, 197 tokens, head dim 64) without a mask, as
    DCViT-B trains: the score-gradient map, and its products kernel with all 197 keys in one
    program (padded to 256)."""
    assert triton_core.score_grad_map(12) and 197 <= triton_core.PRODUCTS_MAX_KEYS
    _assert_matches(*_case(1, 12, 197, 197, 64, mask=None, seed=15, strided=True), scale=64 ** -0.5,
                    atol=2e-5, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("T,S", [(20, 1030), (1030, 20)])
def test_long_sequences(T, S):
    """1030 keys (9 blocks of 128, looped over by each query block) and 1030 queries (65
    blocks, looped over by each key block in backward): no length needs to fit a block."""
    _assert_matches(*_case(1, 2, T, S, 16, seed=14), scale=0.25, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_torch_compile_keeps_the_triton_op():
    """torch.compile(fullgraph=True) of a layer forced onto the Triton core: one opaque op in
    the graph (dcvit::composed_attention, as for every core), the same output and input
    gradient as eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = dcvit.DCMHA(24, 3).to(DEVICE)
    layer.core.attn_impl = "triton"
    x = torch.randn(2, 9, 24, device=DEVICE)
    runs = []
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.square().sum().backward()
        runs.append((y, xi.grad))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(layer, fullgraph=True, backend=backend)(x)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum("dcvit.composed_attention" in t for t in targets) == 1, targets
