"""Triton kernels of the fused DCMHA attention core: forward and backward, flash-style.

Each program holds one block of queries (or, in the key pass of backward, one block of keys)
for **all** heads at once, as 3-D tiles ``(heads, rows, columns)`` with the head count
padded to a power of two; Compose mixes heads inside a tile, which is why no program may
own fewer than all heads. Per key block (docs/spec.md §1.1, with each stage merged into
per-token H×H matrices as in `dcvit.matrices`)::

    s0[h]  = scale · q[h] k[h]ᵀ                                    tl.dot, fp32 accumulate
    s1[h]  = Σ_g s0[g] · (Mq1[t,g,h] + Mk1[s,g,h]) + mask[h]       pre-compose
    p[h]   = exp(s1[h] - lse[h])                                   softmax, lse = log Σ_s exp s1
    p2[h]  = Σ_g p[g]  · (Mq2[t,g,h] + Mk2[s,g,h])                 post-compose
    o[h]  += p2[h] v[h]                                            tl.dot

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
  deterministic, no atomics, no per-query-block partial buffers.

All loads and stores go through explicit strides (q, k, v may be views of the qkv
projection), and padded heads, queries, keys and head-dim lanes are masked. The kernels
never import the dispatcher; `dcvit.kernels.triton_core` launches them.
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
def _compose(a, h3, MQ, mq_off, mg, mh, mq_ok, MK, mk_off, kg, kh, mk_ok,
             H: tl.constexpr, HAS_MK: tl.constexpr):
    """``out[h] = Σ_g a[g] · (MQ[mq_off + g·mg + h·mh] + MK[mk_off + g·kg + h·kh])``.

    a: (HP, X, Y) fp32; h3: head index (HP, 1, 1); mq_off/mk_off: the tokens' offsets,
    broadcastable to (1, X, Y); swapping (mg, mh) and (kg, kh) applies the transposed maps.
    """
    out = tl.zeros_like(a)
    hm = h3 < H
    for g in tl.static_range(H):
        a_g = tl.sum(tl.where(h3 == g, a, 0.0), axis=0)                      # (X, Y)
        c = tl.load(MQ + mq_off + g * mg + h3 * mh, mask=hm & mq_ok, other=0.0)
        if HAS_MK:
            c = c + tl.load(MK + mk_off + g * kg + h3 * kh, mask=hm & mk_ok, other=0.0)
        out += a_g[None, :, :] * c
    return out


@triton.jit
def _matrix_grad(acc, a, d, h3, H: tl.constexpr):
    """``acc[g, h, x] += Σ_y a[g, x, y] · d[h, x, y]``: a Compose matrix's gradient for the
    tokens on axis 1 (a: the stage's input, d: the gradient of its output)."""
    for g in tl.static_range(H):
        a_g = tl.sum(tl.where(h3 == g, a, 0.0), axis=0)                      # (X, Y)
        r = tl.sum(a_g[None, :, :] * d, axis=2)                              # (HP, X)
        acc += tl.where(h3 == g, r[None, :, :], 0.0)
    return acc


@triton.jit
def _logits(s0, h3, b, tq, sk, T, S, MASK, smb, smh, smt, sms,
            MQ1, a1b, a1n, a1g, a1h, MK1, b1b, b1n, b1g, b1h,
            H: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr):
    """Pre-compose and mask: s1 = compose1(s0) + mask, -inf at padded keys. tq/sk: query and
    key token indices broadcastable to the tile (either orientation)."""
    q_ok = tq < T
    k_ok = sk < S
    x = s0
    if HAS_PRE:
        x = _compose(s0, h3, MQ1 + b * a1b, tq * a1n, a1g, a1h, q_ok,
                     MK1 + b * b1b, sk * b1n, b1g, b1h, k_ok, H, HAS_MK1)
    if HAS_MASK:
        x += tl.load(MASK + b * smb + h3 * smh + tq * smt + sk * sms,
                     mask=(h3 < H) & q_ok & k_ok, other=0.0).to(tl.float32)
    return tl.where(k_ok, x, float("-inf"))


@triton.jit
def _store_matrix_grad(DM, acc, b, idx, N, H: tl.constexpr, HP: tl.constexpr):
    """acc[g, h, x] -> DM[b, idx[x], g, h] of a contiguous (B, N, H, H) float32 tensor."""
    g3 = tl.arange(0, HP)[:, None, None]
    h = tl.arange(0, HP)[None, :, None]
    n = idx[None, None, :]
    tl.store(DM + ((b * N + n) * H + g3) * H + h, acc, mask=(g3 < H) & (h < H) & (n < N))


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
                   HAS_MK2: tl.constexpr, PRECISION: tl.constexpr, STATS_ONLY: tl.constexpr):
    """One block of BT queries, all heads: O (B, T, H, D) and LSE (B, H, T); with
    STATS_ONLY, LSE alone (the first pass)."""
    b = tl.program_id(1).to(tl.int64)
    t_idx = tl.program_id(0) * BT + tl.arange(0, BT)
    h3 = tl.arange(0, HP)[:, None, None]
    t3 = t_idx[None, :, None]
    d3 = tl.arange(0, DP)[None, None, :]
    dc = tl.arange(0, DP)[None, :, None]                                    # head dim on axis 1
    hm = h3 < H
    q = tl.load(Q + b * sqb + h3 * sqh + t3 * sqt + d3 * sqd, mask=hm & (t3 < T) & (d3 < D), other=0.0)

    m_i = tl.full((HP, BT), -1e30, tl.float32)
    l_i = tl.zeros((HP, BT), tl.float32)
    for start in range(0, S, BS):                                           # pass 1: row statistics
        s3 = start + tl.arange(0, BS)[None, None, :]
        kt = tl.load(K + b * skb + h3 * skh + s3 * sks + dc * skd, mask=hm & (s3 < S) & (dc < D), other=0.0)
        s0 = _dot(q, kt, PRECISION) * scale                                # (HP, BT, BS)
        x = _logits(s0, h3, b, t3, s3, T, S, MASK, smb, smh, smt, sms,
                    MQ1, a1b, a1n, a1g, a1h, MK1, b1b, b1n, b1g, b1h, H, HAS_MASK, HAS_PRE, HAS_MK1)
        m_new = tl.maximum(m_i, tl.max(x, axis=2))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(x - m_new[:, :, None]), axis=2)
        m_i = m_new
    lse = m_i + tl.log(l_i)
    t2 = t_idx[None, :]
    h2 = tl.arange(0, HP)[:, None]
    tl.store(LSE + (b * H + h2) * T + t2, lse, mask=(h2 < H) & (t2 < T))
    if STATS_ONLY:
        return

    acc = tl.zeros((HP, BT, DP), tl.float32)
    for start in range(0, S, BS):                                           # pass 2: output
        s3 = start + tl.arange(0, BS)[None, None, :]
        kt = tl.load(K + b * skb + h3 * skh + s3 * sks + dc * skd, mask=hm & (s3 < S) & (dc < D), other=0.0)
        s0 = _dot(q, kt, PRECISION) * scale
        x = _logits(s0, h3, b, t3, s3, T, S, MASK, smb, smh, smt, sms,
                    MQ1, a1b, a1n, a1g, a1h, MK1, b1b, b1n, b1g, b1h, H, HAS_MASK, HAS_PRE, HAS_MK1)
        p = tl.exp(x - lse[:, :, None])
        if HAS_POST:
            p = _compose(p, h3, MQ2 + b * a2b, t3 * a2n, a2g, a2h, t3 < T,
                         MK2 + b * b2b, s3 * b2n, b2g, b2h, s3 < S, H, HAS_MK2)
        sv = start + tl.arange(0, BS)[None, :, None]
        v = tl.load(V + b * svb + h3 * svh + sv * svs + d3 * svd, mask=hm & (sv < S) & (d3 < D), other=0.0)
        acc += _dot(p.to(V.dtype.element_ty), v, PRECISION)
    tl.store(O + b * sob + h3 * soh + t3 * sot + d3 * sod, acc.to(O.dtype.element_ty),
             mask=hm & (t3 < T) & (d3 < D))


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
                          PRECISION: tl.constexpr):
    """One block of BT queries, all heads: DELTA (B, H, T), dq (B, H, T, D) and the per-query
    matrix gradients dMq1, dMq2 (B, T, H, H)."""
    b = tl.program_id(1).to(tl.int64)
    t_idx = tl.program_id(0) * BT + tl.arange(0, BT)
    h3 = tl.arange(0, HP)[:, None, None]
    t3 = t_idx[None, :, None]
    d3 = tl.arange(0, DP)[None, None, :]
    dc = tl.arange(0, DP)[None, :, None]
    hm = h3 < H
    row_ok = hm & (t3 < T) & (d3 < D)
    q = tl.load(Q + b * sqb + h3 * sqh + t3 * sqt + d3 * sqd, mask=row_ok, other=0.0)
    do = tl.load(DO + b * sgb + h3 * sgh + t3 * sgt + d3 * sgd, mask=row_ok, other=0.0)
    t2 = t_idx[None, :]
    h2 = tl.arange(0, HP)[:, None]
    stat = (b * H + h2) * T + t2
    lse = tl.load(LSE + stat, mask=(h2 < H) & (t2 < T), other=0.0)

    delta = tl.zeros((HP, BT), tl.float32)
    dm2 = tl.zeros((HP, HP, BT), tl.float32)
    for start in range(0, S, BS):                                           # pass 1: delta, dMq2
        s3 = start + tl.arange(0, BS)[None, None, :]
        kt = tl.load(K + b * skb + h3 * skh + s3 * sks + dc * skd, mask=hm & (s3 < S) & (dc < D), other=0.0)
        s0 = _dot(q, kt, PRECISION) * scale
        x = _logits(s0, h3, b, t3, s3, T, S, MASK, smb, smh, smt, sms,
                    MQ1, a1b, a1n, a1g, a1h, MK1, b1b, b1n, b1g, b1h, H, HAS_MASK, HAS_PRE, HAS_MK1)
        p = tl.exp(x - lse[:, :, None])
        vt = tl.load(V + b * svb + h3 * svh + s3 * svs + dc * svd, mask=hm & (s3 < S) & (dc < D), other=0.0)
        dp = _dot(do, vt, PRECISION)                                        # dL/dp2 (HP, BT, BS)
        if HAS_POST:
            if WANT_DMQ2:
                dm2 = _matrix_grad(dm2, p, dp, h3, H)
            dp = _compose(dp, h3, MQ2 + b * a2b, t3 * a2n, a2h, a2g, t3 < T,
                          MK2 + b * b2b, s3 * b2n, b2h, b2g, s3 < S, H, HAS_MK2)
        delta += tl.sum(p * dp, axis=2)
    tl.store(DELTA + stat, delta, mask=(h2 < H) & (t2 < T))

    dq = tl.zeros((HP, BT, DP), tl.float32)
    dm1 = tl.zeros((HP, HP, BT), tl.float32)
    for start in range(0, S, BS):                                           # pass 2: dq, dMq1
        s3 = start + tl.arange(0, BS)[None, None, :]
        kt = tl.load(K + b * skb + h3 * skh + s3 * sks + dc * skd, mask=hm & (s3 < S) & (dc < D), other=0.0)
        s0 = _dot(q, kt, PRECISION) * scale
        x = _logits(s0, h3, b, t3, s3, T, S, MASK, smb, smh, smt, sms,
                    MQ1, a1b, a1n, a1g, a1h, MK1, b1b, b1n, b1g, b1h, H, HAS_MASK, HAS_PRE, HAS_MK1)
        p = tl.exp(x - lse[:, :, None])
        vt = tl.load(V + b * svb + h3 * svh + s3 * svs + dc * svd, mask=hm & (s3 < S) & (dc < D), other=0.0)
        dp = _dot(do, vt, PRECISION)
        if HAS_POST:
            dp = _compose(dp, h3, MQ2 + b * a2b, t3 * a2n, a2h, a2g, t3 < T,
                          MK2 + b * b2b, s3 * b2n, b2h, b2g, s3 < S, H, HAS_MK2)
        ds = p * (dp - delta[:, :, None])                                   # dL/ds1
        if HAS_PRE:
            if WANT_DMQ1:
                dm1 = _matrix_grad(dm1, s0, ds, h3, H)
            ds = _compose(ds, h3, MQ1 + b * a1b, t3 * a1n, a1h, a1g, t3 < T,
                          MK1 + b * b1b, s3 * b1n, b1h, b1g, s3 < S, H, HAS_MK1)
        sk = start + tl.arange(0, BS)[None, :, None]
        k = tl.load(K + b * skb + h3 * skh + sk * sks + d3 * skd, mask=hm & (sk < S) & (d3 < D), other=0.0)
        dq += _dot(ds.to(K.dtype.element_ty), k, PRECISION)
    tl.store(DQ + b * sdb + h3 * sdh + t3 * sdt + d3 * sdd, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok)
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
                        PRECISION: tl.constexpr):
    """One block of BS keys, all heads, over every query block: dk, dv (B, H, S, D) (the
    same strides) and the key-side matrix gradients dMk1, dMk2 (B, S, H, H). Tiles are
    (heads, keys, queries)."""
    b = tl.program_id(1).to(tl.int64)
    s_idx = tl.program_id(0) * BS + tl.arange(0, BS)
    h3 = tl.arange(0, HP)[:, None, None]
    s3 = s_idx[None, :, None]
    d3 = tl.arange(0, DP)[None, None, :]
    dc = tl.arange(0, DP)[None, :, None]
    hm = h3 < H
    key_ok = hm & (s3 < S) & (d3 < D)
    k = tl.load(K + b * skb + h3 * skh + s3 * sks + d3 * skd, mask=key_ok, other=0.0)
    v = tl.load(V + b * svb + h3 * svh + s3 * svs + d3 * svd, mask=key_ok, other=0.0)

    dk = tl.zeros((HP, BS, DP), tl.float32)
    dv = tl.zeros((HP, BS, DP), tl.float32)
    dm1 = tl.zeros((HP, HP, BS), tl.float32)
    dm2 = tl.zeros((HP, HP, BS), tl.float32)
    for start in range(0, T, BT):
        t3 = start + tl.arange(0, BT)[None, None, :]
        tq = start + tl.arange(0, BT)[None, :, None]
        qt = tl.load(Q + b * sqb + h3 * sqh + t3 * sqt + dc * sqd, mask=hm & (t3 < T) & (dc < D), other=0.0)
        s0 = _dot(k, qt, PRECISION) * scale                                 # (HP, BS, BT)
        x = _logits(s0, h3, b, t3, s3, T, S, MASK, smb, smh, smt, sms,
                    MQ1, a1b, a1n, a1g, a1h, MK1, b1b, b1n, b1g, b1h, H, HAS_MASK, HAS_PRE, HAS_MK1)
        stat = (b * H + h3) * T + t3
        lse = tl.load(LSE + stat, mask=hm & (t3 < T), other=0.0)
        delta = tl.load(DELTA + stat, mask=hm & (t3 < T), other=0.0)
        p = tl.where(t3 < T, tl.exp(x - lse), 0.0)
        dot_ = tl.load(DO + b * sgb + h3 * sgh + t3 * sgt + dc * sgd, mask=hm & (t3 < T) & (dc < D), other=0.0)
        dp = _dot(v, dot_, PRECISION)                                       # dL/dp2
        p2 = p
        if HAS_POST:
            p2 = _compose(p, h3, MQ2 + b * a2b, t3 * a2n, a2g, a2h, t3 < T,
                          MK2 + b * b2b, s3 * b2n, b2g, b2h, s3 < S, H, HAS_MK2)
            if WANT_DMK2:
                dm2 = _matrix_grad(dm2, p, dp, h3, H)
            dp = _compose(dp, h3, MQ2 + b * a2b, t3 * a2n, a2h, a2g, t3 < T,
                          MK2 + b * b2b, s3 * b2n, b2h, b2g, s3 < S, H, HAS_MK2)
        do = tl.load(DO + b * sgb + h3 * sgh + tq * sgt + d3 * sgd, mask=hm & (tq < T) & (d3 < D), other=0.0)
        dv += _dot(p2.to(DO.dtype.element_ty), do, PRECISION)
        ds = p * (dp - delta)
        if HAS_PRE:
            if WANT_DMK1:
                dm1 = _matrix_grad(dm1, s0, ds, h3, H)
            ds = _compose(ds, h3, MQ1 + b * a1b, t3 * a1n, a1h, a1g, t3 < T,
                          MK1 + b * b1b, s3 * b1n, b1h, b1g, s3 < S, H, HAS_MK1)
        q = tl.load(Q + b * sqb + h3 * sqh + tq * sqt + d3 * sqd, mask=hm & (tq < T) & (d3 < D), other=0.0)
        dk += _dot(ds.to(Q.dtype.element_ty), q, PRECISION)
    out = b * sdb + h3 * sdh + s3 * sds + d3 * sdd
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=key_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=key_ok)
    if WANT_DMK1:
        _store_matrix_grad(DMK1, dm1, b, s_idx, S, H, HP)
    if WANT_DMK2:
        _store_matrix_grad(DMK2, dm2, b, s_idx, S, H, HP)
