"""Compose, the cross-head mixing step of DCMHA, as one pure function (`compose`, public as
``dcvit.compose``), with its shape checks; `dcvit.attention.Compose` is its module form.

This is the reference definition every fast path is held against. It is written for
clarity and exactness, one einsum per term of the formula.
"""
from typing import Optional

import torch
from torch import Tensor

__all__ = ["compose", "compose_unchecked", "check_compose_args"]


def _check_pair(name1: str, w1: Optional[Tensor], name2: str, w2: Optional[Tensor],
                batch: int, length: int, heads: int, length_name: str) -> None:
    if (w1 is None) != (w2 is None):
        raise ValueError(f"compose: {name1} and {name2} must both be given or both be None, "
                         f"got {name1}={'None' if w1 is None else 'Tensor'}, "
                         f"{name2}={'None' if w2 is None else 'Tensor'}")
    if w1 is None or w2 is None:
        return
    for name, w in ((name1, w1), (name2, w2)):
        if w.dim() != 4 or w.shape[0] != batch or w.shape[1] != length or w.shape[3] != heads \
                or w.shape[2] < 1:
            raise ValueError(f"compose: {name} must have shape (B={batch}, {length_name}={length}, R, "
                             f"H={heads}) with R >= 1, got {tuple(w.shape)}")
    if w1.shape[2] != w2.shape[2]:
        raise ValueError(f"compose: {name1} and {name2} must have the same rank R, "
                         f"got {w1.shape[2]} and {w2.shape[2]}")


def _check_gate(name: str, g: Optional[Tensor], batch: int, length: int, heads: int,
                length_name: str) -> None:
    if g is not None and (g.dim() != 3 or tuple(g.shape) != (batch, length, heads)):
        raise ValueError(f"compose: {name} must have shape (B={batch}, {length_name}={length}, "
                         f"H={heads}), got {tuple(g.shape)}")


def check_compose_args(a: Tensor, qw1: Optional[Tensor], qw2: Optional[Tensor],
                       kw1: Optional[Tensor], kw2: Optional[Tensor],
                       qdd: Optional[Tensor], kdd: Optional[Tensor],
                       static: Optional[Tensor] = None) -> None:
    """Raise ``ValueError`` naming the offending argument if shapes do not fit docs/spec.md §1.1."""
    if a.dim() != 4:
        raise ValueError(f"compose: a must have shape (B, H, T, S), got {a.dim()} dims "
                         f"{tuple(a.shape)}")
    batch, heads, t, s = a.shape
    _check_pair("qw1", qw1, "qw2", qw2, batch, t, heads, "T")
    _check_pair("kw1", kw1, "kw2", kw2, batch, s, heads, "S")
    _check_gate("qdd", qdd, batch, t, heads, "T")
    _check_gate("kdd", kdd, batch, s, heads, "S")
    if static is not None and tuple(static.shape) != (heads, heads):
        raise ValueError(f"compose: static must have shape (H, H) = ({heads}, {heads}), "
                         f"got {tuple(static.shape)}")


def compose(a: Tensor,
            qw1: Optional[Tensor] = None, qw2: Optional[Tensor] = None,
            kw1: Optional[Tensor] = None, kw2: Optional[Tensor] = None,
            qdd: Optional[Tensor] = None, kdd: Optional[Tensor] = None,
            static: Optional[Tensor] = None) -> Tensor:
    r"""Mix attention scores or weights across heads, per query and per key.

    Args:
        a:        (B, H, T, S) attention scores (pre-softmax) or weights (post-softmax).
        qw1, qw2: (B, T, R, H) query-wise low-rank dynamic weights, or both None.
        kw1, kw2: (B, S, R, H) key-wise low-rank dynamic weights, or both None.
        qdd:      (B, T, H) query-wise dynamic gate, or None.
        kdd:      (B, S, H) key-wise dynamic gate, or None.
        static:   (H, H) optional static head-mixing matrix W (Talking-Heads), or None.

    Returns:
        A tensor of the shape and dtype of ``a``::

            out[b,h,t,s] = a[b,h,t,s]
                         + sum_r qw2[b,t,r,h] * sum_g qw1[b,t,r,g] * a[b,g,t,s]   # query-wise low-rank
                         + sum_r kw2[b,s,r,h] * sum_g kw1[b,s,r,g] * a[b,g,t,s]   # key-wise low-rank
                         + qdd[b,t,h] * a[b,h,t,s]                                # query-wise gate
                         + kdd[b,s,h] * a[b,h,t,s]                                # key-wise gate
                         + sum_g W[g,h] * a[b,g,t,s]                              # static (optional)

        Every term whose inputs are None is skipped. T may differ from S.

    Raises:
        ValueError: naming the argument whose shape does not fit.
    """
    check_compose_args(a, qw1, qw2, kw1, kw2, qdd, kdd, static)
    return compose_unchecked(a, qw1, qw2, kw1, kw2, qdd, kdd, static)


def compose_unchecked(a: Tensor,
                      qw1: Optional[Tensor], qw2: Optional[Tensor],
                      kw1: Optional[Tensor], kw2: Optional[Tensor],
                      qdd: Optional[Tensor], kdd: Optional[Tensor],
                      static: Optional[Tensor] = None) -> Tensor:
    """`compose` without the shape checks, for callers whose shapes hold by construction
    (modules traced by FX or compiled by TorchScript)."""
    out = a                                                                  # (B, H, T, S)
    if qw1 is not None and qw2 is not None:
        hidden = torch.einsum("bgts,btrg->brts", a, qw1)                     # (B, R, T, S)
        out = out + torch.einsum("brts,btrh->bhts", hidden, qw2)             # (B, H, T, S)
    if kw1 is not None and kw2 is not None:
        hidden = torch.einsum("bgts,bsrg->brts", a, kw1)                     # (B, R, T, S)
        out = out + torch.einsum("brts,bsrh->bhts", hidden, kw2)             # (B, H, T, S)
    if qdd is not None:
        out = out + a * qdd.transpose(1, 2).unsqueeze(-1)                    # (B, H, T, 1)
    if kdd is not None:
        out = out + a * kdd.transpose(1, 2).unsqueeze(-2)                    # (B, H, 1, S)
    if static is not None:
        out = out + torch.einsum("bgts,gh->bhts", a, static.to(a.dtype))     # (B, H, T, S)
    return out
