#!/usr/bin/env python
"""Draw the figures of docs/ from real forward passes.

    python scripts/make_figures.py [--out docs/figures]

``compose.png``: Compose on the post-softmax weights of one small DCMHA layer (4 heads,
12 tokens, rank 2) whose dynamic-weight parameters are drawn large enough to make the
mixing visible (at the paper's initialisation DCMHA starts almost exactly as MHA). Top row:
the per-head weights A (H, T, S) that softmax produced; middle row: the H x H head-mixing
matrices that the dynamic weights define for two queries (query-wise) and two keys
(key-wise); bottom row: Compose's output A'. The script checks that A' equals the mixing
matrices applied by hand before it draws anything.
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch

import dcvit
from dcvit.io import atomic_write

__all__ = ["compose_example", "mixing_matrix", "draw_compose", "main"]


def compose_example(heads: int = 4, tokens: int = 12, dim: int = 32, rank: int = 2, seed: int = 0):
    """One DCMHA forward; returns the weights before/after post-compose and its dynamic weights."""
    torch.manual_seed(seed)
    layer = dcvit.DCMHA(dim, num_heads=heads, rank=rank).eval()
    dw = layer.core.dynamic_weights
    with torch.no_grad():
        # Mixing matrices with entries of order 0.5, and peaked attention (sharper q·k).
        dw.dw1.normal_(0.0, 0.35)
        dw.qkw.normal_(0.0, 0.03)
        dw.dd_w.normal_(0.0, 0.06)
        layer.qkv.weight.mul_(2.5)
    x = torch.randn(1, tokens, dim)                                              # (B, N, C)
    rec = dcvit.attention_maps(layer, x)[0]            # the maps around post_compose
    with torch.no_grad():
        w1, w2, dd = layer.core.dynamic_weights(x)
        weights = layer.core._slot(w1, w2, dd, *layer.core.slots.stage("post"))
    qw1, qw2, kw1, kw2, qdd, kdd = (w[0] for w in weights)                       # drop batch dim
    return {"a": rec["weights_before"][0], "out": rec["weights_after"][0],       # (H, T, S)
            "qw1": qw1, "qw2": qw2, "kw1": kw1, "kw2": kw2, "qdd": qdd, "kdd": kdd}


def mixing_matrix(w1: torch.Tensor, w2: torch.Tensor, dd: torch.Tensor, i: int) -> torch.Tensor:
    """M[g, h] = sum_r w1[i, r, g] * w2[i, r, h] + [g == h] * dd[i, h]: the H x H matrix with
    which token i mixes heads (source head g -> target head h)."""
    return torch.einsum("rg,rh->gh", w1[i], w2[i]) + torch.diag(dd[i])           # (H, H)


def _check(ex) -> None:
    """A'[:, t, s] == (I + Mq[t] + Mk[s])^T A[:, t, s] for every (t, s)."""
    a, out = ex["a"], ex["out"]
    heads, t_len, s_len = a.shape
    for t in range(t_len):
        mq = mixing_matrix(ex["qw1"], ex["qw2"], ex["qdd"], t)
        for s in range(s_len):
            m = torch.eye(heads) + mq + mixing_matrix(ex["kw1"], ex["kw2"], ex["kdd"], s)
            torch.testing.assert_close(out[:, t, s], m.T @ a[:, t, s], rtol=1e-4, atol=1e-6)


def _save(fig, out: Path, dpi: int) -> Path:
    return atomic_write(out, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi, metadata={"Software": None}))


def draw_compose(out: Path, dpi: int = 110) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ex = compose_example()
    _check(ex)
    a, comp = ex["a"].numpy(), ex["out"].numpy()
    heads = a.shape[0]
    queries, keys = (2, 9), (4, 10)
    mq = [mixing_matrix(ex["qw1"], ex["qw2"], ex["qdd"], t).numpy() for t in queries]
    mk = [mixing_matrix(ex["kw1"], ex["kw2"], ex["kdd"], s).numpy() for s in keys]

    fig = plt.figure(figsize=(10, 8.6), layout="constrained")
    rows = fig.subfigures(3, 1, height_ratios=[1, 1.2, 1])
    vmax = float(max(np.abs(a).max(), np.abs(comp).max()))

    def maps_row(sub, data, title):
        axes = sub.subplots(1, heads)
        for h, ax in enumerate(axes):
            im = ax.imshow(data[h], cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest")
            ax.set_title(f"head {h}", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
            for t in queries:
                ax.axhline(t, color="k", lw=0.6, ls=":")
            for s in keys:
                ax.axvline(s, color="k", lw=0.6, ls=":")
        axes[0].set_ylabel("query t", fontsize=9)
        for ax in axes:
            ax.set_xlabel("key s", fontsize=9)
        sub.colorbar(im, ax=axes.tolist(), shrink=0.8)
        sub.suptitle(title, fontsize=10)

    maps_row(rows[0], a, "A: attention weights per head, shape (H, T, S), as softmax produced them")

    mix_axes = rows[1].subplots(1, 4)
    mmax = float(max(np.abs(m).max() for m in mq + mk))
    for ax, m, label in zip(mix_axes, mq + mk,
                            [f"query t={t}" for t in queries] + [f"key s={s}" for s in keys]):
        im = ax.imshow(m, cmap="PuOr_r", vmin=-mmax, vmax=mmax)
        ax.set_title(label, fontsize=9)
        ax.set_xticks(range(heads))
        ax.set_yticks(range(heads))
        ax.set_xlabel("to head h", fontsize=8)
        ax.set_ylabel("from head g", fontsize=8)
        ax.tick_params(labelsize=7)
    rows[1].colorbar(im, ax=mix_axes.tolist(), shrink=0.8)
    rows[1].suptitle("per-token head mixing $M[g,h] = \\sum_r w_1[r,g]\\,w_2[r,h] + [g=h]\\,dd[h]$, "
                     "generated from the token itself:\nquery-wise (left, one matrix per query row), "
                     "key-wise (right, one per key column)", fontsize=10)

    maps_row(rows[2], comp, r"A' = Compose(A): $A'[:,t,s] = (I + M_q[t] + M_k[s])^\top A[:,t,s]$"
                            " — every head reads every other head, differently per (t, s)")
    return _save(fig, out, dpi)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "figures")
    args = parser.parse_args(argv)
    path = draw_compose(args.out / "compose.png")
    print(f"saved {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
