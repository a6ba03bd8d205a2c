"""``report.png``: measured top-1 against size (or parameters against MACs without accuracy)."""
import io
import re

from ..optional import require
from .efficiency import curve_points, group_text
from .measure import Report

__all__ = ["report_png"]


def _short(name: str) -> str:
    m = re.search(r"(tiny|small|medium|base|large)", name)
    return {"tiny": "Ti", "small": "S", "medium": "M", "base": "B", "large": "L"}[m.group(1)] if m else name


def report_png(report: Report) -> bytes:
    require("matplotlib", "dcvit-report's figure (report.png)").use("Agg")
    import matplotlib.pyplot as plt

    rows = report.rows
    with_acc = [r for r in rows if "top1" in r]
    styles = {"vit": ("tab:blue", "o", "ViT"), "dcvit": ("tab:red", "s", "DCViT"), "other": ("tab:gray", "^", "other")}
    axes_spec = ([("params", 1e6, "parameters (M)"), ("macs", 1e9, "GMACs")] if with_acc
                 else [("params", 1e6, "parameters (M)")])
    curves = report.points and report.efficiency
    n_rows = 2 if curves else 1
    fig, axes = plt.subplots(n_rows, 2, figsize=(12, 4.5 * n_rows), squeeze=False)
    if not with_acc:
        axes[0][1].axis("off")
    if curves:
        _efficiency_axes(axes[1], report)
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


def _efficiency_axes(axes, report: Report) -> None:
    """Per group: the baselines' top-1 against log size, each DCViT and the baseline size it matches."""
    groups = {e["group"] for e in report.efficiency}
    colors = ["tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown"]
    for ax, (key, scale, label) in zip(axes, [("params", 1e6, "parameters (M), log"), ("macs", 1e9, "GMACs, log")]):
        for i, (group, pts) in enumerate(sorted(curve_points(report.points, key).items(), key=lambda kv: str(kv[0]))):
            if group not in groups:
                continue
            color = colors[i % len(colors)]
            xs = [x / scale for x, _, _ in pts["vit"]]
            ax.plot(xs, [t for _, t, _ in pts["vit"]], "o-", color=color, label=f"ViT · {group_text(group)}")
            for x, t, n in pts["vit"]:
                ax.annotate(n, (x / scale, t), textcoords="offset points", xytext=(4, -10), fontsize=7)
            for x, t, n in pts["dcvit"]:
                ax.plot([x / scale], [t], "s", color="tab:red")
                ax.annotate(n, (x / scale, t), textcoords="offset points", xytext=(4, 4), fontsize=7)
                eff = next((e for e in report.efficiency if e["group"] == group and e["top1"] == t), None)
                need = eff[f"{key}_needed"] if eff else None
                target = None if need is None else need["value"] or need["extrapolated"] or need["bound"]
                if target:
                    ax.plot([x / scale, target / scale], [t, t], "--", color="tab:red", lw=1)
                    ax.annotate(eff[f"{key}_x"], (target / scale, t), textcoords="offset points",
                                xytext=(2, 6), fontsize=7, color="tab:red")
        ax.set_xscale("log")
        ax.set_title("efficiency: baselines in log size; dashed: the size a baseline needs", fontsize=9)
        ax.set_xlabel(label)
        ax.set_ylabel("top-1 (%)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
