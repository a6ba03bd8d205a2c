"""Smoke runs of dcvit-bench: the CLI runs end to end and writes its JSON (no timing asserts)."""
import json

import pytest
import torch

from dcvit.bench.benchmark import run

TINY = ["--model", "dcvit_tiny_patch16_224", "--img-size", "32", "--depth", "1", "--batch-size", "2",
        "--steps", "1", "--warmup", "0", "--no-compile"]


def test_model_benchmark_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    run(TINY + ["--no-memory", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["baseline"] == "vit_tiny_patch16_224"
    assert set(data["figures"]) == {"inference/fp32/eager/b2", "train/fp32/eager/b2"}
    for fig in data["figures"].values():
        assert fig["dcvit_ms"] > 0 and fig["vit_ms"] > 0
        assert fig["ratio"] == pytest.approx(fig["vit_ms"] / fig["dcvit_ms"])
        assert len(fig["dcvit_times_ms"]) == 1
    assert "inference/fp32/eager/b2" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_memory_figure_runs_in_child_processes(tmp_path):
    out = tmp_path / "bench.json"
    run(TINY + ["--modes", "inference", "--mem-batch-size", "2", "--json", str(out)])
    fig = json.loads(out.read_text())["figures"]["memory/fp32/eager/b2"]
    assert fig["dcvit_bytes"] > 0 and fig["vit_bytes"] > 0
    assert fig["ratio"] == pytest.approx(fig["dcvit_bytes"] / fig["vit_bytes"])


def test_layer_benchmark_writes_json(tmp_path):
    out = tmp_path / "layer.json"
    run(["--layer", "--batch-size", "2", "--tokens", "9", "--dim", "24", "--heads", "3", "--steps", "1",
          "--warmup", "0", "--dtypes", "fp32,bf16", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["shape"] == {"B": 2, "N": 9, "dim": 24, "H": 3}
    assert set(data["results"]) == {"inference/fp32", "inference/bf16", "train/fp32", "train/bf16"}
    for r in data["results"].values():
        assert r["dcmha_ms"] > 0 and r["plain_ms"] > 0 and r["attention_ms"] > 0


def test_bad_arguments_name_the_fix():
    with pytest.raises(SystemExit, match="unknown dtype 'fp16'.*choose from"):
        run(["--dtypes", "fp16"])
    with pytest.raises(SystemExit, match="unknown --impl 'fast'"):
        run(["--impl", "fast"])


def test_converted_model_is_timed_against_itself_unconverted(tmp_path, capsys):
    out = tmp_path / "bench.json"
    run(["--model", "eva02_tiny_patch14_224", "--img-size", "28", "--depth", "1", "--batch-size", "2",
         "--steps", "1", "--warmup", "0", "--no-compile", "--no-memory", "--modes", "inference",
         "--convert", "rank=1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["baseline"] == "eva02_tiny_patch14_224" and data["convert"] == {"rank": 1}
    assert data["figures"]["inference/fp32/eager/b2"]["dcvit_ms"] > 0
    assert "eva02_tiny_patch14_224 + DCMHA (dcvit.convert) vs eva02_tiny_patch14_224" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--convert entry 'rank' is not key=value"):
        run(["--convert", "rank"])


def test_explain_names_the_core_and_why(tmp_path, capsys):
    """--explain runs one DCMHA layer each way and reports select_impl's choice and reason."""
    from dcvit.kernels import compose_cpu
    out = tmp_path / "explain.json"
    run(["--explain", "--model", "dcvit_tiny_patch16_224", "--img-size", "32", "--depth", "1",
         "--dtypes", "fp32,bf16", "--modes", "train", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["layer"] == "blocks.0.attn"
    assert set(data["explain"]) == {"eager/fp32/train", "eager/bf16/train", "compile/fp32/train",
                                    "compile/bf16/train"}
    if compose_cpu.available():
        assert data["explain"]["eager/fp32/train"] == {"core": "cpp", "reason": "CPU: the C++ kernels"}
        assert data["explain"]["compile/bf16/train"] == {
            "core": "cpp", "reason": "CPU: the C++ kernels (computed in float32), one op in the graph"}
    assert "compile/bf16/train" in capsys.readouterr().out
    run(["--explain", "--model", "dcvit_tiny_patch16_224", "--img-size", "32", "--depth", "1",
         "--no-compile", "--modes", "inference", "--impl", "reference", "--json", str(out)])
    assert json.loads(out.read_text())["explain"] == {"eager/fp32/inference": {"core": "reference",
                                                                               "reason": "forced"}}


@pytest.mark.parametrize("impl", ["cpp", "sdpa"])
def test_core_benchmark_prints_the_best_cpu_times(impl, capsys):
    """``python -m dcvit.bench.core``: the attention core alone, timed with the one timer
    (`dcvit.bench.timing.time_steps` on CPU time)."""
    from dcvit.bench import core
    from dcvit.kernels import compose_cpu
    if impl == "cpp" and not compose_cpu.available():
        pytest.skip("C++ kernel not built here")
    assert core.main(["--impl", impl, "--repeats", "2", "-B", "1", "-N", "9", "--heads", "2", "-D", "8"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["impl"] == impl and data["shape"] == {"B": 1, "N": 9, "H": 2, "D": 8}
    assert data["forward_ms"] >= 0


def test_the_timer_reads_the_clock_it_is_given():
    from dcvit.bench.timing import time_steps
    ticks = iter(range(100))
    calls = []
    times = time_steps(lambda: calls.append(1), torch.device("cpu"), warmup=2, steps=3,
                       clock=lambda: float(next(ticks)))
    assert len(calls) == 5 and times == [1.0, 1.0, 1.0]
