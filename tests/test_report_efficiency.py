"""The efficiency multiplier of dcvit-report: interpolation in log size, its marks, the paper's rows."""
import json
import math

import pytest

from dcvit.report import main
from dcvit.report.efficiency import efficiency_rows, multiplier_text, needed_size


def test_interpolation_is_linear_in_log_size():
    need = needed_size([(10.0, 70.0), (40.0, 76.0)], 73.0)        # half-way in top-1
    assert need["mark"] == "" and need["value"] == pytest.approx(math.sqrt(10 * 40))
    need = needed_size([(40.0, 76.0), (10.0, 70.0), (160.0, 79.0)], 77.5)
    assert need["value"] == pytest.approx(math.exp(math.log(40) + 0.5 * math.log(4)))
    assert needed_size([(10.0, 70.0), (40.0, 76.0)], 76.0)["value"] == pytest.approx(40.0)


def test_outside_the_baselines_is_a_bound_with_an_extrapolation():
    one = needed_size([(39.0, 67.1)], 68.0)
    assert one == {"value": None, "mark": "≥", "bound": 39.0, "extrapolated": None}
    assert multiplier_text(one, 22.7) == f"≥ {39.0 / 22.7:.2f}×"
    two = needed_size([(10.0, 70.0), (40.0, 76.0)], 79.0)           # 1.5 segments beyond
    assert two["mark"] == "≥" and two["bound"] == 40.0
    assert two["extrapolated"] == pytest.approx(math.exp(math.log(10) + 1.5 * math.log(4)))
    assert multiplier_text(two, 10.0) == f"≥ 4.00× (extrapolated {two['extrapolated'] / 10:.2f}×)"
    low = needed_size([(10.0, 70.0), (40.0, 76.0)], 60.0)
    assert low["mark"] == "≤" and low["bound"] == 10.0


def test_rows_only_within_a_group():
    pts = [dict(label="V1", family="vit", group="a", top1=70.0, params=10, macs=100),
           dict(label="V2", family="vit", group="a", top1=76.0, params=40, macs=400),
           dict(label="D1", family="dcvit", group="a", top1=73.0, params=10.5, macs=110,
                baseline_params=10, baseline_macs=100),
           dict(label="D2", family="dcvit", group="b", top1=73.0, params=10.5, macs=110,
                baseline_params=10, baseline_macs=100)]
    rows = efficiency_rows(pts)
    assert [r["label"] for r in rows] == ["D1"]
    assert rows[0]["params_x_baseline"] == "2.00×" and rows[0]["macs_x"] == f"{200 / 110:.2f}×"


def test_report_states_the_papers_claim_and_measured_multipliers(tmp_path, capsys):
    results = []
    for name, top1, epoch in [("vit_tiny_patch16_224", 60.0, None), ("vit_small_patch16_224", 70.0, None),
                              ("dcvit_tiny_patch16_224", 65.0, None), ("dcvit_tiny_patch16_224", 50.0, 90)]:
        path = tmp_path / f"{name}-{epoch}.json"
        path.write_text(json.dumps({"model": name, "top1": top1, "img_size": 32, "num_classes": 10,
                                    "model_kwargs": {"depth": 1}, "dataset": "digits",
                                    **({"epoch": epoch} if epoch else {})}))
        results.append(str(path))
    assert main(["--results", *results, "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    section = md.split("## Efficiency multiplier", 1)[1].split("\n## ", 1)[0]
    paper90 = next(line for line in section.splitlines() if "epoch 90 of 300" in line)
    assert "DCViT-S/16" in paper90 and "| ≥ 1.72× |" in paper90
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    measured = [e for e in data["efficiency"] if e["group"][0] == "measured"]
    assert len(measured) == 1 and measured[0]["group"] == ["measured", "digits", "final"]
    tiny, small = (r for r in data["rows"] if r["model"] in ("vit_tiny_patch16_224", "vit_small_patch16_224"))
    need = math.exp(0.5 * (math.log(tiny["params"]) + math.log(small["params"])))
    assert measured[0]["params_x_baseline"] == f"{need / tiny['params']:.2f}×"
    assert (tmp_path / "rep" / "report.png").stat().st_size > 10_000


def test_measured_rows_of_other_validation_sets_are_not_compared(tmp_path, capsys):
    paths = []
    for name, top1, val in [("vit_tiny_patch16_224", 60.0, "/a"), ("dcvit_tiny_patch16_224", 65.0, "/b")]:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"model": name, "top1": top1, "img_size": 32, "num_classes": 10,
                                    "model_kwargs": {"depth": 1}, "val": val}))
        paths.append(str(path))
    assert main(["--results", *paths, "--out", str(tmp_path / "rep")]) == 0
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert not [e for e in data["efficiency"] if e["group"][0] == "measured"]
