"""Triton kernels of the fused DCMHA attention core: forward and backward, flash-style.

Each program holds one block of queries (or, in the key pass of backward, one block of keys)
for **all** heads at once: Compose mixes heads, so no program may own fewer. Per key block
(docs/spec.md §1.1, with each stage merged into per-token H×H matrices as in
`dcvit.matrices`)::

    s0[h]  = scale · q[h] k[h]ᵀ                                    tl.dot, fp32 accumulate
    s1[h]  = Σ_g s0[g] · (Mq1[t,g,h] + Mk1[s,g,h]) + mask[h]       pre-compose
    p[h]   = exp(s1[h] - lse[h])                                   softmax, lse = log Σ_s exp s1
    p2[h]  = Σ_g p[g]  · (Mq2[t,g,h] + Mk2[s,g,h])                 post-compose
    o[h]  += p2[h] v[h]                                            tl.dot

Layout. The products with q, k, v are batched over heads, tiles ``(heads, rows, cols)``.
Compose runs on the same values laid out ``(rows, cols, heads)``: there its query-side term
is, for every query t, the product ``(keys × heads) @ Mq[t]`` and its key-side term, for
every key s, ``(queries × heads) @ Mk[s]``, so each stage is two batched `tl.dot` over the
head axis, and each matrix gradient (``dMq[t] = Σ_s a[t,s,:]ᵀ d[t,s,:]``) is one more. Going
between the layouts is a `tl.permute` (one pass through shared memory); nothing extracts
heads one at a time. The head axis is padded to `HP` ≥ 8, the smallest that a float32
`tl.dot` takes; padded heads, queries, keys and head-dim lanes are masked.

Post-compose mixes *normalised* weights of different heads, so the forward makes two
passes over the keys: the first finds each head's row statistics (``lse``, saved for
backward), the second recomputes the scores and accumulates the output. No (B, H, T, S)
map is ever written to memory.

Backward recomputes everything from q, k, v, the matrices and ``lse`` in two kernels:

* `backward_query_kernel`, one program per block of queries: pass 1 over the keys gives
  ``delta[h,t] = Σ_s p·dp`` (the softmax backward's row term; with post-compose it is not
  ``Σ o·do``) and the query-side matrices' gradient dMq2; pass 2 gives dq and dMq1.
* `backward_key_kernel`, one program per block of keys, looping over query blocks: dk, dv
  and the key-side matrices' gradients dMk1, dMk2, which are sums over *all* queries. A
  program owns its keys' rows of those sums, so they are written once, in a fixed order:
  deterministic, no atomics, no per-query-block partial buffers. Its tiles are
  ``(keys, queries, heads)``: the key side is the one its own rows index.

All loads and stores go through explicit strides (q, k, v may be views of the qkv
projection). The kernels never import the dispatcher; `dcvit.kernels.triton_core`
launches them.
"""
import triton
import triton.language as tl

__all__ = ["forward_kernel", "backward_query_kernel", "backward_key_kernel"]


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """``a @ b`` (3-D, batched over heads) accumulated in float32. PRECISION "exact": the
    operands' exact float32 values multiplied in full precision (Triton's interpreter
    cannot multiply bfloat16 tiles; the products of bf16 values are exact in float32, so
    the result is what a bf16 tensor-core product with float32 accumulation gives)."""
    if PRECISION == "exact":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _heads_last(x):
    """(heads, rows, cols) -> (rows, cols, heads)."""
    return tl.permute(x, (1, 2, 0))


@triton.jit
def _dot_t(a, b, PRECISION: tl.constexpr):
    """``a @ bᵀ`` for (heads, rows, D) tiles a and b."""
    return _dot(a, tl.permute(b, (0, 2, 1)), PRECISION)


@triton.jit
def _heads_first(x):
    """(rows, cols, heads) -> (heads, rows, cols)."""
    return tl.permute(x, (2, 0, 1))


@triton.jit
def _mix(a, M, rows, n_stride, g_stride, h_stride, rows_ok, H: tl.constexpr, HP: tl.constexpr,
         MIX: tl.constexpr):
    """``out[x, y, h] = Σ_g a[x, y, g] · M[rows[x], g, h]``: a (X, Y, HP) float32 tile times
    the H×H matrices of the tokens on its axis 0 (rows: their indices, (X, 1, 1)), one
    batched product. Swapping g_stride and h_stride applies the transposed matrices."""
    g = tl.arange(0, HP)[None, :, None]
    h = tl.arange(0, HP)[None, None, :]
    m = tl.load(M + rows * n_stride + g * g_stride + h * h_stride,
                mask=rows_ok & (g < H) & (h < H), other=0.0)
    return tl.dot(a, m, input_precision=MIX)


@triton.jit
def _compose(a, M0, r0, n0, g0, h0, ok0, HAS0: tl.constexpr, M1, r1, n1, g1, h1, ok1,
             HAS1: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, MIX: tl.constexpr):
    """``out[x, y, h] = Σ_g a[x, y, g] · (M0[r0[x], g, h] + M1[r1[y], g, h])`` for a
    (X, Y, HP) tile: M0 indexed by the tokens of axis 0, M1 by those of axis 1 (r0: (X, 1, 1),
    r1: (Y, 1, 1); either may be absent)."""
    out = tl.zeros_like(a)
    if HAS0:
        out += _mix(a, M0, r0, n0, g0, h0, ok0, H, HP, MIX)
    if HAS1:
        at = tl.permute(a, (1, 0, 2))
        out += tl.permute(_mix(at, M1, r1, n1, g1, h1, ok1, H, HP, MIX), (1, 0, 2))
    return out


@triton.jit
def _matrix_grad(acc, a, d, MIX: tl.constexpr):
    """``acc[x, g, h] += Σ_y a[x, y, g] · d[x, y, h]``: a Compose matrix's gradient for the
    tokens on axis 0 (a: the stage's input, d: the gradient of its output)."""
    return tl.dot(tl.permute(a, (0, 2, 1)), d, acc, input_precision=MIX)


@triton.jit
def _store_matrix_grad(DM, acc, b, idx, N, H: tl.constexpr, HP: tl.constexpr):
    """acc[x, g, h] -> DM[b, idx[x], g, h] of a contiguous (B, N, H, H) float32 tensor."""
    n = idx[:, None, None]
    g = tl.arange(0, HP)[None, :, None]
    h = tl.arange(0, HP)[None, None, :]
    tl.store(DM + ((b * N + n) * H + g) * H + h, acc, mask=(g < H) & (h < H) & (n < N))


@triton.jit
def _scores(a, bt, scale, b, t, s, T, S, Q_SIDE: tl.constexpr, MASK, smb, smh, smt, sms,
            MQ1, a1b, a1n, a1g, a1h, MK1, b1b, b1n, b1g, b1h,
            H: tl.constexpr, HP: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PRE: tl.constexpr,
            HAS_MK1: tl.constexpr, PRECISION: tl.constexpr, MIX: tl.constexpr):
    """(s0, s1): the scaled scores ``a @ bt`` ((heads, rows, cols) operands) laid out
    (rows, cols, heads), and the logits after pre-compose and the mask, -inf at padded
    keys. t, s: query and key indices, (X, 1, 1) for axis 0 and (Y, 1, 1) for axis 1 of
    the tile: axis 0 holds the queries when Q_SIDE, else the keys."""
    s0 = _heads_last(_dot_t(a, bt, PRECISION)) * scale
    x = s0
    h = tl.arange(0, HP)[None, None, :]
    if Q_SIDE:
        tq, sk = t, tl.permute(s, (1, 0, 2))                         # (X, 1, 1), (1, Y, 1)
        if HAS_PRE:
            x = _compose(s0, MQ1 + b * a1b, t, a1n, a1g, a1h, t < T, True,
                         MK1 + b * b1b, s, b1n, b1g, b1h, s < S, HAS_MK1, H, HP, MIX)
    else:
        tq, sk = tl.permute(t, (1, 0, 2)), s
        if HAS_PRE:
            x = _compose(s0, MK1 + b * b1b, s, b1n, b1g, b1h, s < S, HAS_MK1,
                         MQ1 + b * a1b, t, a1n, a1g, a1h, t < T, True, H, HP, MIX)
    if HAS_MASK:
        x += tl.load(MASK + b * smb + h * smh + tq * smt + sk * sms,
                     mask=(h < H) & (tq < T) & (sk < S), other=0.0).to(tl.float32)
    return s0, tl.where(sk < S, x, float("-inf"))


@triton.jit
def forward_kernel(Q, K, V, O, LSE, MASK, MQ1, MK1, MQ2, MK2,
                   sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                   sob, soh, sot, sod, smb, smh, smt, sms,
                   a1b, a1n, a1g, a1h, b1b, b1n, b1g, b1h,
                   a2b, a2n, a2g, a2h, b2b, b2n, b2g, b2h,
                   T, S, scale,
                   H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                   BT: tl.constexpr, BS: tl.constexpr, HAS_MASK: tl.constexpr,
                   HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr, HAS_POST: tl.constexpr,
                   HAS_MK2: tl.constexpr, PRECISION: tl.constexpr, MIX: tl.constexpr):
    """One block of BT queries, all heads: O (B, T, H, D) and LSE (B, H, T)."""
    b = tl.program_id(1).to(tl.int64)
    t_idx = tl.program_id(0) * BT + tl.arange(0, BT)
    hh = tl.arange(0, HP)[:, None, None]                                    # (heads, ., .) tiles
    d3 = tl.arange(0, DP)[None, None, :]
    hm = hh < H
    tr = t_idx[None, :, None]
    q = tl.load(Q + b * sqb + hh * sqh + tr * sqt + d3 * sqd, mask=hm & (tr < T) & (d3 < D), other=0.0)
    t = t_idx[:, None, None]                                                # (tokens, ., heads) tiles
    h2 = tl.arange(0, HP)[None, :]

    m_i = tl.full((BT, HP), -1e30, tl.float32)
    l_i = tl.zeros((BT, HP), tl.float32)
    for start in range(0, S, BS):                                           # pass 1: row statistics
        sr = start + tl.arange(0, BS)[None, :, None]
        k = tl.load(K + b * skb + hh * skh + sr * sks + d3 * skd, mask=hm & (sr < S) & (d3 < D), other=0.0)
        s = start + tl.arange(0, BS)[:, None, None]
        _, x = _scores(q, k, scale, b, t, s, T, S, True, MASK, smb, smh, smt, sms,
                       MQ1, a1b, a1n, a1g, a1h, MK1, b1b, b1n, b1g, b1h,
                       H, HP, HAS_MASK, HAS_PRE, HAS_MK1, PRECISION, MIX)    # (BT, BS, HP)
        m_new = tl.maximum(m_i, tl.max(x, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(x - m_new[:, None, :]), axis=1)
        m_i = m_new
    lse = m_i + tl.log(l_i)
    t2 = t_idx[:, None]
    tl.store(LSE + (b * H + h2) * T + t2, lse, mask=(h2 < H) & (t2 < T))

    acc = tl.zeros((HP, BT, DP), tl.float32)
    for start in range(0, S, BS):                                           # pass 2: output
        sr = start + tl.arange(0, BS)[None, :, None]
        k = tl.load(K + b * skb + hh * skh + sr * sks + d3 * skd, mask=hm & (sr < S) & (d3 < D), other=0.0)
        s = start + tl.arange(0, BS)[:, None, None]
        _, x = _scores(q, k, scale, b, t, s, T, S, True, MASK, smb, smh, smt, sms,
                       MQ1, a1b, a1n, a1g, a1h, MK1, b1b, b1n, b1g, b1h,
                       H, HP, HAS_MASK, HAS_PRE, HAS_MK1, PRECISION, MIX)
        p = tl.exp(x - lse[:, None, :])
        if HAS_POST:
            p = _compose(p, MQ2 + b * a2b, t, a2n, a2g, a2h, t < T, True,
                         MK2 + b * b2b, s, b2n, b2g, b2h, s < S, HAS_MK2, H, HP, MIX)
        v = tl.load(V + b * svb + hh * svh + sr * svs + d3 * svd, mask=hm & (sr < S) & (d3 < D), other=0.0)
        acc += _dot(_heads_first(p).to(V.dtype.element_ty), v, PRECISION)
    tl.store(O + b * sob + hh * soh + tr * sot + d3 * sod, acc.to(O.dtype.element_ty),
             mask=hm & (tr < T) & (d3 < D))


@triton.jit
def backward_query_kernel(Q, K, V, DO, LSE, DELTA, DQ, DMQ1, DMQ2, MASK, MQ1, MK1, MQ2, MK2,
                          sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                          sgb, sgh, sgt, sgd, sdb, sdh, sdt, sdd, smb, smh, smt, sms,
                          a1b, a1n, a1g, a1h, b1b, b1n, b1g, b1h,
                          a2b, a2n, a2g, a2h, b2b, b2n, b2g, b2h,
                          T, S, scale,
                          H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                          BT: tl.constexpr, BS: tl.constexpr, HAS_MASK: tl.constexpr,
                          HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr, HAS_POST: tl.constexpr,
                          HAS_MK2: tl.constexpr, WANT_DMQ1: tl.constexpr, WANT_DMQ2: tl.constexpr,
                          PRECISION: tl.constexpr, MIX: tl.constexpr):
    """One block of BT queries, all heads: DELTA (B, H, T), dq (B, H, T, D) and the per-query
    matrix gradients dMq1, dMq2 (B, T, H, H)."""
    b = tl.program_id(1).to(tl.int64)
    t_idx = tl.program_id(0) * BT + tl.arange(0, BT)
    hh = tl.arange(0, HP)[:, None, None]
    d3 = tl.arange(0, DP)[None, None, :]
    hm = hh < H
    tr = t_idx[None, :, None]
    row_ok = hm & (tr < T) & (d3 < D)
    q = tl.load(Q + b * sqb + hh * sqh + tr * sqt + d3 * sqd, mask=row_ok, other=0.0)
    do = tl.load(DO + b * sgb + hh * sgh + tr * sgt + d3 * sgd, mask=row_ok, other=0.0)
    t = t_idx[:, None, None]
    t2 = t_idx[:, None]
    h2 = tl.arange(0, HP)[None, :]
    stat = (b * H + h2) * T + t2                                            # (BT, HP)
    lse = tl.load(LSE + stat, mask=(h2 < H) & (t2 < T), other=0.0)

    delta = tl.zeros((BT, HP), tl.float32)
    dm2 = tl.zeros((BT, HP, HP), tl.float32)
    for start in range(0, S, BS):                                           # pass 1: delta, dMq2
        sr = start + tl.arange(0, BS)[None, :, None]
        kv_ok = hm & (sr < S) & (d3 < D)
        k = tl.load(K + b * skb + hh * skh + sr * sks + d3 * skd, mask=kv_ok, other=0.0)
        s = start + tl.arange(0, BS)[:, None, None]
        _, x = _scores(q, k, scale, b, t, s, T, S, True, MASK, smb, smh, smt, sms,
                       MQ1, a1b, a1n, a1g, a1h, MK1, b1b, b1n, b1g, b1h,
                       H, HP, HAS_MASK, HAS_PRE, HAS_MK1, PRECISION, MIX)
        p = tl.exp(x - lse[:, None, :])
        v = tl.load(V + b * svb + hh * svh + sr * svs + d3 * svd, mask=kv_ok, other=0.0)
        dp = _heads_last(_dot_t(do, v, PRECISION))                          # dL/dp2 (BT, BS, HP)
        if HAS_POST:
            if WANT_DMQ2:
                dm2 = _matrix_grad(dm2, p, dp, MIX)
            dp = _compose(dp, MQ2 + b * a2b, t, a2n, a2h, a2g, t < T, True,
                          MK2 + b * b2b, s, b2n, b2h, b2g, s < S, HAS_MK2, H, HP, MIX)
        delta += tl.sum(p * dp, axis=1)
    tl.store(DELTA + stat, delta, mask=(h2 < H) & (t2 < T))

    dq = tl.zeros((HP, BT, DP), tl.float32)
    dm1 = tl.zeros((BT, HP, HP), tl.float32)
    for start in range(0, S, BS):                                           # pass 2: dq, dMq1
        sr = start + tl.arange(0, BS)[None, :, None]
        kv_ok = hm & (sr < S) & (d3 < D)
        k = tl.load(K + b * skb + hh * skh + sr * sks + d3 * skd, mask=kv_ok, other=0.0)
        s = start + tl.arange(0, BS)[:, None, None]
        s0, x = _scores(q, k, scale, b, t, s, T, S, True, MASK, smb, smh, smt, sms,
                        MQ1, a1b, a1n, a1g, a1h, MK1, b1b, b1n, b1g, b1h,
                        H, HP, HAS_MASK, HAS_PRE, HAS_MK1, PRECISION, MIX)
        v = tl.load(V + b * svb + hh * svh + sr * svs + d3 * svd, mask=kv_ok, other=0.0)
        dp = _heads_last(_dot_t(do, v, PRECISION))
        if HAS_POST:
            dp = _compose(dp, MQ2 + b * a2b, t, a2n, a2h, a2g, t < T, True,
                          MK2 + b * b2b, s, b2n, b2h, b2g, s < S, HAS_MK2, H, HP, MIX)
        ds = tl.exp(x - lse[:, None, :]) * (dp - delta[:, None, :])        # dL/ds1
        if HAS_PRE:
            if WANT_DMQ1:
                dm1 = _matrix_grad(dm1, s0, ds, MIX)
            ds = _compose(ds, MQ1 + b * a1b, t, a1n, a1h, a1g, t < T, True,
                          MK1 + b * b1b, s, b1n, b1h, b1g, s < S, HAS_MK1, H, HP, MIX)
        dq += _dot(_heads_first(ds).to(K.dtype.element_ty), k, PRECISION)
    tl.store(DQ + b * sdb + hh * sdh + tr * sdt + d3 * sdd, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok)
    if WANT_DMQ1:
        _store_matrix_grad(DMQ1, dm1, b, t_idx, T, H, HP)
    if WANT_DMQ2:
        _store_matrix_grad(DMQ2, dm2, b, t_idx, T, H, HP)


@triton.jit
def backward_key_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DMK1, DMK2, MASK, MQ1, MK1, MQ2, MK2,
                        sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                        sgb, sgh, sgt, sgd, sdb, sdh, sds, sdd, smb, smh, smt, sms,
                        a1b, a1n, a1g, a1h, b1b, b1n, b1g, b1h,
                        a2b, a2n, a2g, a2h, b2b, b2n, b2g, b2h,
                        T, S, scale,
                        H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                        BT: tl.constexpr, BS: tl.constexpr, HAS_MASK: tl.constexpr,
                        HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr, HAS_POST: tl.constexpr,
                        HAS_MK2: tl.constexpr, WANT_DMK1: tl.constexpr, WANT_DMK2: tl.constexpr,
                        PRECISION: tl.constexpr, MIX: tl.constexpr):
    """One block of BS keys, all heads, over every query block: dk, dv (B, H, S, D) (the
    same strides) and the key-side matrix gradients dMk1, dMk2 (B, S, H, H). Compose tiles
    are (keys, queries, heads)."""
    b = tl.program_id(1).to(tl.int64)
    s_idx = tl.program_id(0) * BS + tl.arange(0, BS)
    hh = tl.arange(0, HP)[:, None, None]
    d3 = tl.arange(0, DP)[None, None, :]
    hm = hh < H
    sr = s_idx[None, :, None]
    key_ok = hm & (sr < S) & (d3 < D)
    k = tl.load(K + b * skb + hh * skh + sr * sks + d3 * skd, mask=key_ok, other=0.0)
    v = tl.load(V + b * svb + hh * svh + sr * svs + d3 * svd, mask=key_ok, other=0.0)
    s = s_idx[:, None, None]
    h3 = tl.arange(0, HP)[None, None, :]

    dk = tl.zeros((HP, BS, DP), tl.float32)
    dv = tl.zeros((HP, BS, DP), tl.float32)
    dm1 = tl.zeros((BS, HP, HP), tl.float32)
    dm2 = tl.zeros((BS, HP, HP), tl.float32)
    for start in range(0, T, BT):
        tr = start + tl.arange(0, BT)[None, :, None]
        row_ok = hm & (tr < T) & (d3 < D)
        q = tl.load(Q + b * sqb + hh * sqh + tr * sqt + d3 * sqd, mask=row_ok, other=0.0)
        t = start + tl.arange(0, BT)[:, None, None]
        s0, x = _scores(k, q, scale, b, t, s, T, S, False, MASK, smb, smh, smt, sms,
                        MQ1, a1b, a1n, a1g, a1h, MK1, b1b, b1n, b1g, b1h,
                        H, HP, HAS_MASK, HAS_PRE, HAS_MK1, PRECISION, MIX)   # (BS, BT, HP)
        stat = (b * H + h3) * T + tr
        p = tl.where(tr < T, tl.exp(x - tl.load(LSE + stat, mask=(h3 < H) & (tr < T), other=0.0)), 0.0)
        do = tl.load(DO + b * sgb + hh * sgh + tr * sgt + d3 * sgd, mask=row_ok, other=0.0)
        p2 = p
        if HAS_POST:
            p2 = _compose(p, MK2 + b * b2b, s, b2n, b2g, b2h, s < S, HAS_MK2,
                          MQ2 + b * a2b, t, a2n, a2g, a2h, t < T, True, H, HP, MIX)
        dv += _dot(_heads_first(p2).to(DO.dtype.element_ty), do, PRECISION)
        dp = _heads_last(_dot_t(v, do, PRECISION))                           # dL/dp2 (BS, BT, HP)
        if HAS_POST:
            if WANT_DMK2:
                dm2 = _matrix_grad(dm2, p, dp, MIX)
            dp = _compose(dp, MK2 + b * b2b, s, b2n, b2h, b2g, s < S, HAS_MK2,
                          MQ2 + b * a2b, t, a2n, a2h, a2g, t < T, True, H, HP, MIX)
        ds = p * (dp - tl.load(DELTA + stat, mask=(h3 < H) & (tr < T), other=0.0))
        if HAS_PRE:
            if WANT_DMK1:
                dm1 = _matrix_grad(dm1, s0, ds, MIX)
            ds = _compose(ds, MK1 + b * b1b, s, b1n, b1h, b1g, s < S, HAS_MK1,
                          MQ1 + b * a1b, t, a1n, a1h, a1g, t < T, True, H, HP, MIX)
        dk += _dot(_heads_first(ds).to(Q.dtype.element_ty), q, PRECISION)
    out = b * sdb + hh * sdh + sr * sds + d3 * sdd
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=key_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=key_ok)
    if WANT_DMK1:
        _store_matrix_grad(DMK1, dm1, b, s_idx, S, H, HP)
    if WANT_DMK2:
        _store_matrix_grad(DMK2, dm2, b, s_idx, S, H, HP)
