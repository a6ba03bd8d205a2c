"""Triton kernels of the fused DCMHA attention core: forward and backward, flash-style.

Each program holds one block of queries (or, in the key pass of backward, one block of keys)
and computes its scores and Compose stages for **all** heads: Compose mixes heads. What it
accumulates and writes may be a group of ``HP/G`` heads (program_id 2; `block_sizes`' G):
G programs per block then share the accumulators and each recomputes the rest. Per key
block (docs/spec.md §1.1, with each stage merged into per-token H×H matrices as in
`dcvit.matrices`)::

    s0[h]  = scale · q[h] k[h]ᵀ                                    tl.dot, fp32 accumulate
    s1[h]  = Σ_g s0[g] · (Mq1[t,g,h] + Mk1[s,g,h]) + mask[h]       pre-compose
    p[h]   = exp(s1[h] - lse[h])                                   softmax, lse = log Σ_s exp s1
    p2[h]  = Σ_g p[g]  · (Mq2[t,g,h] + Mk2[s,g,h])                 post-compose
    o[h]  += p2[h] v[h]                                            tl.dot

No score is multiplied by the scale: the kernels take s0 = q kᵀ unscaled and, without a
mask, keep the logits in those units (pre-compose is linear), the exponentials' FMA applying
the scale (`_logit_scale`, `_exp`) and the pre-compose matrices' gradients taking it at
their stores; with a mask it joins the mask's add (one FMA).

Layout. The products with q, k, v are batched over heads, tiles ``(heads, rows, cols)``.
Compose runs on the same values laid out ``(rows, cols, heads)``: there its query-side term
is, for every query t, the product ``(keys × heads) @ Mq[t]`` and its key-side term, for
every key s, ``(queries × heads) @ Mk[s]``, so each stage is two batched `tl.dot` over the
head axis, and each matrix gradient (``dMq[t] = Σ_s a[t,s,:]ᵀ d[t,s,:]``) is one more. Going
between the layouts is a `tl.permute` (one pass through shared memory); nothing extracts
heads one at a time. A term whose input a product left in the threads that hold its rows
takes it where it is, contracting over the heads in the TF32 operand's order
(`_operand_order`), and sums over the keys stay per thread until a pass ends (`_by_lane`).
The head axis is padded to `HP` ≥ 8, the smallest contraction that a float32 `tl.dot`
takes in Triton 3.8 and newer; padded heads, queries, keys and head-dim
lanes are masked. Where the running Triton's `tl.dot` wants more (3.4-3.7: a contraction of
16; 3.4: 16 rows and columns too, `triton_core.dot_min`) `_mm` doubles the small side with
zeros between its values, inside the product, and drops the padding from the result: the
head mixing's, and under 3.4 also the 8 columns of the q/k/v products in 8-row blocks. A
mixing so padded in its contraction runs on bf16 operands for bf16/fp16 inputs (TF32
otherwise): twice TF32's rate pays for the padding.

Registers. A program's tiles of all heads must fit 255 registers per thread at 8 warps
without spilling (tests/test_kernel_resources.py). Three things make 16 padded heads fit:
a block of 8 rows is always a product's 8 columns, never its rows (a tensor-core product
pads rows to 16): accumulators are kept transposed (dkᵀ, dvᵀ, dqᵀ, Oᵀ: (heads, D, rows);
dMᵀ: (rows, heads, group)) and the scores come out as ``(a @ b)ᵀ`` with the 8 rows in b;
the operand of q·kᵀ and dO·vᵀ that a loop loads is loaded and multiplied in two halves of
the head dim (`_dot_by_halves`), so half of it is live at a time, and so is the operand of
each backward product into an accumulator over the head dim (dqᵀ, dkᵀ, dvᵀ, each held as
its two halves: `_acc_by_halves`; the forward's Oᵀ spills less whole); and dq and dk are
left to products outside (``DS_MAP``, below), or else the key kernel splits its heads
between two programs (``G = 2``): each recomputes the scores and the full-width Compose
steps, post-composes and back-composes only its heads' output columns, and takes its
heads' columns of the other tiles from a split of the tile (`_group`).

Post-compose mixes *normalised* weights of different heads, so the forward makes two
passes over the keys: the first finds each head's row statistics (``lse``, saved for
backward), the second recomputes the scores and accumulates the output. The forward
writes no (B, H, T, S) map to memory.

Backward recomputes everything from q, k, v, the matrices and ``lse`` in two kernels:

* `backward_query_kernel`, one program per block of queries: pass 1 over the keys gives
  ``delta[h,t] = Σ_s p·dp`` (the softmax backward's row term; with post-compose it is not
  ``Σ o·do``) and the query-side matrices' gradient dMq2. dp there is post-compose's
  gradient taken back through both its terms, ``dp'[g] = Σ_h dp[h]·(Mq2[t,g,h] + Mk2[s,g,h])``;
  the query-side term's share of delta is ``Σ_h Mq2[t,g,h]·dMq2[t,g,h]``, so at up to 8
  padded heads in one head group (``DELTA_BY_DMQ2``) the loop takes dp' by its key side
  alone and adds that share after the loop: one product fewer a block (at 16 padded heads
  the key side's result, alone, needs a layout change of its own, and the count was even:
  docs/performance.md). Pass 2 gives dq and dMq1, or with
  ``DS_MAP`` writes the scores' gradient ds (B, H, T, S) in the operands' dtype where it
  would multiply it by k (`triton_core.score_grad_map`: neither kernel then holds dq or dk
  accumulators; `score_grad_products_kernel` reads the map once for both, up to 256 keys,
  and two batched products take it beyond).
* `backward_key_kernel`, one program per block of keys (and head group), looping over
  query blocks: dk (not with ``DS_MAP``), dv and the key-side matrices' gradients dMk1, dMk2, which are sums over
  *all* queries. A program owns its keys' (and heads') share of those sums, so they are
  written once, in a fixed order:
  deterministic, no atomics, no per-query-block partial buffers. Its tiles are
  ``(keys, queries, heads)``: the key side is the one its own rows index.

Whole blocks and the last one. Without a mask each pass over the other axis takes its
last, partial block first (from ``N - N % block``; loads, stores and logits masked past the
end), then the whole blocks, where nothing depends on the sequence's end (`_within` makes
that mask a constant, which the compiler removes): 3-12 % fewer instructions per block
(docs/performance.md). A kernel's step is one jit function (`_forward_block`,
`_query_block`, `_key_block`), its two loops one `tl.static_range` over the phases. The
partial block is a loop of at most one step, before the whole ones: as an ``if`` after
them ptxas spilled 64 B (the 6-head forward) and 292 B (the 16-head query kernel); as a
loop after them, 8 B in the 16-head query kernel for sm_80. Where the blocks are wider
than `EDGE_BLOCK` (the forward's 32 keys), that loop takes the last keys in blocks of
`EDGE_BLOCK`: at 197 tokens 5 keys are one block of 16, not 32. With a mask (which keeps the
smaller blocks, `triton_core.block_sizes`) one masked loop takes every block, as before:
with both, the key kernel with a mask per head at 16 heads spilled 8-12 B.

The last row block. The forward's and the query kernel's programs take their rows in a
body of their own (`_forward_rows`, `_query_rows`); with ``TAIL`` (`triton_core.block_sizes`
sets it for 32-row blocks, the query kernel's where Compose's mixing is not padded, and
`dcvit.bench.kernels` counts by it) the last one, when it holds at most half of its rows,
runs the body of BT/2 rows instead: at 197 tokens the seventh block of 32 holds 5 queries. Both
bodies are compiled into the kernel (its registers the larger's), each program runs one
(about 6 % fewer instructions per launch at 197 tokens, docs/performance.md). The key
kernel's blocks are at most 16 keys: its half-height last program would save 2 %.

Loads and stores of q, k, v and their gradients go through explicit strides (they may be
views of the qkv projection), a step's from the block's first row where registers allow
(the offsets within a block computed once, `_forward_block`); each token's H×H matrix is
contiguous (`triton_core` makes it so), so its (g, h) offsets are constants: vector loads
and no address arithmetic per element. The kernels never import the dispatcher;
`dcvit.kernels.triton_core` launches them. The module runs past 400 lines because the
attention kernels and the tile helpers they share (`_mm`, `_mix`, `_compose`, the halved
loads and accumulators) are read, compiled and checked for registers together
(`dcvit.bench.kernels`).
"""
import triton
import triton.language as tl

__all__ = ["forward_kernel", "backward_query_kernel", "backward_key_kernel", "score_grad_products_kernel"]

EDGE_BLOCK: tl.constexpr = tl.constexpr(16)     # the most keys a step of the forward's last, partial blocks
                                                # takes (the p·v product's 16-bit operands need 16)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """``a @ b`` (3-D, batched over heads) accumulated in float32. PRECISION "exact" (Triton's
    interpreter, `triton_core._precision`): the operands' float32 values multiplied and
    summed along the contracted axis in its order, as a GPU's FMA loop does. The interpreter
    multiplies with numpy, whose BLAS kernel, and with it the order of the sum, depends on
    the tiles' shapes; the kernels recompute the scores on tiles of other shapes than the
    forward's, and the row statistics must find the same scores. Nor can it multiply bfloat16
    tiles; products of bf16 values are exact in float32, so this is what a bf16 tensor-core
    product with float32 accumulation gives."""
    if PRECISION == "exact":
        return tl.sum(a.to(tl.float32)[:, :, :, None] * b.to(tl.float32)[:, None, :, :], axis=2)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _pad2(x):
    """x (X, Y, n) as (X, Y, 2n): its values at even positions, zeros between."""
    return tl.reshape(tl.join(x, tl.zeros_like(x)), (x.shape[0], x.shape[1], 2 * x.shape[2]))


@triton.jit
def _unpad2(x):
    """The even positions of x's last axis: `_pad2` undone."""
    even, odd = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], x.shape[2] // 2, 2)))
    return even


@triton.jit
def _round_bf16(x):
    """float32 x rounded to the nearest bfloat16, ties to even, as a GPU's cvt.rn rounds
    it (the interpreter's own cast truncates), kept in float32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mm(a, b, acc, PRECISION: tl.constexpr, DOT_MN: tl.constexpr, DOT_K: tl.constexpr):
    """``acc + a @ b`` for (X, M, K) and (X, K, N) tiles, one batched `tl.dot`. A side
    smaller than the running Triton's `tl.dot` takes (M or N below DOT_MN, K below DOT_K,
    `triton_core.dot_min`; at most by half: 8 padded heads where it wants 16) is doubled
    with zeros between its values and the product's padding dropped: Compose's head mixing
    at 8 padded heads under Triton 3.4-3.7 (K), and under 3.4 the 8 heads of a product's
    columns or rows (N, M), and the 8 queries or keys of a q/k/v product's columns (N; those
    pass their own tiles and PRECISION, and DOT_K = 1). For the head mixing PRECISION is
    `triton_core._flags`' MIX: "ieee" (float32 operands) or "tf32" (bf16/fp16). Under "tf32"
    a product padded in K runs on bfloat16 operands instead (a and b rounded to bf16,
    float32 accumulation): twice TF32's rate, so the padding costs what an unpadded TF32
    product would; bf16 keeps float32's exponent range. "exact" (the interpreter's "tf32";
    it cannot multiply bf16 tiles): each product taken exactly in float32 (`_dot`), the
    bf16 one on operands rounded as a GPU rounds them (`_round_bf16`)."""
    M: tl.constexpr = a.shape[1]
    N: tl.constexpr = b.shape[2]
    K: tl.constexpr = a.shape[2]
    if (M >= DOT_MN and N >= DOT_MN) and K >= DOT_K:
        if PRECISION == "exact":
            out = _dot(a, b, PRECISION) + acc
        else:
            out = tl.dot(a, b, acc, input_precision=PRECISION)
    else:
        if K < DOT_K and PRECISION == "tf32":               # a bf16 product (cast before the
            a = a.to(tl.bfloat16)                           # padding: a cvt packs two values)
            b = b.to(tl.bfloat16)
        if K < DOT_K and PRECISION == "exact":
            a = _round_bf16(a)
            b = _round_bf16(b)
        if K < DOT_K:                                       # contraction: zeros in a, b's rows doubled
            a = _pad2(a)
            bt = tl.permute(b, (0, 2, 1))
            b = tl.permute(tl.reshape(tl.join(bt, bt), (bt.shape[0], N, 2 * K)), (0, 2, 1))
        if M < DOT_MN:                                      # rows: a's doubled, zeros between
            a = tl.permute(_pad2(tl.permute(a, (0, 2, 1))), (0, 2, 1))
        if N < DOT_MN:                                      # columns: b's doubled, zeros between
            b = _pad2(b)
        out = _dot(a, b, PRECISION)
        if N < DOT_MN:                                      # the product's padding dropped
            out = _unpad2(out)
        if M < DOT_MN:
            out = tl.permute(_unpad2(tl.permute(out, (0, 2, 1))), (0, 2, 1))
        out += acc
    return out


@triton.jit
def _exp(x, c, xs, FAST: tl.constexpr):
    """``exp(xs·x - c)`` as ``2^(x·(xs·log2 e) - c·log2 e)``: an FMA per element (xs a scalar, the
    logits' scale `_logit_scale`; c broadcast along an axis costs its own size) and, on a GPU
    (FAST), one ``ex2.approx.ftz``: results below 2⁻¹²⁶ flush to zero, where ptxas wraps the
    subnormal-keeping ``ex2.approx`` that `tl.exp` becomes in four more instructions.
    `tl.exp2` in the interpreter."""
    y = x * (xs * 1.4426950408889634) - c * 1.4426950408889634
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [y], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.exp2(y)


@triton.jit
def _opaque(x, GPU: tl.constexpr):
    """x, as a value the compiler cannot trace to its definition (a `mov` it must issue where
    it stands, on a GPU): indices so copied after a loop give addresses computed there, not
    shared with an earlier store's and kept live across the loop."""
    if GPU:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
    return x


@triton.jit
def _by_lane(x):
    """x (X, Y, heads) as (X, Y/8, 8, heads): y = 8j + i at [x, j, i]. Where Y is a tensor-core
    product's rows, j runs within each thread and i over the 8 lanes that share its rows, so a
    sum or maximum over the new axis 1 stays in each thread: a pass over the keys keeps its
    per-row sums per (row, lane i, head) and reduces them over i once, after its loop, instead
    of three warp shuffles per row and block."""
    return tl.reshape(x, (x.shape[0], x.shape[1] // 8, 8, x.shape[2]))


@triton.jit
def _t(x):
    """(heads, cols, rows) -> (rows, cols, heads), and back."""
    return tl.permute(x, (2, 1, 0))


@triton.jit
def _matrices(HAS: tl.constexpr, M, rows, n_stride, rows_ok, MH: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
              TRANS: tl.constexpr = False):
    """The H×H matrices of the tokens on a tile's axis (rows: their indices, (X, 1, 1)) as an
    (X, HP, HP) float32 tile ``m[x, g, h]``, zero-padded, or with TRANS transposed,
    ``m[x, h, g]`` (by transposed offsets); where the stage or side is absent (not HAS),
    nothing to load (0). Each token's matrix is contiguous, rows of MH: H, or HP where
    `triton_core` padded them with zeros (no mask on the heads, whole vector loads).
    Loaded once per block: a stage and its backward take the same tile, one of them
    transposed (`_mix`), but where that transpose is a pass through shared memory (the key
    kernel's query side at 16 padded heads) each use loads its own."""
    if HAS:
        g = tl.arange(0, HP)[None, :, None]
        h = tl.arange(0, HP)[None, None, :]
        if TRANS:
            g, h = tl.arange(0, HP)[None, None, :], tl.arange(0, HP)[None, :, None]
        if MH == HP:
            out = tl.load(M + rows * n_stride + g * MH + h, mask=rows_ok, other=0.0)
        else:
            out = tl.load(M + rows * n_stride + g * MH + h, mask=rows_ok & (g < H) & (h < H), other=0.0)
    else:
        out = 0
    return out


@triton.jit
def _operand_order(x, AXIS: tl.constexpr):
    """x with its head axis AXIS (1 or 2; a multiple of 8 long) reordered in each group of 8:
    position 4r + c takes head 2c + r. A TF32 product's accumulator holds, per thread, the
    columns 2c and 2c + 1 of each group of 8; its A operand wants the columns c and c + 4.
    Contracting over the heads in this order on both sides (the tile's columns, the matrices'
    rows) changes no sum, and lets an accumulator's tile be the next product's A operand as it
    is held, where `tl.dot` would otherwise move three quarters of it between lanes (a shuffle
    and two selects a value)."""
    if AXIS == 2:
        out = tl.reshape(tl.permute(tl.reshape(x, (x.shape[0], x.shape[1], x.shape[2] // 8, 4, 2)), (0, 1, 2, 4, 3)),
                         (x.shape[0], x.shape[1], x.shape[2]))
    else:
        out = tl.reshape(tl.permute(tl.reshape(x, (x.shape[0], x.shape[1] // 8, 4, 2, x.shape[2])), (0, 1, 3, 2, 4)),
                         (x.shape[0], x.shape[1], x.shape[2]))
    return out


@triton.jit
def _mix(a, m, TR: tl.constexpr, h0, HO: tl.constexpr, acc, MIX: tl.constexpr, DOT_MN: tl.constexpr,
         DOT_K: tl.constexpr, IN_PLACE: tl.constexpr = False, MT: tl.constexpr = False):
    """``out[x, y, h] = acc[x, y, h] + Σ_g a[x, y, g] · m[x, g, h0 + h]``: an (X, Y, HP) float32
    tile times the matrices of the tokens on its axis 0 (`_matrices`), one batched product
    accumulating onto acc, for the HO output heads from h0: an (X, Y, HO) tile. TR applies
    the transposed matrices. Y under 16 (8 keys: the key kernel's query-side term) would be a
    product's rows, which a tensor-core product pads to 16: taken transposed instead,
    ``(mᵀ aᵀ)ᵀ``, the 8 as its columns (the transposes fold into the caller's permutes).
    IN_PLACE: a is held as a product with these rows left it (`_compose`'s FROM), and the
    contraction is not padded: taken in `_operand_order`. MT: m is given transposed
    (`_matrices`' TRANS): the product takes it so without a transpose where TR, or the
    transposed product, asks for m[x, h, g]."""
    if a.shape[1] < 16 and HO == a.shape[2] and HO >= 16:
        if TR == MT:
            m = tl.permute(m, (0, 2, 1))                                    # m[x, h, g]
        out = tl.permute(_mm(m, tl.permute(a, (0, 2, 1)), tl.permute(acc, (0, 2, 1)), MIX, DOT_MN, DOT_K), (0, 2, 1))
    else:
        if TR != MT:
            m = tl.permute(m, (0, 2, 1))
        m = _group(m, h0, HO)
        if IN_PLACE and a.shape[2] >= DOT_K:
            a = _operand_order(a, 2)
            m = _operand_order(m, 1)
        out = _mm(a, m, acc, MIX, DOT_MN, DOT_K)
    return out


@triton.jit
def _compose(a, m0, HAS0: tl.constexpr, m1, HAS1: tl.constexpr, TR: tl.constexpr, o0, HO: tl.constexpr,
             MIX: tl.constexpr, DOT_MN: tl.constexpr, DOT_K: tl.constexpr, CHAIN: tl.constexpr,
             FROM: tl.constexpr = 0, M1T: tl.constexpr = False):
    """``out[x, y, h] = Σ_g a[x, y, g] · (m0[x, g, o0 + h] + m1[y, g, o0 + h])`` for an (X, Y, HP)
    tile and the HO output heads from o0: m0 the matrices of the tokens of axis 0, m1 those
    of axis 1 (`_matrices`; either may be absent); TR: with the matrices transposed (a
    stage's backward). CHAIN: the second term's product accumulates onto the first's result
    (moved into its layout) instead of the two results being added (its result moved):
    the backward kernels issue 2-4 % fewer instructions so and the forward's post-compose
    0-3 % fewer, its pre-compose 3 % more (docs/performance.md). FROM: the term whose
    product takes a in the layout a product left it in, 1 (axis 0's) or 2 (axis 1's): a is
    an element-wise function of the output of a `_compose` on the same axes, whose last
    product is its second term's when CHAIN, else its first's (the compiler folds the sum
    into that product's accumulator). That term contracts in `_operand_order` (`_mix`'s
    IN_PLACE). 0: a comes from elsewhere. M1T: m1 is given transposed (`_mix`'s MT)."""
    out = tl.zeros((a.shape[0], a.shape[1], HO), tl.float32)
    if HAS0:
        out = _mix(a, m0, TR, o0, HO, out, MIX, DOT_MN, DOT_K, FROM == 1)
    if HAS1:
        at = tl.permute(a, (1, 0, 2))
        if CHAIN or not HAS0:                       # alone: its product's accumulator is the zeros
            out = tl.permute(_mix(at, m1, TR, o0, HO, tl.permute(out, (1, 0, 2)), MIX, DOT_MN, DOT_K, FROM == 2,
                                  M1T), (1, 0, 2))
        else:
            out += tl.permute(_mix(at, m1, TR, o0, HO, tl.zeros((a.shape[1], a.shape[0], HO), tl.float32), MIX,
                                   DOT_MN, DOT_K, FROM == 2, M1T), (1, 0, 2))
    return out


@triton.jit
def _group(a, h0, HO: tl.constexpr):
    """``a[:, :, h0:h0 + HO]`` of an (X, Y, heads) tile: a itself when that is all of it, else
    one of its two halves (G = 2 head groups), split in registers and selected (a
    `tl.gather` by the heads' indices issued 83 more instructions per key-kernel step at 12
    heads)."""
    if HO == a.shape[2]:
        out = a
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(a, (a.shape[0], a.shape[1], 2, HO)), (0, 1, 3, 2)))
        out = tl.where(h0 == 0, lo, hi)
    return out


@triton.jit
def _matrix_grad(acc, a, d, MIX: tl.constexpr, DOT_MN: tl.constexpr, DOT_K: tl.constexpr):
    """``acc[x, g, h] += Σ_y a[x, y, g] · d[x, y, h]``: a Compose matrix's gradient for the
    tokens on axis 0 (a: the stage's input, d: the gradient of its output; given the other way
    round, the transposed gradient, as the dM1ᵀ accumulators take it)."""
    return _mm(tl.permute(a, (0, 2, 1)), d, acc, MIX, DOT_MN, DOT_K)


@triton.jit
def _store_matrix_grad(DM, acc, b, idx, N, g0, h0, H: tl.constexpr, MH: tl.constexpr, TR: tl.constexpr = False):
    """acc[x, g, h] -> DM[b, idx[x], g0 + g, h0 + h] of a contiguous (B, N, MH, MH) float32
    tensor, the matrices' shape (`_matrices`); TR: acc[x, h, g], a transposed accumulator
    (dMᵀ), written by transposed offsets, with no width hint, and unpadded under one bound
    for both indices: permuted, or hinted, the query kernel's 32-query blocks spilled 8 B
    (sm_90, Triton 3.8), and with the untransposed store's mask, which the compiler kept
    from dMq2's store across pass 2, 4 B (Triton 3.7). Where the matrices are padded (MH > H),
    zeros at the padding's entries (constants, not parameters), each thread's stores two
    floats wide: as wide as 8-float rows allow, the compiler gathers the accumulator for
    16-byte stores and the key kernel spilled 8-56 B (3-6 heads)."""
    n = idx[:, None, None]
    if TR:
        h = h0 + tl.arange(0, acc.shape[1])[None, :, None]
        g = g0 + tl.arange(0, acc.shape[2])[None, None, :]
    else:
        g = g0 + tl.arange(0, acc.shape[1])[None, :, None]
        h = h0 + tl.arange(0, acc.shape[2])[None, None, :]
    if MH == H and TR:                                  # one bound for both: not the untransposed store's mask
        tl.store(DM + ((b * N + n) * H + g) * H + h, acc, mask=(tl.maximum(g, h) < H) & (n < N))
    elif MH == H:
        tl.store(DM + ((b * N + n) * H + g) * H + h, acc, mask=(g < H) & (h < H) & (n < N))
    else:
        off = ((b * N + n) * MH + g) * MH + h
        if not TR:
            off = tl.max_contiguous(off, [1, 1, 2])
        tl.store(DM + off, tl.where((g < H) & (h < H), acc, 0.0), mask=(g < MH) & (h < MH) & (n < N))


@triton.jit
def _load_t_halves(P, off, sd, ok, D: tl.constexpr, DP: tl.constexpr):
    """The (heads, D, cols) tile ``P[off + d·sd]`` as its two halves along the head dim
    when DP ≥ 32 (a bf16 product needs 16 lanes of it), else as itself, twice."""
    if DP >= 32:
        d0 = tl.arange(0, DP // 2)[None, :, None]
        d1 = DP // 2 + d0
        a0 = tl.load(P + off + d0 * sd, mask=ok & (d0 < D), other=0.0)
        a1 = tl.load(P + off + d1 * sd, mask=ok & (d1 < D), other=0.0)
    else:
        d = tl.arange(0, DP)[None, :, None]
        a0 = tl.load(P + off + d * sd, mask=ok & (d < D), other=0.0)
        a1 = a0
    return a0, a1


@triton.jit
def _dot_by_halves(P, off, sd, ok, b0, b1, D: tl.constexpr, DP: tl.constexpr, PRECISION: tl.constexpr,
                   DOT_MN: tl.constexpr):
    """``a @ b`` for the (heads, rows, D) tile ``a = P[off + d·sd]``, loaded here by halves
    of the head dim (b0, b1: b's halves, `_load_t_halves`): half of a is live at a time.
    8 columns where `tl.dot` takes 16 (DOT_MN, Triton 3.4) are padded inside (`_mm`)."""
    if DP >= 32:
        d0 = tl.arange(0, DP // 2)[None, None, :]
        d1 = DP // 2 + d0
        a0 = tl.load(P + off + d0 * sd, mask=ok & (d0 < D), other=0.0)
        out = _mm(a0, b0, tl.zeros((a0.shape[0], a0.shape[1], b0.shape[2]), tl.float32), PRECISION, DOT_MN, 1)
        out = _mm(tl.load(P + off + d1 * sd, mask=ok & (d1 < D), other=0.0), b1, out, PRECISION, DOT_MN, 1)
    else:
        d = tl.arange(0, DP)[None, None, :]
        a = tl.load(P + off + d * sd, mask=ok & (d < D), other=0.0)
        out = _mm(a, b0, tl.zeros((a.shape[0], a.shape[1], b0.shape[2]), tl.float32), PRECISION, DOT_MN, 1)
    return out


@triton.jit
def _acc_by_halves(acc0, acc1, P, off, sd, ok, b, D: tl.constexpr, DP: tl.constexpr, PRECISION: tl.constexpr,
                   DOT_MN: tl.constexpr):
    """``acc += a @ b`` for a (heads, D, cols) accumulator held as its two halves along the
    head dim when DP ≥ 32 (acc0, acc1: (heads, DP/2, cols) each), ``a = P[off + d·sd]``
    loaded here half at a time, so half of a is live at a time. Else acc0 is all of it
    (acc1 unused). Padded inside as `_dot_by_halves` is."""
    if DP >= 32:
        d0 = tl.arange(0, DP // 2)[None, :, None]
        d1 = DP // 2 + d0
        acc0 = _mm(tl.load(P + off + d0 * sd, mask=ok & (d0 < D), other=0.0), b, acc0, PRECISION, DOT_MN, 1)
        acc1 = _mm(tl.load(P + off + d1 * sd, mask=ok & (d1 < D), other=0.0), b, acc1, PRECISION, DOT_MN, 1)
    else:
        d = tl.arange(0, DP)[None, :, None]
        acc0 = _mm(tl.load(P + off + d * sd, mask=ok & (d < D), other=0.0), b, acc0, PRECISION, DOT_MN, 1)
    return acc0, acc1


@triton.jit
def _store_t_halves(P, off, sd, ok, acc0, acc1, D: tl.constexpr, DP: tl.constexpr):
    """`_acc_by_halves`' accumulator stored to ``P[off + d·sd]`` (in P's dtype)."""
    if DP >= 32:
        d0 = tl.arange(0, DP // 2)[None, :, None]
        d1 = DP // 2 + d0
        tl.store(P + off + d0 * sd, acc0.to(P.dtype.element_ty), mask=ok & (d0 < D))
        tl.store(P + off + d1 * sd, acc1.to(P.dtype.element_ty), mask=ok & (d1 < D))
    else:
        d = tl.arange(0, DP)[None, :, None]
        tl.store(P + off + d * sd, acc0.to(P.dtype.element_ty), mask=ok & (d < D))


@triton.jit
def _within(idx, n, EDGE: tl.constexpr):
    """``idx < n`` for a block that may run past the end of its axis (EDGE), else all true:
    a constant, so a whole block's loads, stores and logits take no mask at all."""
    if EDGE:
        out = idx < n
    else:
        out = tl.full(idx.shape, 1, tl.int1)
    return out


@triton.jit
def _logit_scale(scale, HAS_MASK: tl.constexpr):
    """The factor between `_logits`' values and the softmax's logits: without a mask the
    softmax scale, which the exponentials' FMA (`_exp`) and the matrix gradients' stores
    apply, so no score is multiplied by it; with one 1 (the mask is added to scaled logits,
    in one FMA)."""
    if HAS_MASK:
        out = 1.0
    else:
        out = scale
    return out


@triton.jit
def _logits(s0, scale, b, t, s, T, S, Q_SIDE: tl.constexpr, EDGE: tl.constexpr, MASK, smb, smh, smt, sms,
            mq1, mk1, H: tl.constexpr, HP: tl.constexpr, HAS_MASK: tl.constexpr, MASK_HEADS: tl.constexpr,
            HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr, MIX: tl.constexpr, DOT_MN: tl.constexpr, DOT_K: tl.constexpr,
            CHAIN: tl.constexpr, M1T: tl.constexpr = False):
    """The logits after pre-compose (`_compose`'s CHAIN) and the mask, -inf at padded keys,
    in units of `_logit_scale` (unscaled without a mask), from the unscaled scores s0 = q·kᵀ
    laid out (rows, cols, heads): pre-compose is linear, so it commutes with the scale.
    t, s: query and key indices, (X, 1, 1) for axis 0 and (Y, 1, 1) for axis 1 of the tile:
    axis 0 holds the queries when Q_SIDE, else the keys. EDGE: the loop's block (axis 1)
    may run past its end; a whole one is not masked (`_within`). A mask shared by the heads (not MASK_HEADS) is loaded as one (X, Y)
    tile and broadcast. One per head is loaded in the tile's layout, but by the key kernel where
    `tl.dot` takes 8-row sides (3.5 on) as (heads, queries, keys) and permuted: in the
    tile's layout it spilled 8-16 B at 16 heads under 3.5 and 3.6, permuted under 3.4
    8-16 B at 3 and 6 heads (docs/performance.md). M1T: axis 1's matrices mk1 or mq1 are
    given transposed (`_compose`)."""
    x = s0
    h = tl.arange(0, HP)[None, None, :]
    if Q_SIDE:
        tq, sk = t, tl.permute(s, (1, 0, 2))                         # (X, 1, 1), (1, Y, 1)
        t_ok, s_ok = tq < T, _within(sk, S, EDGE)
        if HAS_PRE:
            x = _compose(s0, mq1, True, mk1, HAS_MK1, False, 0, HP, MIX, DOT_MN, DOT_K, CHAIN)
    else:
        tq, sk = tl.permute(t, (1, 0, 2)), s
        t_ok, s_ok = _within(tq, T, EDGE), sk < S
        if HAS_PRE:
            x = _compose(s0, mk1, HAS_MK1, mq1, True, False, 0, HP, MIX, DOT_MN, DOT_K, CHAIN, 0, M1T)
    if HAS_MASK:
        if not MASK_HEADS:
            m = tl.load(MASK + b * smb + tq * smt + sk * sms, mask=t_ok & s_ok, other=0.0)
            m = m.to(tl.float32)
            if HP > H:                                              # padded heads stay finite
                m = tl.where(h < H, m, 0.0)
            x = x * scale + m
        elif Q_SIDE or DOT_MN > 8:
            x = x * scale + tl.load(MASK + b * smb + h * smh + tq * smt + sk * sms,
                                    mask=(h < H) & t_ok & s_ok, other=0.0).to(tl.float32)
        else:
            hk, sq = _t(h), _t(sk)                                  # (HP, 1, 1), (1, 1, Y)
            x = x * scale + _t(tl.load(MASK + b * smb + hk * smh + tq * smt + sq * sms,
                                       mask=(hk < H) & t_ok & (sq < S), other=0.0).to(tl.float32))
    return tl.where(s_ok, x, float("-inf"))


@triton.jit
def _forward_block(start, EDGE: tl.constexpr, OUT: tl.constexpr, state, lse, b, t, hh, hm, hg, gm, dc, h0, qt0, qt1,
                   mq1, mq2, K, V, MASK, MK1, MK2, skh, sks, skd, svh, svs, svd, smb, smh, smt, sms, b1n, b2n, T, S,
                   scale, H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, MH: tl.constexpr,
                   BS: tl.constexpr, HG: tl.constexpr, HAS_MASK: tl.constexpr, MASK_HEADS: tl.constexpr,
                   HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr, HAS_POST: tl.constexpr, HAS_MK2: tl.constexpr,
                   PRECISION: tl.constexpr, MIX: tl.constexpr, DOT_MN: tl.constexpr, DOT_K: tl.constexpr,
                   FAST_EXP: tl.constexpr):
    """The forward over the BS keys from ``start``. Pass 1 (not OUT): state (m_i, l_i), the
    running row statistics (the maximum in `_logits`' units) per key lane (`_by_lane`);
    pass 2 (OUT): state, Oᵀ's accumulator. K, V, MK1, MK2 point at the sequence. EDGE: the
    block may run past S (the last one); else nothing is masked."""
    sr = start + tl.arange(0, BS)[None, :, None]
    s = start + tl.arange(0, BS)[:, None, None]
    mk1 = _matrices(HAS_PRE and HAS_MK1, MK1, s, b1n, _within(s, S, EDGE), MH, H, HP)    # the keys' matrices
    if OUT:
        mk2 = _matrices(HAS_POST and HAS_MK2, MK2, s, b2n, _within(s, S, EDGE), MH, H, HP)
    # k and v addressed from the block's first key: the offsets within a block are the same
    # every step, so the compiler computes them once and keeps them (registers held across the
    # loop), and a step adds one scalar to the pointer (query kernel: 2 % fewer instructions)
    kr = tl.arange(0, BS)
    s0 = _dot_by_halves(K + start * sks, hh * skh + kr[None, :, None] * sks, skd, hm & _within(sr, S, EDGE),
                        qt0, qt1, D, DP, PRECISION, DOT_MN)
    x = _logits(_t(s0), scale, b, t, s, T, S, True, EDGE, MASK, smb, smh, smt, sms,
                mq1, mk1, H, HP, HAS_MASK, MASK_HEADS, HAS_PRE, HAS_MK1, MIX, DOT_MN, DOT_K, False)   # (BT, BS, HP)
    xs = _logit_scale(scale, HAS_MASK)
    if OUT:
        p = _exp(x, lse[:, None, :], xs, FAST_EXP)
        if HAS_POST:
            p = _compose(p, mq2, True, mk2, HAS_MK2, False, h0, HG, MIX, DOT_MN, DOT_K, True, 1)
        else:
            p = _group(p, h0, HG)
        sc = start + tl.arange(0, BS)[None, None, :]
        vt = tl.load(V + start * svs + (hg * svh + kr[None, None, :] * svs + dc * svd),
                     mask=gm & _within(sc, S, EDGE) & (dc < D), other=0.0)
        out = _mm(vt, _t(p).to(V.dtype.element_ty), state, PRECISION, DOT_MN, 1)
    else:
        m_i, l_i = state                                                # (BT, 8, HP): per key lane
        x = _by_lane(x)
        m_new = tl.maximum(m_i, tl.max(x, axis=1))                      # in x's units
        c = m_new * xs
        l_i = l_i * _exp(m_i, c, xs, FAST_EXP) + tl.sum(_exp(x, c[:, None, :, :], xs, FAST_EXP), axis=1)
        out = (m_new, l_i)
    return out


@triton.jit
def _forward_rows(row0, Q, K, V, O, LSE, MASK, MQ1, MK1, MQ2, MK2,
                  sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                  sob, soh, sot, sod, smb, smh, smt, sms,
                  a1b, a1n, b1b, b1n,
                  a2b, a2n, b2b, b2n,
                  T, S, scale,
                  H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, MH: tl.constexpr,
                  BT: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HAS_MASK: tl.constexpr,
                  MASK_HEADS: tl.constexpr, HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr, HAS_POST: tl.constexpr,
                  HAS_MK2: tl.constexpr, PRECISION: tl.constexpr, MIX: tl.constexpr, DOT_MN: tl.constexpr, DOT_K: tl.constexpr,
                  FAST_EXP: tl.constexpr):
    """The BT queries from row0 and one group of HP/G heads (program_id 2): their rows of
    O (B, T, H, D) and LSE (B, H, T). The scores of all heads are computed (Compose mixes
    them); only the group's output columns are post-composed and accumulated. Each pass
    runs over the whole key blocks unmasked, then the last, partial one (`_forward_block`)."""
    HG: tl.constexpr = HP // G
    b = tl.program_id(1).to(tl.int64)
    h0 = 0                                                                  # the group's first head
    if G > 1:
        h0 = tl.program_id(2) * HG
    t_idx = row0 + tl.arange(0, BT)
    hh = tl.arange(0, HP)[:, None, None]                                    # (heads, ., .) tiles
    hm = hh < H
    dc = tl.arange(0, DP)[None, :, None]                                    # (heads, D, queries) tiles
    tc = t_idx[None, None, :]
    qt0, qt1 = _load_t_halves(Q + b * sqb, hh * sqh + tc * sqt, sqd, hm & (tc < T), D, DP)
    t = t_idx[:, None, None]                                                # (tokens, ., heads) tiles
    h2 = tl.arange(0, HP)[None, :]
    mq1 = _matrices(HAS_PRE, MQ1 + b * a1b, t, a1n, t < T, MH, H, HP)               # the queries' matrices
    mq2 = _matrices(HAS_POST, MQ2 + b * a2b, t, a2n, t < T, MH, H, HP)
    hg = h0 + tl.arange(0, HG)[:, None, None]                               # the group's heads
    gm = hg < H
    K += b * skb
    V += b * svb
    MK1 += b * b1b
    MK2 += b * b2b
    whole = 0 if HAS_MASK else S - S % BS                                   # keys in whole blocks: unmasked
    BE: tl.constexpr = EDGE_BLOCK if BS > EDGE_BLOCK and not HAS_MASK else BS  # the last, partial ones' step

    stats = (tl.full((BT, 8, HP), -1e30, tl.float32), tl.zeros((BT, 8, HP), tl.float32))   # per key lane
    for phase in tl.static_range(2):                                    # pass 1: row statistics
        if phase == 0 or not HAS_MASK:
            for start in range(whole if phase == 0 else 0, S if phase == 0 else whole, BE if phase == 0 else BS):
                stats = _forward_block(start, phase == 0, False, stats, 0, b, t, hh, hm, hg, gm, dc, h0, qt0, qt1,
                                       mq1, mq2, K, V, MASK, MK1, MK2, skh, sks, skd, svh, svs, svd, smb, smh, smt,
                                       sms, b1n, b2n, T, S, scale, H, D, HP, DP, MH, BE if phase == 0 else BS, HG,
                                       HAS_MASK, MASK_HEADS, HAS_PRE, HAS_MK1, HAS_POST, HAS_MK2, PRECISION, MIX,
                                       DOT_MN, DOT_K, FAST_EXP)
    m_lane, l_lane = stats
    xs = _logit_scale(scale, HAS_MASK)
    m_i = tl.max(m_lane, axis=1)                                            # the lanes' statistics merged
    l_i = tl.sum(l_lane * _exp(m_lane, m_i[:, None, :] * xs, xs, FAST_EXP), axis=1)
    lse = m_i * xs + tl.log(l_i)
    t2 = t_idx[:, None]
    tl.store(LSE + (b * H + h2) * T + t2, lse, mask=(h2 >= h0) & (h2 < h0 + HG) & (h2 < H) & (t2 < T))

    acc = tl.zeros((HG, DP, BT), tl.float32)                                # Oᵀ
    for phase in tl.static_range(2):                                    # pass 2: output
        if phase == 0 or not HAS_MASK:
            for start in range(whole if phase == 0 else 0, S if phase == 0 else whole, BE if phase == 0 else BS):
                acc = _forward_block(start, phase == 0, True, acc, lse, b, t, hh, hm, hg, gm, dc, h0, qt0, qt1, mq1,
                                     mq2, K, V, MASK, MK1, MK2, skh, sks, skd, svh, svs, svd, smb, smh, smt, sms, b1n,
                                     b2n, T, S, scale, H, D, HP, DP, MH, BE if phase == 0 else BS, HG, HAS_MASK,
                                     MASK_HEADS, HAS_PRE, HAS_MK1, HAS_POST, HAS_MK2, PRECISION, MIX, DOT_MN, DOT_K,
                                     FAST_EXP)
    tl.store(O + b * sob + hg * soh + tc * sot + dc * sod, acc.to(O.dtype.element_ty),
             mask=gm & (tc < T) & (dc < D))


@triton.jit
def forward_kernel(Q, K, V, O, LSE, MASK, MQ1, MK1, MQ2, MK2,
                   sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                   sob, soh, sot, sod, smb, smh, smt, sms,
                   a1b, a1n, b1b, b1n,
                   a2b, a2n, b2b, b2n,
                   T, S, scale,
                   H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, MH: tl.constexpr,
                   BT: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HAS_MASK: tl.constexpr,
                   MASK_HEADS: tl.constexpr, HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr, HAS_POST: tl.constexpr,
                   HAS_MK2: tl.constexpr, PRECISION: tl.constexpr, MIX: tl.constexpr, DOT_MN: tl.constexpr, DOT_K: tl.constexpr,
                   FAST_EXP: tl.constexpr, TAIL: tl.constexpr):
    """`_forward_rows` for the BT queries from program_id 0 × BT. With TAIL (`triton_core.
    block_sizes`: blocks of 32 queries) a last block that holds at most half of them runs a
    body of BT/2 rows (at 197 tokens the seventh of 32 holds 5): its tiles and products half
    the size. Both bodies are compiled into the kernel; each program runs one."""
    row0 = tl.program_id(0) * BT
    if TAIL:
        if T - row0 <= BT // 2:                                            # the last, at most half full
            _forward_rows(row0, Q, K, V, O, LSE, MASK, MQ1, MK1, MQ2, MK2, sqb, sqh, sqt, sqd, skb, skh, sks, skd,
                          svb, svh, svs, svd, sob, soh, sot, sod, smb, smh, smt, sms, a1b, a1n, b1b, b1n, a2b, a2n,
                          b2b, b2n, T, S, scale, H, D, HP, DP, MH, BT // 2, BS, G, HAS_MASK, MASK_HEADS, HAS_PRE,
                          HAS_MK1, HAS_POST, HAS_MK2, PRECISION, MIX, DOT_MN, DOT_K, FAST_EXP)
        else:
            _forward_rows(row0, Q, K, V, O, LSE, MASK, MQ1, MK1, MQ2, MK2, sqb, sqh, sqt, sqd, skb, skh, sks, skd,
                          svb, svh, svs, svd, sob, soh, sot, sod, smb, smh, smt, sms, a1b, a1n, b1b, b1n, a2b, a2n,
                          b2b, b2n, T, S, scale, H, D, HP, DP, MH, BT, BS, G, HAS_MASK, MASK_HEADS, HAS_PRE, HAS_MK1,
                          HAS_POST, HAS_MK2, PRECISION, MIX, DOT_MN, DOT_K, FAST_EXP)
    else:
        _forward_rows(row0, Q, K, V, O, LSE, MASK, MQ1, MK1, MQ2, MK2, sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb,
                      svh, svs, svd, sob, soh, sot, sod, smb, smh, smt, sms, a1b, a1n, b1b, b1n, a2b, a2n, b2b, b2n,
                      T, S, scale, H, D, HP, DP, MH, BT, BS, G, HAS_MASK, MASK_HEADS, HAS_PRE, HAS_MK1, HAS_POST,
                      HAS_MK2, PRECISION, MIX, DOT_MN, DOT_K, FAST_EXP)


@triton.jit
def _query_block(start, EDGE: tl.constexpr, GRAD: tl.constexpr, state, lse, delta, b, t, tc, hh, hm, hg, gm, h0, qt0,
                 qt1, dot0, dot1, mq1, mq2, K, V, DS, MASK, MK1, MK2, skh, sks, skd, svh, svs, svd, srh, srt, srs,
                 smb, smh, smt, sms, b1n, b2n, T, S, scale, H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr,
                 DP: tl.constexpr, MH: tl.constexpr, BS: tl.constexpr, HG: tl.constexpr, HAS_MASK: tl.constexpr,
                 MASK_HEADS: tl.constexpr, HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr, HAS_POST: tl.constexpr,
                 HAS_MK2: tl.constexpr, WANT_DMQ1: tl.constexpr, WANT_DMQ2: tl.constexpr, DS_MAP: tl.constexpr,
                 DELTA_BY_DMQ2: tl.constexpr, PRECISION: tl.constexpr, MIX: tl.constexpr, DOT_MN: tl.constexpr,
                 DOT_K: tl.constexpr, FAST_EXP: tl.constexpr):
    """The query kernel over the BS keys from ``start``. Pass 1 (not GRAD): state (delta,
    dMq2; with DELTA_BY_DMQ2, delta's key-side term only: `backward_query_kernel`); pass 2
    (GRAD): state (dqᵀ's halves, dMq1ᵀ), or with DS_MAP the block's ds written. K, V, DS,
    MK1, MK2 point at the sequence. EDGE: the block may run past S (the last one); else
    nothing is masked."""
    CHAIN: tl.constexpr = HP <= 8                   # `_compose`'s; at 16 padded heads 164 KiB of shared memory
    sr = start + tl.arange(0, BS)[None, :, None]
    s = start + tl.arange(0, BS)[:, None, None]
    mk1 = _matrices(HAS_PRE and HAS_MK1, MK1, s, b1n, _within(s, S, EDGE), MH, H, HP)    # the keys' matrices
    mk2 = _matrices(HAS_POST and HAS_MK2, MK2, s, b2n, _within(s, S, EDGE), MH, H, HP)
    if t.shape[0] < 32 and DOT_MN < 16:         # k, v addressed from the block's first key (`_forward_block`);
        k0 = start                              # at 32 queries the offsets so held spilled 8-16 B on sm_80,
        kr = tl.arange(0, BS)                   # under 3.4 (DOT_MN 16) 8 B at 6 heads: from the sequence's
    else:                                       # first there
        k0 = 0
        kr = start + tl.arange(0, BS)
    s0 = _t(_dot_by_halves(K + k0 * sks, hh * skh + kr[None, :, None] * sks, skd, hm & _within(sr, S, EDGE),
                           qt0, qt1, D, DP, PRECISION, DOT_MN))              # unscaled
    x = _logits(s0, scale, b, t, s, T, S, True, EDGE, MASK, smb, smh, smt, sms,
                mq1, mk1, H, HP, HAS_MASK, MASK_HEADS, HAS_PRE, HAS_MK1, MIX, DOT_MN, DOT_K, CHAIN)
    xs = _logit_scale(scale, HAS_MASK)
    if not GRAD:
        p = _exp(x, lse[:, None, :], xs, FAST_EXP)
    dp = _t(_dot_by_halves(V + k0 * svs, hh * svh + kr[None, :, None] * svs, svd, hm & _within(sr, S, EDGE),
                           dot0, dot1, D, DP, PRECISION, DOT_MN))            # dL/dp2 (BT, BS, HP)
    if not GRAD:
        delta, dm2 = state
        if DELTA_BY_DMQ2:                           # post-compose's query-side term left out of dp
            dm2 = _matrix_grad(dm2, p, dp, MIX, DOT_MN, DOT_K)
            if HAS_MK2:
                dp = _compose(dp, 0, False, mk2, True, True, 0, HP, MIX, DOT_MN, DOT_K, CHAIN)
                delta += tl.sum(_by_lane(p * dp), axis=1)
        else:
            if HAS_POST:
                if WANT_DMQ2:
                    dm2 = _matrix_grad(dm2, p, _group(dp, h0, HG), MIX, DOT_MN, DOT_K)
                dp = _compose(dp, mq2, True, mk2, HAS_MK2, True, 0, HP, MIX, DOT_MN, DOT_K, CHAIN)
            delta += tl.sum(_by_lane(p * dp), axis=1)                    # per key lane
        out = (delta, dm2)
    else:
        dqt0, dqt1, dm1t = state
        if HAS_POST:
            dp = _compose(dp, mq2, True, mk2, HAS_MK2, True, 0, HP, MIX, DOT_MN, DOT_K, CHAIN)
        ds = _exp(x, lse[:, None, :], xs, FAST_EXP) * (dp - delta[:, None, :])    # dL/ds1
        if HAS_PRE:
            if WANT_DMQ1:
                dm1t = _matrix_grad(dm1t, ds, _group(s0, h0, HG), MIX, DOT_MN, DOT_K)
            ds = _compose(ds, mq1, True, mk1, HAS_MK1, True, h0, HG, MIX, DOT_MN, DOT_K, CHAIN,
                          2 if CHAIN else 1)
        else:
            ds = _group(ds, h0, HG)
        sc = start + tl.arange(0, BS)[None, None, :]
        ds = _t(ds).to(K.dtype.element_ty)                                  # (heads, keys, queries)
        if DS_MAP:                                                          # dq, dk: products outside
            tl.store(DS + hg * srh + sr * srs + tc * srt, ds, mask=gm & _within(sr, S, EDGE) & (tc < T))
        else:
            dqt0, dqt1 = _acc_by_halves(dqt0, dqt1, K + k0 * sks, hg * skh + kr[None, None, :] * sks, skd,
                                        gm & _within(sc, S, EDGE), ds, D, DP, PRECISION, DOT_MN)
        out = (dqt0, dqt1, dm1t)
    return out


@triton.jit
def _query_rows(row0, Q, K, V, DO, LSE, DELTA, DQ, DMQ1, DMQ2, DS, MASK, MQ1, MK1, MQ2, MK2,
                sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                sgb, sgh, sgt, sgd, sdb, sdh, sdt, sdd, srb, srh, srt, srs, smb, smh, smt, sms,
                a1b, a1n, b1b, b1n,
                a2b, a2n, b2b, b2n,
                T, S, scale,
                H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, MH: tl.constexpr,
                BT: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HAS_MASK: tl.constexpr,
                MASK_HEADS: tl.constexpr, HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr, HAS_POST: tl.constexpr,
                HAS_MK2: tl.constexpr, WANT_DMQ1: tl.constexpr, WANT_DMQ2: tl.constexpr,
                DS_MAP: tl.constexpr, PRECISION: tl.constexpr, MIX: tl.constexpr, DOT_MN: tl.constexpr, DOT_K: tl.constexpr,
                FAST_EXP: tl.constexpr):
    """The BT queries from row0 and one group of HP/G heads h (program_id 2): DELTA (B, H, T)
    and dq (B, H, T, D) of those heads (with DS_MAP the scores' gradient DS (B, H, T, S)
    instead, in the operands' dtype), and the per-query matrix gradients dMq1[t, h, :],
    dMq2[t, :, h] (B, T, H, H). Each pass runs over the whole key blocks unmasked, then the
    last, partial one (`_query_block`)."""
    HG: tl.constexpr = HP // G
    b = tl.program_id(1).to(tl.int64)
    h0 = 0                                                                  # the group's first head
    if G > 1:
        h0 = tl.program_id(2) * HG
    t_idx = row0 + tl.arange(0, BT)
    hh = tl.arange(0, HP)[:, None, None]
    hm = hh < H
    tc = t_idx[None, None, :]
    qt0, qt1 = _load_t_halves(Q + b * sqb, hh * sqh + tc * sqt, sqd, hm & (tc < T), D, DP)
    dot0, dot1 = _load_t_halves(DO + b * sgb, hh * sgh + tc * sgt, sgd, hm & (tc < T), D, DP)
    t = t_idx[:, None, None]
    t2 = t_idx[:, None]
    h2 = tl.arange(0, HP)[None, :]
    stat = (b * H + h2) * T + t2                                            # (BT, HP)
    mq1 = _matrices(HAS_PRE, MQ1 + b * a1b, t, a1n, t < T, MH, H, HP)               # the queries' matrices
    mq2 = _matrices(HAS_POST, MQ2 + b * a2b, t, a2n, t < T, MH, H, HP)
    lse = tl.load(LSE + stat, mask=(h2 < H) & (t2 < T), other=0.0)
    hg = h0 + tl.arange(0, HG)[:, None, None]                               # the group's heads
    gm = hg < H
    K += b * skb
    V += b * svb
    DS += b * srb
    MK1 += b * b1b
    MK2 += b * b2b
    whole = 0 if HAS_MASK else S - S % BS                                   # keys in whole blocks: unmasked
    DELTA_BY_DMQ2: tl.constexpr = HAS_POST and G == 1 and HP <= 8           # delta's query-side term by dMq2:
                                                                            # every head's dMq2 (G = 1), chained

    state = (tl.zeros((BT, 8, HP), tl.float32), tl.zeros((BT, HP, HG), tl.float32))   # delta per key lane, dMq2
    for phase in tl.static_range(2):                                    # pass 1: delta, dMq2
        if phase == 0 or not HAS_MASK:
            for start in range(whole if phase == 0 else 0, S if phase == 0 else whole, BS):
                state = _query_block(start, phase == 0, False, state, lse, 0, b, t, tc, hh, hm, hg, gm, h0, qt0, qt1,
                                     dot0, dot1, mq1, mq2, K, V, DS, MASK, MK1, MK2, skh, sks, skd, svh, svs, svd,
                                     srh, srt, srs, smb, smh, smt, sms, b1n, b2n, T, S, scale, H, D, HP, DP, MH, BS,
                                     HG, HAS_MASK, MASK_HEADS, HAS_PRE, HAS_MK1, HAS_POST, HAS_MK2, WANT_DMQ1,
                                     WANT_DMQ2, DS_MAP, DELTA_BY_DMQ2, PRECISION, MIX, DOT_MN, DOT_K, FAST_EXP)
    delta, dm2 = state
    delta = tl.sum(delta, axis=1)
    if DELTA_BY_DMQ2:                           # Σ_s p[g] Σ_h Mq2[t,g,h] dp[h] = Σ_h Mq2[t,g,h] dMq2[t,g,h]
        delta += tl.sum(mq2 * dm2, axis=2)
    tl.store(DELTA + stat, delta, mask=(h2 >= h0) & (h2 < h0 + HG) & (h2 < H) & (t2 < T))
    if WANT_DMQ2:                                                           # stored now: not live in pass 2
        _store_matrix_grad(DMQ2, dm2, b, t_idx, T, 0, h0, H, MH)

    DH: tl.constexpr = DP // 2 if DP >= 32 else DP                          # dqᵀ by halves of D
    state = (tl.zeros((HG, DH, BT), tl.float32), tl.zeros((HG, DH, BT), tl.float32),   # dqᵀ, dMq1ᵀ: 8 queries,
             tl.zeros((BT, HP, HG), tl.float32))                                       # heads as columns
    for phase in tl.static_range(2):                                    # pass 2: dq, dMq1
        if phase == 0 or not HAS_MASK:
            for start in range(whole if phase == 0 else 0, S if phase == 0 else whole, BS):
                state = _query_block(start, phase == 0, True, state, lse, delta, b, t, tc, hh, hm, hg, gm, h0, qt0,
                                     qt1, dot0, dot1, mq1, mq2, K, V, DS, MASK, MK1, MK2, skh, sks, skd, svh, svs,
                                     svd, srh, srt, srs, smb, smh, smt, sms, b1n, b2n, T, S, scale, H, D, HP, DP, MH,
                                     BS, HG, HAS_MASK, MASK_HEADS, HAS_PRE, HAS_MK1, HAS_POST, HAS_MK2, WANT_DMQ1,
                                     WANT_DMQ2, DS_MAP, DELTA_BY_DMQ2, PRECISION, MIX, DOT_MN, DOT_K, FAST_EXP)
    dqt0, dqt1, dm1t = state
    t_idx = _opaque(t_idx, FAST_EXP)        # the stores' addresses computed here: shared with dMq2's,
    tc = t_idx[None, None, :]               # 32-query blocks kept them across pass 2 (40 B spilled)
    if not DS_MAP:
        _store_t_halves(DQ + b * sdb, hg * sdh + tc * sdt, sdd, gm & (tc < T), dqt0 * scale, dqt1 * scale, D, DP)
    if WANT_DMQ1:                                                           # s0's scale applied here
        _store_matrix_grad(DMQ1, dm1t * scale, b, t_idx, T, h0, 0, H, MH, True)


@triton.jit
def backward_query_kernel(Q, K, V, DO, LSE, DELTA, DQ, DMQ1, DMQ2, DS, MASK, MQ1, MK1, MQ2, MK2,
                          sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                          sgb, sgh, sgt, sgd, sdb, sdh, sdt, sdd, srb, srh, srt, srs, smb, smh, smt, sms,
                          a1b, a1n, b1b, b1n,
                          a2b, a2n, b2b, b2n,
                          T, S, scale,
                          H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, MH: tl.constexpr,
                          BT: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HAS_MASK: tl.constexpr,
                          MASK_HEADS: tl.constexpr, HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr, HAS_POST: tl.constexpr,
                          HAS_MK2: tl.constexpr, WANT_DMQ1: tl.constexpr, WANT_DMQ2: tl.constexpr,
                          DS_MAP: tl.constexpr, PRECISION: tl.constexpr, MIX: tl.constexpr, DOT_MN: tl.constexpr, DOT_K: tl.constexpr,
                          FAST_EXP: tl.constexpr, TAIL: tl.constexpr):
    """`_query_rows` for the BT queries from program_id 0 × BT; with TAIL a last block that
    holds at most half of them takes a body of BT/2 rows, as the forward's (`forward_kernel`;
    `triton_core.block_sizes` sets it where Compose's mixing is not padded in its
    contraction, 3.8 on: under 3.5-3.7 the two bodies together spilled 8-56 B)."""
    row0 = tl.program_id(0) * BT
    if TAIL:
        if T - row0 <= BT // 2:                                            # the last, at most half full
            _query_rows(row0, Q, K, V, DO, LSE, DELTA, DQ, DMQ1, DMQ2, DS, MASK, MQ1, MK1, MQ2, MK2, sqb, sqh, sqt,
                        sqd, skb, skh, sks, skd, svb, svh, svs, svd, sgb, sgh, sgt, sgd, sdb, sdh, sdt, sdd, srb, srh,
                        srt, srs, smb, smh, smt, sms, a1b, a1n, b1b, b1n, a2b, a2n, b2b, b2n, T, S, scale, H, D, HP,
                        DP, MH, BT // 2, BS, G, HAS_MASK, MASK_HEADS, HAS_PRE, HAS_MK1, HAS_POST, HAS_MK2, WANT_DMQ1,
                        WANT_DMQ2, DS_MAP, PRECISION, MIX, DOT_MN, DOT_K, FAST_EXP)
        else:
            _query_rows(row0, Q, K, V, DO, LSE, DELTA, DQ, DMQ1, DMQ2, DS, MASK, MQ1, MK1, MQ2, MK2, sqb, sqh, sqt,
                        sqd, skb, skh, sks, skd, svb, svh, svs, svd, sgb, sgh, sgt, sgd, sdb, sdh, sdt, sdd, srb, srh,
                        srt, srs, smb, smh, smt, sms, a1b, a1n, b1b, b1n, a2b, a2n, b2b, b2n, T, S, scale, H, D, HP,
                        DP, MH, BT, BS, G, HAS_MASK, MASK_HEADS, HAS_PRE, HAS_MK1, HAS_POST, HAS_MK2, WANT_DMQ1,
                        WANT_DMQ2, DS_MAP, PRECISION, MIX, DOT_MN, DOT_K, FAST_EXP)
    else:
        _query_rows(row0, Q, K, V, DO, LSE, DELTA, DQ, DMQ1, DMQ2, DS, MASK, MQ1, MK1, MQ2, MK2, sqb, sqh, sqt, sqd,
                    skb, skh, sks, skd, svb, svh, svs, svd, sgb, sgh, sgt, sgd, sdb, sdh, sdt, sdd, srb, srh, srt,
                    srs, smb, smh, smt, sms, a1b, a1n, b1b, b1n, a2b, a2n, b2b, b2n, T, S, scale, H, D, HP, DP, MH,
                    BT, BS, G, HAS_MASK, MASK_HEADS, HAS_PRE, HAS_MK1, HAS_POST, HAS_MK2, WANT_DMQ1, WANT_DMQ2,
                    DS_MAP, PRECISION, MIX, DOT_MN, DOT_K, FAST_EXP)


@triton.jit
def _key_block(start, EDGE: tl.constexpr, state, b, s, h3, hh, hm, hg, gm, h0, kt0, kt1, vt0, vt1, mk1, mk2, Q, DO,
               LSE, DELTA, MASK, MQ1, MQ2, sqh, sqt, sqd, sgh, sgt, sgd, smb, smh, smt, sms, a1n, a2n, T, S, scale,
               H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, MH: tl.constexpr,
               BT: tl.constexpr, HG: tl.constexpr, HAS_MASK: tl.constexpr, MASK_HEADS: tl.constexpr,
               HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr, HAS_POST: tl.constexpr, HAS_MK2: tl.constexpr,
               WANT_DMK1: tl.constexpr, WANT_DMK2: tl.constexpr, DS_MAP: tl.constexpr, PRECISION: tl.constexpr,
               MIX: tl.constexpr, DOT_MN: tl.constexpr, DOT_K: tl.constexpr, FAST_EXP: tl.constexpr):
    """The key kernel over the BT queries from ``start``: state (dkᵀ's and dvᵀ's halves,
    dMk1ᵀ, dMk2). Q, DO, LSE, DELTA, MQ1, MQ2 point at the sequence (offsets within it are
    32-bit). EDGE: the block may run past T (the last one); else its loads are unmasked."""
    dkt0, dkt1, dvt0, dvt1, dm1t, dm2 = state
    tr = start + tl.arange(0, BT)[None, :, None]
    t = start + tl.arange(0, BT)[:, None, None]
    # 8 keys at 16 padded heads: the queries' side of a stage that gives all heads is taken
    # transposed (`_mix`), so the queries' matrices are loaded as each product takes them, not
    # transposed through shared memory: mq1ᵀ (pre-compose; its backward, by head group, wants
    # it so too), mq2ᵀ for post-compose, where it gives all heads, and mq2 for its backward
    QT: tl.constexpr = s.shape[0] < 16 and HP >= 16
    QTG: tl.constexpr = QT and HG == HP
    mq1 = _matrices(HAS_PRE, MQ1, t, a1n, _within(t, T, EDGE), MH, H, HP, QT)           # the queries' matrices
    mq2 = _matrices(HAS_POST, MQ2, t, a2n, _within(t, T, EDGE), MH, H, HP)
    if s.shape[0] < 16 and HP >= 16:    # q, do, lse, delta addressed from the block's first query (`_forward_block`);
        t0 = start                      # at 16 keys the offsets so held spilled on sm_80 (Triton 3.9: 32 B) and
        qr = tl.arange(0, BT)           # took more instructions than they saved under 3.9, at 8 keys and 8 padded
    else:                               # heads (3.5-3.7) 1-2 % more: from the sequence's first there
        t0 = 0
        qr = start + tl.arange(0, BT)
    s0 = _t(_dot_by_halves(Q + t0 * sqt, hh * sqh + qr[None, :, None] * sqt, sqd, hm & _within(tr, T, EDGE),
                           kt0, kt1, D, DP, PRECISION, DOT_MN))              # unscaled
    x = _logits(s0, scale, b, t, s, T, S, False, EDGE, MASK, smb, smh, smt, sms,
                mq1, mk1, H, HP, HAS_MASK, MASK_HEADS, HAS_PRE, HAS_MK1, MIX, DOT_MN, DOT_K, True, QT)   # (BS, BT, HP)
    stat = h3 * T + qr[None, :, None]                                      # from LSE + t0, DELTA + t0
    xs = _logit_scale(scale, HAS_MASK)
    p = _exp(x, tl.load(LSE + t0 + stat, mask=(h3 < H) & _within(tr, T, EDGE), other=0.0), xs, FAST_EXP)
    if EDGE:
        p = tl.where(tr < T, p, 0.0)
    tc = start + tl.arange(0, BT)[None, None, :]
    if HAS_POST:                                                        # dv first: p2 dies here
        if QTG:
            p2 = _compose(p, mk2, HAS_MK2, _matrices(HAS_POST, MQ2, t, a2n, _within(t, T, EDGE), MH, H, HP, True),
                          True, False, h0, HG, MIX, DOT_MN, DOT_K, True, 2, True)
        else:
            p2 = _compose(p, mk2, HAS_MK2, mq2, True, False, h0, HG, MIX, DOT_MN, DOT_K, True, 2)
    else:
        p2 = _group(p, h0, HG)
    dvt0, dvt1 = _acc_by_halves(dvt0, dvt1, DO + t0 * sgt, hg * sgh + qr[None, None, :] * sgt, sgd,
                                gm & _within(tc, T, EDGE), _t(p2).to(DO.dtype.element_ty), D, DP, PRECISION, DOT_MN)
    dp = _t(_dot_by_halves(DO + t0 * sgt, hh * sgh + qr[None, :, None] * sgt, sgd, hm & _within(tr, T, EDGE),
                           vt0, vt1, D, DP, PRECISION, DOT_MN))          # dL/dp2 (BS, BT, HP)
    if HAS_POST:
        if WANT_DMK2:
            dm2 = _matrix_grad(dm2, p, _group(dp, h0, HG), MIX, DOT_MN, DOT_K)
        dp = _compose(dp, mk2, HAS_MK2, mq2, True, True, 0, HP, MIX, DOT_MN, DOT_K, True)
    ds = p * (dp - tl.load(DELTA + t0 + stat, mask=(h3 < H) & _within(tr, T, EDGE), other=0.0))
    if HAS_PRE:
        if WANT_DMK1:
            dm1t = _matrix_grad(dm1t, ds, _group(s0, h0, HG), MIX, DOT_MN, DOT_K)
    if not DS_MAP:
        if HAS_PRE:                                                     # unchained: in place and chained,
            ds = _compose(ds, mk1, HAS_MK1, mq1, True, True, h0, HG, MIX, DOT_MN, DOT_K, False, 2, QT)   # 8 B spilled
        else:
            ds = _group(ds, h0, HG)
        # q from the sequence's first query here: from the block's, the 6-head kernel spilled 8 B (3.8)
        dkt0, dkt1 = _acc_by_halves(dkt0, dkt1, Q, hg * sqh + tc * sqt, sqd, gm & _within(tc, T, EDGE),
                                    _t(ds).to(Q.dtype.element_ty), D, DP, PRECISION, DOT_MN)
    return dkt0, dkt1, dvt0, dvt1, dm1t, dm2


@triton.jit
def backward_key_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DMK1, DMK2, MASK, MQ1, MK1, MQ2, MK2,
                        sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                        sgb, sgh, sgt, sgd, sdb, sdh, sds, sdd, smb, smh, smt, sms,
                        a1b, a1n, b1b, b1n,
                        a2b, a2n, b2b, b2n,
                        T, S, scale,
                        H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, MH: tl.constexpr,
                        BT: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HAS_MASK: tl.constexpr,
                        MASK_HEADS: tl.constexpr, HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr, HAS_POST: tl.constexpr,
                        HAS_MK2: tl.constexpr, WANT_DMK1: tl.constexpr, WANT_DMK2: tl.constexpr,
                        DS_MAP: tl.constexpr, PRECISION: tl.constexpr, MIX: tl.constexpr, DOT_MN: tl.constexpr, DOT_K: tl.constexpr,
                        FAST_EXP: tl.constexpr):
    """One block of BS keys and one group of HP/G heads h (program_id 2), over every query
    block: dk (not with DS_MAP), dv (B, H, S, D) (the same strides) of those heads and the
    key-side matrix gradients dMk1[s, h, :], dMk2[s, :, h] (B, S, H, H). Compose tiles are
    (keys, queries, heads). The whole query blocks run unmasked, then the last, partial one
    (`_key_block`)."""
    HG: tl.constexpr = HP // G
    b = tl.program_id(1).to(tl.int64)
    h0 = 0                                                                  # the group's first head
    if G > 1:
        h0 = tl.program_id(2) * HG
    s_idx = tl.program_id(0) * BS + tl.arange(0, BS)
    hh = tl.arange(0, HP)[:, None, None]
    hm = hh < H
    s = s_idx[:, None, None]
    h3 = tl.arange(0, HP)[None, None, :]
    mk1 = _matrices(HAS_PRE and HAS_MK1, MK1 + b * b1b, s, b1n, s < S, MH, H, HP)    # the keys' matrices
    mk2 = _matrices(HAS_POST and HAS_MK2, MK2 + b * b2b, s, b2n, s < S, MH, H, HP)
    hg = h0 + tl.arange(0, HG)[:, None, None]                               # the group's heads
    gm = hg < H
    sc = s_idx[None, None, :]
    kt0, kt1 = _load_t_halves(K + b * skb, hh * skh + sc * sks, skd, hm & (sc < S), D, DP)
    vt0, vt1 = _load_t_halves(V + b * svb, hh * svh + sc * svs, svd, hm & (sc < S), D, DP)
    Q += b * sqb
    DO += b * sgb
    MQ1 += b * a1b
    MQ2 += b * a2b
    LSE += b * H * T                                                        # 32-bit offsets in the loop
    DELTA += b * H * T
    whole = 0 if HAS_MASK else T - T % BT                                   # queries in whole blocks: unmasked
    DH: tl.constexpr = DP // 2 if DP >= 32 else DP                          # dkᵀ, dvᵀ by halves of D:
    state = (tl.zeros((HG, DH, BS), tl.float32), tl.zeros((HG, DH, BS), tl.float32),   # 8 keys fill a tensor-core
             tl.zeros((HG, DH, BS), tl.float32), tl.zeros((HG, DH, BS), tl.float32),   # product's columns;
             tl.zeros((BS, HP, HG), tl.float32), tl.zeros((BS, HP, HG), tl.float32))   # dMk1ᵀ: 8 heads as columns
    for phase in tl.static_range(2):                                    # the last, partial block first
        if phase == 0 or not HAS_MASK:
            for start in range(whole if phase == 0 else 0, T if phase == 0 else whole, BT):
                state = _key_block(start, phase == 0, state, b, s, h3, hh, hm, hg, gm, h0, kt0, kt1, vt0, vt1, mk1,
                                   mk2, Q, DO, LSE, DELTA, MASK, MQ1, MQ2, sqh, sqt, sqd, sgh, sgt, sgd, smb, smh,
                                   smt, sms, a1n, a2n, T, S, scale, H, D, HP, DP, MH, BT, HG, HAS_MASK, MASK_HEADS,
                                   HAS_PRE, HAS_MK1, HAS_POST, HAS_MK2, WANT_DMK1, WANT_DMK2, DS_MAP, PRECISION, MIX,
                                   DOT_MN, DOT_K, FAST_EXP)
    dkt0, dkt1, dvt0, dvt1, dm1t, dm2 = state
    out = b * sdb + hg * sdh + sc * sds
    if not DS_MAP:
        _store_t_halves(DK, out, sdd, gm & (sc < S), dkt0 * scale, dkt1 * scale, D, DP)
    _store_t_halves(DV, out, sdd, gm & (sc < S), dvt0, dvt1, D, DP)
    if WANT_DMK1:                                                           # s0's scale applied here
        _store_matrix_grad(DMK1, tl.permute(dm1t, (0, 2, 1)) * scale, b, s_idx, S, h0, 0, H, MH)
    if WANT_DMK2:
        _store_matrix_grad(DMK2, dm2, b, s_idx, S, 0, h0, H, MH)


@triton.jit
def _mm2(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` for 2-D tiles (`_dot`'s "exact" in the interpreter)."""
    if PRECISION == "exact":
        return acc + tl.reshape(_dot(a[None], b[None], PRECISION), (a.shape[0], b.shape[1]))
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def score_grad_products_kernel(DS, Q, K, DQ, DK, srb, srh, srt, srs, sqb, sqh, sqt, sqd, skb, skh, sks, skd,
                               sab, sah, sat, sad, sbb, sbh, sbs, sbd, T, S, scale,
                               D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr, BT: tl.constexpr,
                               PRECISION: tl.constexpr):
    """dq = scale · ds k and dk = scale · dsᵀ q from the score-gradient map DS (B, H, T, S)
    (``DS_MAP``), reading it once: one program per (head, sequence) holds all S ≤ SP keys'
    k and dk accumulator and runs over the queries in blocks of BT, each block's map rows
    multiplied by k into its dq rows and, transposed, by its q rows into dk."""
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SP)[:, None]
    sr = tl.arange(0, SP)[None, :]
    d = tl.arange(0, DP)[None, :]
    k = tl.load(K + b * skb + h * skh + s * sks + d * skd, mask=(s < S) & (d < D), other=0.0)
    DS += b * srb + h * srh
    Q += b * sqb + h * sqh
    DQ += b * sab + h * sah
    dk = tl.zeros((SP, DP), tl.float32)
    for start in range(0, T, BT):
        t = start + tl.arange(0, BT)[:, None]
        ds = tl.load(DS + t * srt + sr * srs, mask=(t < T) & (sr < S), other=0.0)        # (BT, SP)
        q = tl.load(Q + t * sqt + d * sqd, mask=(t < T) & (d < D), other=0.0)
        dq = _mm2(ds, k, tl.zeros((BT, DP), tl.float32), PRECISION)
        tl.store(DQ + t * sat + d * sad, (dq * scale).to(DQ.dtype.element_ty), mask=(t < T) & (d < D))
        dk = _mm2(tl.trans(ds), q, dk, PRECISION)
    tl.store(DK + b * sbb + h * sbh + s * sbs + d * sbd, (dk * scale).to(DK.dtype.element_ty),
             mask=(s < S) & (d < D))
