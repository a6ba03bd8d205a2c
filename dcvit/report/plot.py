"""``report.png``: measured top-1 against size (or parameters against MACs without accuracy)."""
import io
import re

from .measure import Report

__all__ = ["report_png"]


def _short(name: str) -> str:
    m = re.search(r"(tiny|small|medium|base|large)", name)
    return {"tiny": "Ti", "small": "S", "medium": "M", "base": "B", "large": "L"}[m.group(1)] if m else name


def report_png(report: Report) -> bytes:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.rows
    with_acc = [r for r in rows if "top1" in r]
    styles = {"vit": ("tab:blue", "o", "ViT"), "dcvit": ("tab:red", "s", "DCViT"), "other": ("tab:gray", "^", "other")}
    axes_spec = ([("params", 1e6, "parameters (M)"), ("macs", 1e9, "GMACs")] if with_acc
                 else [("params", 1e6, "parameters (M)")])
    fig, axes = plt.subplots(1, len(axes_spec), figsize=(6 * len(axes_spec), 4.5), squeeze=False)
    for ax, (key, scale, label) in zip(axes[0], axes_spec):
        for family, (color, marker, name) in styles.items():
            pts = sorted(((r[key] / scale, r["top1"] if with_acc else r["gmacs"], _short(r["model"]))
                          for r in (with_acc or rows) if r["family"] == family))
            if not pts:
                continue
            xs, ys, names = zip(*pts)
            ax.plot(xs, ys, marker=marker, color=color, label=name)
            for x, y, n in pts:
                ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel("top-1 (%)" if with_acc else "GMACs")
        ax.grid(alpha=0.3)
        ax.legend()
    datasets = sorted({str(r["dataset"]) for r in with_acc if r.get("dataset")})
    on = f" on {', '.join(datasets)}" if datasets else ""
    fig.suptitle(f"measured top-1{on} vs size" if with_acc else "parameters vs GMACs (fvcore, batch 1)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()
