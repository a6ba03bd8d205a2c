"""The Triton attention kernels fit a GPU: no register spills, shared memory that launches.

Each kernel variant DCViT trains with (its head counts 3, 6, 12, 16 at head dim 64, bf16,
pre- and post-compose with both matrix sides, no mask: forward and both backward kernels,
every autotune candidate), and the same with a mask, is compiled ahead of time for sm_80
(A100) and sm_90 (H100) by the installed Triton and assembled by ``ptxas -v`` from its wheel
(`dcvit.bench.kernels`); no GPU needed. A spill puts a loop's working set in local
memory; a block over 160 KiB of shared memory cannot launch on an A100 (164 KiB per block).
Each variant's machine code is counted too (``cuobjdump -sass``), as the H100 estimate's
issue times take it.
Compiled once per session, in a pool of two processes (Triton's cache makes later sessions
quick). The slow tier adds every stage combination and fp16 (test_every_variant_fits) and
repeats the production set under the oldest and newest Triton the kernels support
(tests/test_triton_releases.py).
"""
import itertools
import sys

import pytest

from dcvit.bench import kernels as kernel_report

if kernel_report.triton_module() is None:
    pytest.skip("triton is not installed: nothing to compile", allow_module_level=True)
if not all(kernel_report.ptxas(a) for a in (80, 90)):
    pytest.skip("Triton's ptxas is missing (its wheel bundles one; or set TRITON_PTXAS_PATH)",
                allow_module_level=True)

HEADS = (3, 6, 12, 16)


def problems(rows):
    """One line per variant that does not fit (kernel_report.problems)."""
    return "\n".join(kernel_report.problems(rows))


@pytest.fixture(scope="module")
def rows():
    variants = kernel_report.variants(HEADS, (64,), ("bf16",), (80, 90), (False, True), [("qk", "qk")])
    return kernel_report.measure(variants, jobs=2)


def test_production_variants_are_all_there(rows):
    """Every kernel, head count, target and candidate, with and without a mask (without one
    the larger blocks come first, so there are more candidates); the score-gradient map's
    products kernel where the map is used (9-16 heads, no mask, Triton 3.5 on)."""
    from dcvit.kernels.triton_core import block_sizes, score_grad_map
    unmasked = [r for r in rows if not r["mask"]]
    assert {(r["kernel"], r["H"], r["arch"]) for r in unmasked} == set(
        itertools.product(kernel_report.ATTENTION_KERNELS, HEADS, (80, 90))) | {
        ("score_grad_products_kernel", H, a) for H in HEADS for a in (80, 90) if score_grad_map(H, a)}
    for mask in (False, True):
        want = [(k, H, a, c["BT"], c["BS"], c["G"]) for k in kernel_report.KERNELS for H in HEADS for a in (80, 90)
                for c in block_sizes(H, k, a, mask)]
        got = [(r["kernel"], r["H"], r["arch"], r["BT"], r["BS"], r["G"]) for r in rows if r["mask"] == mask]
        assert sorted(got) == sorted(want)
    assert len(rows) - len(unmasked) >= 2 * len(HEADS) * 3


def test_a_shared_mask_and_a_mask_per_head_compile_apart():
    """The report compiles what `triton_core` launches: a (T, S) mask as one tile for every
    head, an (H, T, S) one per head."""
    shared, per_head = (kernel_report.Variant("backward_key_kernel", 90, 12, 64, "bf16", True, "qk", "qk",
                                              16, 8, 8, 1, 2, 255, by_head) for by_head in (False, True))
    assert kernel_report.launch_arguments(shared)[1]["MASK_HEADS"] is False
    assert kernel_report.launch_arguments(per_head)[1]["MASK_HEADS"] is True
    assert per_head.name == shared.name.replace(",mask", ",mask/h")


def test_every_variant_compiles(rows):
    assert not [f"{r['name']}: {r['error']}" for r in rows if "error" in r]


def test_no_variant_spills(rows):
    spilled = [f"{r['name']}: {r['spill_stores']} B stored, {r['spill_loads']} B loaded"
               for r in rows if "error" not in r and (r["spill_stores"] or r["spill_loads"])]
    assert not spilled, "\n".join(spilled)


def test_shared_memory_launches_on_an_a100(rows):
    over = [f"{r['name']}: {r['shared'] / 1024:.0f} KiB" for r in rows
            if "error" not in r and r["shared"] > kernel_report.SHARED_BUDGET]
    assert not over, "\n".join(over)


@pytest.mark.slow
def test_gpus_with_99_kib_of_shared_memory_get_variants_that_fit():
    """sm_86, sm_89 and sm_120 (RTX 30, 40 and 50, A10, A40, L4, L40S) give a block 99 KiB of
    shared memory: the candidates `block_sizes` gives them, at every head count without a mask and
    at 3 and 6 heads with one (at 9-16 the dispatcher declines a mask there,
    `triton_core.mask_unsupported`), compile for sm_86 without spilling and fit it."""
    if not kernel_report.ptxas(86):
        pytest.skip("this Triton's ptxas does not assemble for sm_86")
    vs = (kernel_report.variants(HEADS, (64,), ("bf16",), (86,), (False,), [("qk", "qk")])
          + kernel_report.variants((3, 6), (64,), ("bf16",), (86,), (True,), [("qk", "qk")]))
    rows = kernel_report.measure(vs, jobs=2)
    assert len(rows) == len(vs) and problems(rows) == ""
    assert max(r["shared"] for r in rows) <= kernel_report.SMALL_SHARED_BUDGET < kernel_report.SHARED_BUDGET


def test_products_run_on_tensor_cores(rows):
    """q·kᵀ, p·v and their gradients are tensor-core instructions in every variant."""
    assert all(r["tensor_core"] > 0 for r in rows if "error" not in r)


def test_machine_code_is_counted(rows):
    """Each variant's instructions are counted from its cubin (cuobjdump): its loops found
    inside its code, as the estimate's issue times need them: without a mask two per pass
    (the last block's, then the whole blocks'), with one a single masked loop per pass."""
    ok = [r for r in rows if "error" not in r]
    assert ok and all(0 < r["sass_loop"] < r["sass"] for r in ok)
    for r in ok:
        if r["kernel"] == "score_grad_products_kernel":                 # one loop over the queries
            assert len(r["loops"]) == 1, r["name"]
            continue
        passes = 1 if r["kernel"] == "backward_key_kernel" else 2
        bodies = 2 if r["TAIL"] else 1                                  # `block_sizes`' half-height body
        assert len(r["loops"]) == passes * (1 if r["mask"] else 2) * bodies, r["name"]
        assert len(r["bodies"]) == bodies and all(len(b["loops"]) == len(r["loops"]) // bodies
                                                 for b in r["bodies"]), r["name"]


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;          /* 0x00000a00ff017b82 */
                                                                   /* 0x000fe40000000f00 */
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;         /* 0x0000000102027810 */
        /*0020*/                   ISETP.GE.AND P0, PT, R2, 0x10, PT ;
        /*0030*/               @!P0 BRA 0x10 ;                     /* 0xfffffffc00f08947 */
        /*0040*/                   SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;
        /*0050*/               @!P0 BRA 0x40 ;
        /*0060*/                   EXIT ;
        /*0070*/                   BRA 0x70;
"""


def test_sass_loops_run_from_a_backward_branch_target_to_the_branch():
    assert kernel_report._sass_figures(SASS) == {"sass": 8, "sass_loop": 5, "loops": [3, 2], "loop_shuffles": 1,
                                                 "bodies": [{"sass": 8, "loops": [3, 2]}]}


TWO_BODIES = """
        /*0000*/                   S2R R0, SR_CTAID.X ;
        /*0010*/                   ISETP.GT.AND P0, PT, R0, 0x10, PT ;
        /*0020*/                @P0 BRA 0x90 ;
        /*0030*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0040*/               @!P1 BRA 0x30 ;
        /*0050*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0060*/               @!P1 BRA 0x50 ;
        /*0070*/                   STG.E [R4], R2 ;
        /*0080*/                   EXIT ;
        /*0090*/                   IADD3 R2, R2, 0x1, RZ ;
        /*00a0*/                   IADD3 R2, R2, 0x1, RZ ;
        /*00b0*/               @!P1 BRA 0x90 ;
        /*00c0*/                   IADD3 R3, R3, 0x1, RZ ;
        /*00d0*/               @!P1 BRA 0xc0 ;
        /*00e0*/                   EXIT ;
        /*00f0*/                   BRA 0xf0;
"""


def test_a_kernel_with_two_bodies_is_counted_per_body():
    """`triton_attention`'s TAIL: the first instructions branch to the second body, the
    first ends in an EXIT; a program runs those first instructions and one body."""
    figures = kernel_report._sass_figures(TWO_BODIES)
    assert figures["loops"] == [2, 2, 3, 2]
    assert figures["bodies"] == [{"sass": 9, "loops": [2, 2]}, {"sass": 3 + 7, "loops": [3, 2]}]


def test_forward_loops_move_nothing_between_lanes(rows):
    """Without a mask the forward's loops hold no warp shuffle where Compose's mixing is not
    padded in its contraction (Triton 3.8 on): its row sums stay per key lane
    (`triton_attention._by_lane`) and its post-compose takes the softmax weights where the
    pre-compose's product left them (`_operand_order`). Before both, 144 a block at 6
    heads (48 for the sums, 96 to move the weights), docs/performance.md."""
    from dcvit.kernels.triton_core import dot_min
    if dot_min(32, 90)[2] > 8:
        pytest.skip("this Triton's tl.dot takes Compose's 8-head mixing only padded, in bf16: another layout")
    fwd = [r for r in rows if r["kernel"] == "forward_kernel" and not r["mask"] and "error" not in r]
    assert fwd and not [f"{r['name']}: {r['loop_shuffles']}" for r in fwd if r["loop_shuffles"]]


def test_warp_instructions_count_each_loop_once_per_block_visited():
    """A pass is two loops: the partial last block (one visit where N leaves one, none where
    it does not), then the whole blocks (N // block visits)."""
    row = dict(kernel="forward_kernel", H=6, arch=90, BT=16, BS=16, G=1, num_warps=8, sass=200, sass_loop=100,
               loops=[20, 30, 10, 40])
    # 2 sequences x 3 query blocks x 8 warps x (100 outside the loops + 2 whole key blocks x
    # (30 + 40) + the partial one, 20 + 10)
    assert kernel_report.warp_instructions(row, B=2, N=33) == 2 * 3 * 8 * (100 + 2 * 70 + 30)
    assert kernel_report.warp_instructions(row, B=2, N=32) == 2 * 2 * 8 * (100 + 2 * 70)
    # 32-key blocks: the forward's last 20 keys are two steps of `EDGE_BLOCK` (16) in each pass
    wide = dict(row, BT=32, BS=32)
    assert kernel_report.warp_instructions(wide, B=2, N=52) == 2 * 2 * 8 * (100 + 70 + 2 * 30)
    key = dict(row, kernel="backward_key_kernel", BS=8, G=2, sass=150, sass_loop=50, loops=[20, 30])
    # 2 sequences x 5 key blocks x 2 head groups x 8 warps x (100 + 2 whole query blocks x 30 + 20)
    assert kernel_report.warp_instructions(key, B=2, N=33) == 2 * 5 * 2 * 8 * (100 + 2 * 30 + 20)
    with pytest.raises(ValueError, match="expected 2"):
        kernel_report.warp_instructions(dict(key, loops=[50]), B=2, N=33)
    # two bodies (TAIL): 37 tokens leave 5 queries to the last 32-query block, which runs the
    # smaller body (a whole key block and a partial step in each pass); 49 leave 17, and every
    # program runs the larger one (a whole key block and two partial steps)
    two = dict(wide, TAIL=True, bodies=[dict(sass=150, loops=[20, 30, 10, 40]), dict(sass=120, loops=[10, 15, 5, 20])])
    small, large = 120 - 50 + 10 + 15 + 5 + 20, 150 - 100 + 20 + 30 + 10 + 40
    assert kernel_report.warp_instructions(two, B=2, N=37) == 2 * 8 * (large + small)
    assert kernel_report.warp_instructions(two, B=2, N=49) == 2 * 8 * 2 * (150 - 100 + 2 * 20 + 30 + 2 * 10 + 40)
    products = dict(kernel="score_grad_products_kernel", H=12, BT=16, BS=256, G=1, num_warps=8, sass=300,
                    sass_loop=100, loops=[100])
    # 2 sequences x 12 heads x 8 warps x (200 outside the loop + 3 query blocks x 100)
    assert kernel_report.warp_instructions(products, B=2, N=33) == 2 * 12 * 8 * (200 + 3 * 100)


def test_progress_passes_every_row_in_order_with_and_without_tqdm(monkeypatch, capsys):
    rows = [{"name": str(i)} for i in range(5)]
    assert list(kernel_report._progress(iter(rows), len(rows))) == rows
    assert capsys.readouterr().err == ""                # no bar where stderr is no terminal
    monkeypatch.setitem(sys.modules, "tqdm", None)       # a bare GPU image: import fails
    assert list(kernel_report._progress(iter(rows), len(rows))) == rows

@pytest.mark.slow
@pytest.mark.timeout(3600)     # ~1,000 compilations: 9 to 35 min on 2 cores with a cold Triton cache
def test_every_variant_fits():
    """All nine stage combinations, with and without a mask, bf16 and fp16: each compiles,
    spills nothing and fits 160 KiB."""
    variants = kernel_report.variants(HEADS, (64,), ("bf16", "fp16"), (80, 90), (False, True))
    rows = kernel_report.measure(variants, jobs=2)
    assert len(rows) >= 9 * 2 * 2 * 2 * len(HEADS) * 3
    assert not problems(rows), problems(rows)


@pytest.mark.slow
def test_a_mask_per_head_fits():
    """A mask that differs between heads (a converted Swin's relative position bias) is
    loaded per head, a different compilation from the shared mask above: the production
    stages with one, each kernel, head count, target and candidate."""
    variants = kernel_report.variants(HEADS, (64,), ("bf16",), (80, 90), (True,), [("qk", "qk")],
                                      mask_heads=(True,))
    assert variants and all(v.mask and v.mask_heads for v in variants)
    rows = kernel_report.measure(variants, jobs=2)
    assert not problems(rows), problems(rows)
