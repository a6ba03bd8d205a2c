"""Triton kernel for the fused compose -> mask -> softmax -> compose rows (CUDA).

One program per row (b, t): the (H, S) block of all heads' scores for one query is loaded
once, composed (per key s, ``out[h,s] = sum_g a[g,s] (mq[b,t,g,h] + mk[b,g,h,s])``),
masked, soft-maxed per head, composed again and stored: the (B, H, T, S) tensor is read
once and written once, in float32. Backward is `dcvit.fused`'s recomputing PyTorch path.
Runs on CPU tensors under ``TRITON_INTERPRET=1`` (that is how the tests check it).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["available", "rows_forward"]

Stage = Tuple[Optional[Tensor], Optional[Tensor]]    # one Compose stage's (mq, mk)

try:
    import triton
    import triton.language as tl
except Exception:  # triton missing or broken: callers use the PyTorch path
    triton = None

if triton is not None:
    @triton.jit
    def _mix(a, hs, ss, hmask, m2, MQ, MK, S, H: tl.constexpr, HAS_MK: tl.constexpr):
        # a: (BLOCK_H, BLOCK_S); returns sum_g a[g, :] * (mq[g, h] + mk[g, h, :]).
        acc = tl.zeros(a.shape, dtype=tl.float32)
        for g in tl.static_range(H):
            a_g = tl.sum(tl.where(hs[:, None] == g, a, 0.0), axis=0)                  # (BLOCK_S,)
            coef = tl.load(MQ + g * H + hs, mask=hmask, other=0.0)[:, None]           # (BLOCK_H, 1)
            if HAS_MK:
                coef = coef + tl.load(MK + (g * H + hs[:, None]) * S + ss[None, :], mask=m2, other=0.0)
            acc += a_g[None, :] * coef
        return acc

    @triton.jit
    def _rows_forward_kernel(S0, OUT, MASK, msb, msh, mst, mss, MQ1, MK1, MQ2, MK2, T, S,
                             H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                             HAS_PRE: tl.constexpr, HAS_MK1: tl.constexpr, HAS_POST: tl.constexpr,
                             HAS_MK2: tl.constexpr, HAS_MASK: tl.constexpr):
        row = tl.program_id(0)
        b = row // T
        t = row % T
        hs = tl.arange(0, BLOCK_H)
        ss = tl.arange(0, BLOCK_S)
        hmask = hs < H
        smask = ss < S
        m2 = hmask[:, None] & smask[None, :]
        offs = (b * H * T + t) * S + hs[:, None] * (T * S) + ss[None, :]
        a = tl.load(S0 + offs, mask=m2, other=0.0).to(tl.float32)                      # (BLOCK_H, BLOCK_S)
        if HAS_PRE:
            a = _mix(a, hs, ss, hmask, m2, MQ1 + row * H * H, MK1 + b * H * H * S, S, H, HAS_MK1)
        if HAS_MASK:
            moffs = b * msb + t * mst + hs[:, None] * msh + ss[None, :] * mss
            a += tl.load(MASK + moffs, mask=m2, other=0.0).to(tl.float32)
        a = tl.where(smask[None, :], a, float("-inf"))
        a = tl.where(hmask[:, None], a, 0.0)
        e = tl.exp(a - tl.max(a, axis=1)[:, None])
        p = e / tl.sum(e, axis=1)[:, None]
        if HAS_POST:
            p = _mix(p, hs, ss, hmask, m2, MQ2 + row * H * H, MK2 + b * H * H * S, S, H, HAS_MK2)
        tl.store(OUT + offs, p, mask=m2)


def available() -> bool:
    """Whether Triton imports (the kernel can be compiled)."""
    return triton is not None


def _operands(s0: Tensor, stage: Stage) -> Stage:
    """A stage's matrices in the kernel's float32 layouts: Mq (B, T, H, H), Mk (B, H, H, S)."""
    B, H, T, S = s0.shape
    mq, mk = stage
    if mq is None:
        return None, None
    mq = mq.float().expand(B, T, H, H).contiguous()                          # (B, T, H, H)
    mk = None if mk is None else mk.float().permute(0, 2, 3, 1).contiguous()  # (B, H, H, S)
    return mq, mk


def rows_forward(s0: Tensor, mask: Optional[Tensor], pre: Stage, post: Stage) -> Tensor:
    """compose2(softmax(compose1(s0) + mask)) for contiguous float32 s0 (B, H, T, S)."""
    if triton is None:
        raise RuntimeError("the 'triton' attention core needs the triton package; "
                           "install it or use attn_impl='torch'")
    if s0.dtype != torch.float32:
        raise ValueError(f"the Triton rows kernel computes in float32, got scores of {s0.dtype}")
    B, H, T, S = s0.shape
    mq1, mk1 = _operands(s0, pre)
    mq2, mk2 = _operands(s0, post)
    out = torch.empty_like(s0)
    strides = mask.stride() if mask is not None else (0, 0, 0, 0)
    _rows_forward_kernel[(B * T,)](
        s0, out, mask if mask is not None else s0, strides[0], strides[1], strides[2], strides[3],
        mq1 if mq1 is not None else s0, mk1 if mk1 is not None else s0,
        mq2 if mq2 is not None else s0, mk2 if mk2 is not None else s0, T, S,
        H=H, BLOCK_H=triton.next_power_of_2(H), BLOCK_S=triton.next_power_of_2(S),
        HAS_PRE=mq1 is not None, HAS_MK1=mk1 is not None, HAS_POST=mq2 is not None,
        HAS_MK2=mk2 is not None, HAS_MASK=mask is not None)
    return out
