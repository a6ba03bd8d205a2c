"""The efficiency multiplier: the size a plain ViT would need to match a DCViT's top-1.

The paper's headline claim is that DCMHA "matches a model with 1.7–2× the compute". For
each group of comparable rows (the same source and training length: the quoted paper rows
at epoch 90, at epoch 300; measured ``eval.json`` rows of one dataset and epoch), the
baselines' top-1 is interpolated linearly against log(params) and against log(MACs). For
each DCViT row of the group the report gives the params and MACs a baseline would need for
the same top-1, as a multiplier of the DCViT's own size and of its baseline's:

* inside the baselines' top-1 range: interpolated;
* above it: "≥" the size of the best baseline (top-1 grows with size), plus a log-linear
  extrapolation of the two largest baselines when there are two ("extrapolated");
* below it: "≤" the smallest baseline, likewise.
"""
import math
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

__all__ = ["needed_size", "efficiency_rows", "multiplier_text"]


def needed_size(baselines: Sequence[Tuple[float, float]], top1: float) -> Dict[str, Any]:
    """The size (params or MACs) a baseline needs for ``top1``, from (size, top-1) points.

    Returns ``{"value", "mark", "bound", "extrapolated"}``: inside the baselines' top-1
    range ``value`` is interpolated in log size (mark ""); outside it, mark is "≥" (above
    the best baseline) or "≤" (below the worst), ``bound`` that baseline's size, and
    ``extrapolated`` the log-linear extrapolation of the two end baselines (None with one).
    """
    pts = sorted((float(s), float(t)) for s, t in baselines)
    if not pts or any(s <= 0 for s, _ in pts):
        raise ValueError(f"needed_size: baselines need positive sizes, got {list(baselines)}")
    for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
        if min(t0, t1) <= top1 <= max(t0, t1) and t0 != t1:
            f = (top1 - t0) / (t1 - t0)
            value = math.exp(math.log(s0) + f * (math.log(s1) - math.log(s0)))
            return {"value": value, "mark": "", "bound": None, "extrapolated": None}
    for s, t in pts:
        if t == top1:
            return {"value": s, "mark": "", "bound": None, "extrapolated": None}
    best = max(pts, key=lambda p: (p[1], p[0]))
    worst = min(pts, key=lambda p: (p[1], -p[0]))
    above = top1 > best[1]
    bound = best[0] if above else worst[0]
    ends = pts[-2:] if above else pts[:2]
    (s0, t0), (s1, t1) = ends if len(ends) == 2 else (ends[0], ends[0])
    extrapolated = None
    if len(pts) >= 2 and t1 > t0:                          # top-1 rising with size at that end
        f = (top1 - t0) / (t1 - t0)
        extrapolated = math.exp(math.log(s0) + f * (math.log(s1) - math.log(s0)))
    return {"value": None, "mark": "≥" if above else "≤", "bound": bound, "extrapolated": extrapolated}


def multiplier_text(need: Dict[str, Any], reference: float) -> str:
    """``"1.45×"``, ``"≥ 1.72×"`` or ``"≥ 1.72× (extrapolated 2.10×)"`` of ``reference``."""
    if need["mark"] == "":
        return f"{need['value'] / reference:.2f}×"
    text = f"{need['mark']} {need['bound'] / reference:.2f}×"
    if need["extrapolated"] is not None:
        text += f" (extrapolated {need['extrapolated'] / reference:.2f}×)"
    return text


def efficiency_rows(points: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per DCViT point that has baselines in its group.

    Each point: ``label``, ``family`` ("vit"/"dcvit"/...), ``group`` (hashable), ``top1``,
    ``params``, ``macs``, and for a DCViT ``baseline_params``/``baseline_macs`` (its own
    baseline's size). Returns rows with ``params_needed``/``macs_needed`` (`needed_size`),
    their multipliers of the DCViT (``*_x``) and of its baseline (``*_x_baseline``) as text.
    """
    groups: Dict[Hashable, List[Dict[str, Any]]] = {}
    for p in points:
        groups.setdefault(p["group"], []).append(p)
    rows = []
    for group, pts in groups.items():
        base = [p for p in pts if p["family"] == "vit"]
        if not base:
            continue
        for p in (q for q in pts if q["family"] == "dcvit"):
            row: Dict[str, Any] = {"label": p["label"], "group": group, "top1": p["top1"],
                                   "params": p["params"], "macs": p["macs"],
                                   "baselines": [b["label"] for b in base]}
            for key in ("params", "macs"):
                need = needed_size([(b[key], b["top1"]) for b in base], p["top1"])
                row[f"{key}_needed"] = need
                row[f"{key}_x"] = multiplier_text(need, p[key])
                row[f"{key}_x_baseline"] = multiplier_text(need, p[f"baseline_{key}"])
            rows.append(row)
    return rows


def curve_points(points: Sequence[Dict[str, Any]], key: str) -> Dict[Hashable, Dict[str, List[Tuple[float, float, str]]]]:
    """Per group: the baselines' (size, top-1, label) sorted by size, and the DCViTs'."""
    out: Dict[Hashable, Dict[str, List[Tuple[float, float, str]]]] = {}
    for p in points:
        fam = "vit" if p["family"] == "vit" else "dcvit" if p["family"] == "dcvit" else None
        if fam is not None:
            out.setdefault(p["group"], {"vit": [], "dcvit": []})[fam].append((p[key], p["top1"], p["label"]))
    for g in out.values():
        g["vit"].sort()
        g["dcvit"].sort()
    return out


def group_text(group: Optional[Hashable]) -> str:
    return " · ".join(str(g) for g in group) if isinstance(group, tuple) else str(group)
