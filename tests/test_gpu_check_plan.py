"""scripts/gpu_check_plan.py: the GPU check's plan fits its budget, and the run keeps to it
(skips what does not fit, stops what overruns, writes the summary after every step)."""
import importlib.util
import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def planner():
    return _module("gpu_check_plan")


@pytest.fixture(scope="module")
def estimate():
    """dcvit.bench.kernels --estimate's figures (it compiles the 6 production kernels)."""
    from dcvit.bench import kernels
    return kernels.estimate()


@pytest.fixture(scope="module")
def step_ms(estimate):
    """The estimate's training-step milliseconds, as the environment step records them."""
    return {k: [m["step_ms"]["dcvit"], m["step_ms"]["vit"]] for k, m in estimate["models"].items()}


def test_the_estimate_counts_each_kernels_issue_slots(estimate):
    """The plan's prices include the compiled kernels' instructions: each DCViT kernel has
    an issue time, the estimate is its slowest unit, and counting it can only slow a step."""
    assert estimate["issue_counted"], estimate["issue_not_counted"]
    for m in estimate["models"].values():
        for w in m["kernels"].values():
            assert w["warp_instructions"] > 0 and w["issue"] > 0
            assert w["estimate"] == max(w["tensor"], w["cuda"], w["memory"], w["issue"])
        assert "issue" not in m["sdpa"]["forward"]
        assert m["train_ratio"] <= m["train_ratio_roofline"]


def test_the_compile_core_is_estimated_beside_the_kernels(estimate):
    """The `compile` core priced by the same model as the kernels: each of its kernels reads and
    writes whole (B, H, N, N) bf16 maps (counted here by hand from
    `dcvit.matrices.attention_with_matrices`: q·kᵀ writes one; a Compose stage 5 reads and 4
    writes, its backward 9 and 4; softmax 1 and 1, its backward 2 and 1; p·v reads one; the
    backward's four q/k/v products read 3 and write 1), one after another. At the shapes
    DCViT trains it is the slower core, so `auto` taking the Triton core agrees with it."""
    for label, m in estimate["models"].items():
        B, H, N = estimate["batch"], m["heads"], m["tokens"]
        nmap = 2 * B * H * N * N
        fwd, bwd = m["compile_core"]["forward"], m["compile_core"]["backward"]
        assert fwd["bytes"] == (1 + 9 + 2 + 9 + 1) * nmap
        assert bwd["bytes"] == (2 + 13 + 3 + 13 + 2) * nmap
        for w in (fwd, bwd):
            assert w["estimate"] >= w["bytes"] / estimate["gpu"]["hbm"] * 1e3 * (1 - 1e-12)   # memory-bound at least
        assert m["core_ms"]["compile"] == pytest.approx(m["depth"] * (fwd["estimate"] + bwd["estimate"]))
        assert m["lower_estimate"] == "triton", label
        assert m["train_ratio_compile"] < m["train_ratio"]


def test_the_score_gradient_map_is_priced_where_it_is_used(estimate):
    """At 16 padded heads (B/16) dq and dk come from products on the scores' gradient map
    (`triton_core.score_grad_map`): the query kernel's bytes include the map it writes, the
    products kernel reads it once (197 tokens, at most `PRODUCTS_MAX_KEYS`), and the
    backward's estimate adds them; S/16 has no map. The map's rows are laid out 208 keys
    apart at 197 (`triton_core.score_grad_map_row`, aligned for vector stores): its bytes are
    counted so; beyond 256 keys, read by two products, they are not padded."""
    from dcvit.bench import kernels
    small, base = estimate["models"]["S/16"], estimate["models"]["B/16"]
    assert small["products"] is None and base["products"] is not None
    B, H, N, D = estimate["batch"], base["heads"], base["tokens"], base["head_dim"]
    assert N == 197
    nmap = 2 * B * H * N * 208
    assert base["products"]["bytes"] == nmap + 4 * 2 * B * N * H * D
    assert kernels.grad_map_work(B, H, 300, D)["bytes"] == 2 * 2 * B * H * 300 * 300 + 4 * 2 * B * 300 * H * D
    tok = B * N * H                     # bwd_q: reads q, k, v, dO, lse, 4 matrices; writes delta, dMq1, dMq2, the map
    assert base["kernels"]["bwd_q"]["bytes"] == 4 * tok * D * 2 + 2 * tok * 4 + 6 * tok * H * 4 + nmap
    assert kernels.backward_estimate(base) == pytest.approx(
        base["kernels"]["bwd_q"]["estimate"] + base["kernels"]["bwd_k"]["estimate"] + base["products"]["estimate"])
    assert kernels.backward_estimate(small) == pytest.approx(
        small["kernels"]["bwd_q"]["estimate"] + small["kernels"]["bwd_k"]["estimate"])


def test_the_matrices_padded_copy_is_priced_where_it_is_made(estimate):
    """At up to 7 heads (S/16), from Triton 3.8 on, the four matrices are copied zero-padded to
    8×8 per token (`triton_core.pads_matrices`) once a layer, before the forward (autograd
    keeps them padded for the backward): read as H×H and written as 8×8 float32,
    memory-bound; the forward's estimate and the layers' cores include it, and the kernels
    read and write 8×8 matrices. B/16 (12 heads) takes its matrices as they are."""
    from dcvit.bench import kernels
    from dcvit.kernels.triton_core import pads_matrices
    small, base = estimate["models"]["S/16"], estimate["models"]["B/16"]
    assert base["padding"] is None and not pads_matrices(base["heads"])
    assert pads_matrices(small["heads"]), "the project's Triton (3.8) pads at 6 heads"
    B, H, N = estimate["batch"], small["heads"], small["tokens"]
    pad = small["padding"]
    assert pad["bytes"] == 4 * 4 * B * N * (H * H + 8 * 8)
    assert pad["estimate"] == pytest.approx(pad["bytes"] / estimate["gpu"]["hbm"] * 1e3)
    assert kernels.forward_estimate(small) == pytest.approx(small["kernels"]["fwd"]["estimate"] + pad["estimate"])
    total = kernels.forward_estimate(small) + kernels.backward_estimate(small)
    assert small["core_ms"]["dcvit"] == pytest.approx(small["depth"] * total)
    tok = B * N * H                     # the forward: q, k, v and 4 padded matrices read; o, lse written
    assert small["kernels"]["fwd"]["bytes"] == 4 * tok * small["head_dim"] * 2 + tok * 4 + 4 * B * N * 8 * 8 * 4


def test_cuda_plan_fits_500_s_from_the_estimate_most_valuable_first(planner, step_ms):
    rows = planner.plan(500, dry=False, step_ms=step_ms)
    assert [r["step"] for r in rows][:6] == ["environment", "kernels", "kernel_times", "bench_S_eager_triton",
                                             "bench_B_eager_triton", "loop_overhead"]
    planned = sum(r["planned_s"] for r in rows if r["fits"])
    assert planned <= 500 - planner.RESERVE
    assert all(r["fits"] for r in rows[:6])                  # issue 28's steps 1 to 5 all fit
    skipped = {r["step"] for r in rows if not r["fits"]}
    assert {"bench_S_compile_triton", "train_smoke_compile", "bench_B_compile_triton"} <= skipped
    # the estimate prices the timed work: a slower model plans longer benchmarks
    slow = {k: [4 * a, 4 * b] for k, (a, b) in step_ms.items()}
    bench = {r["step"]: r["planned_s"] for r in planner.plan(500, dry=False, step_ms=slow)}
    assert bench["bench_B_eager_triton"] > {r["step"]: r["planned_s"] for r in rows}["bench_B_eager_triton"]


def test_a_larger_budget_plans_every_step_and_a_small_one_only_the_first_two(planner, step_ms):
    every = planner.plan(5000, dry=False, step_ms=step_ms)
    assert all(r["fits"] for r in every)
    first_two = sum(r["planned_s"] for r in every[:2])
    few = planner.plan(first_two + planner.RESERVE, dry=False, step_ms=step_ms)
    assert [r["step"] for r in few if r["fits"]] == ["environment", "kernels"]


def test_the_shards_are_planned_only_with_the_training_run_they_are_for(planner, step_ms):
    rows = planner.plan(5000, dry=False, step_ms=step_ms)
    before = sum(r["planned_s"] for r in rows[:rows.index(next(r for r in rows if r["step"] == "synthetic_shards"))])
    cost = {r["step"]: r["planned_s"] for r in rows}
    budget = before + cost["synthetic_shards"] + cost["train_smoke_eager"] / 2 + planner.RESERVE
    fits = {r["step"]: r["fits"] for r in planner.plan(budget, dry=False, step_ms=step_ms)}
    assert fits["loop_overhead"] and not fits["synthetic_shards"] and not fits["train_smoke_eager"]


def test_dry_plan_at_120_s_skips_the_compiled_steps(planner):
    rows = {r["step"]: r for r in planner.plan(120, dry=True)}
    assert sum(r["planned_s"] for r in rows.values() if r["fits"]) <= 120 - planner.RESERVE
    assert rows["environment"]["fits"] and rows["kernels"]["fits"] and rows["bench_S_eager_triton"]["fits"]
    for name in ("bench_S_compile_triton", "train_smoke_compile", "bench_B_compile_triton"):
        assert not rows[name]["fits"]


def _fake_steps(planner):
    S = planner.Step
    py = sys.executable
    return (
        S("environment", "ok", lambda ms: 1, 1, lambda c: [py, "-c", "print('hello')"]),
        S("kernels", "fails", lambda ms: 1, 1, lambda c: [py, "-c", "raise SystemExit(3)"]),
        S("too_big", "more than the budget", lambda ms: 1, 1000, lambda c: [py, "-c", "pass"]),
        S("after_fail", "needs kernels", lambda ms: 1, 1, lambda c: [py, "-c", "pass"], needs=("kernels",)),
        S("later", "runs after a skip", lambda ms: 1, 1, lambda c: [py, "-c", "print('later')"]),
        S("slow", "overruns the budget", lambda ms: 1, 1, lambda c: [py, "-c", "import time; time.sleep(60)"]),
        S("last", "nothing left for it", lambda ms: 1, 1, lambda c: [py, "-c", "pass"]),
    )


def test_run_skips_stops_and_always_leaves_a_summary(planner, tmp_path, monkeypatch):
    monkeypatch.setattr(planner, "STEPS", _fake_steps(planner))
    monkeypatch.setattr(planner, "RESERVE", 0.0)
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    ctx = planner.Context(ROOT, out, scratch, dry=True)
    meta = planner.run(ctx, budget=8)
    status = {r["step"]: r["status"] for r in meta["steps"]}
    assert status == {"environment": "pass", "kernels": "fail", "too_big": "skipped", "after_fail": "skipped",
                      "later": "pass", "slow": "timeout", "last": "skipped"}
    rows = {r["step"]: r for r in meta["steps"]}
    assert rows["slow"]["limit_s"] < 8                       # stopped at the end of the budget
    assert "planned 1000 s" in rows["too_big"]["reason"]
    assert "needs kernels" in rows["after_fail"]["reason"]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check_logs.tar.gz"]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["passed"] is False and summary["budget_s"] == 8
    assert summary["skipped"] == ["too_big", "after_fail", "last"]
    assert [r["step"] for r in summary["plan"]] == list(status)
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        names = tar.getnames()
        assert "gpu_check/steps.json" in names and "gpu_check/later.log" in names
        assert tar.extractfile("gpu_check/environment.log").read() == b"hello\n"


def test_missing_names_what_does_not_import_or_is_too_old(planner, tmp_path):
    (tmp_path / "pyproject.toml").write_text('dependencies = ["pytest>=999", "json5>=1"]\n')
    wanted = (("pytest", "pytest"), ("no-such-dist", "no_such_module_here"), ("pyyaml", "yaml"))
    assert planner.missing(tmp_path / "pyproject.toml", wanted) == ["pytest", "no-such-dist"]
    assert planner.minimums(ROOT / "pyproject.toml")["timm"] == "1.0.31"
    reqs = planner.requirements(ROOT / "pyproject.toml")
    assert len(reqs) == len(planner.REQUIREMENTS) and any(r.startswith("fvcore") for r in reqs)
