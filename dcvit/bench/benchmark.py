"""DCViT against its ViT baseline, side by side: throughput ratios and peak-memory ratios.

Usage (installed as ``dcvit-bench``; ``python -m dcvit.bench`` is the same)::

    dcvit-bench                                   # DCViT-S/16 vs ViT-S/16, the issue's table
    dcvit-bench --dtypes fp32,bf16 --no-compile   # sub-selections
    dcvit-bench --layer --batch-size 16 --tokens 197 --dim 384 --heads 6
    dcvit-bench --model eva02_tiny_patch14_224 --convert rank=2   # converted vs the original
    dcvit-bench --explain --dtypes fp32,bf16      # which attention core runs, and why
    dcvit-bench --onnx --onnx-before              # exported, in ONNX Runtime (batch 1 and 16)
    dcvit-bench --aoti --aoti-cpp                 # AOTInductor packages (minutes of compiling)

Method (docs/spec.md §5): both models are built in one process and timed alternately (DCViT, ViT,
then ViT, DCViT, ...), after warm-up, same batch, dtype and threads; a figure is the ratio of
the median step times (throughput ratio = ViT time / DCViT time). Training steps are
forward + cross-entropy + backward + AdamW. Peak memory is measured in a fresh process per
model (peak RSS on CPU, ``torch.cuda.max_memory_allocated`` on CUDA) over training steps at
``--mem-batch-size``, per dtype and, with ``--memory-backends eager,compile``, compiled too.
``--impl`` forces DCMHA's attention core in every figure (``triton``, ``compile`` on CUDA;
``cpp``, ``compile`` on CPU; ``reference`` anywhere), so that cores can be compared.
``--explain`` times nothing: for the first DCMHA layer of the model it prints the core
`dcvit.fused.select_impl` picks in each backend (eager, compile), dtype and mode, and why.
``--convert [KEY=VALUE ...]`` times ``--model`` converted to DCMHA (`dcvit.convert` with
those options) against ``--model`` itself. ``--layer`` times one DCMHA layer (its automatic
fast core) against the plain formulation of docs/spec.md §1.1 (the ``reference`` core) and timm's ``Attention`` (SDPA).
``--onnx`` exports DCViT and its baseline and times them in ONNX Runtime instead, ``--aoti``
compiles them with AOTInductor (`dcvit.bench.export`; ``--threads`` threads, default 2;
batches ``--onnx-batches``; ``--onnx-before`` adds DCViT exported with the paper's
formulation, ``--aoti-cpp`` DCViT with the C++ core kept as a custom op).
Results go to stdout as a table and to ``--json`` (written atomically).
"""
import argparse
import json
import platform
import subprocess
import sys
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from ..io import write_json
from .timing import sync as _sync, time_pair

__all__ = ["main", "run", "TARGETS"]

# The performance targets (docs/spec.md §5): (figure key prefix, comparison, bound).
TARGETS = {"inference": (">=", 0.90), "train": (">=", 0.90), "memory": ("<=", 1.20)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _build(name: str, args: argparse.Namespace, device: torch.device, convert: bool = False) -> torch.nn.Module:
    import timm
    import dcvit  # (registers the DCViT models)
    from ..core import DCMHACore
    kwargs: Dict[str, Any] = dict(img_size=args.img_size)
    if args.depth:
        kwargs["depth"] = args.depth
    torch.manual_seed(0)
    model = timm.create_model(name, **kwargs)
    if convert:
        dcvit.convert(model, **_convert_options(args))
    model = model.to(device)
    if args.impl != "auto":
        for m in model.modules():
            if isinstance(m, DCMHACore):
                m.attn_impl = args.impl
    return model


def _step_fn(model: torch.nn.Module, mode: str, dtype: torch.dtype, device: torch.device,
             batch: int, img_size: int, compiled: bool) -> Callable[[], None]:
    """One inference forward or one training step of ``model`` on fixed random data."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, img_size, img_size, generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    net = torch.compile(model) if compiled else model
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    if mode == "inference":
        model.eval()

        def step() -> None:
            with torch.no_grad(), autocast:
                net(x)
        return step
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
    return train_step


def _convert_options(args: argparse.Namespace) -> Dict[str, Any]:
    from ..cli import parse_kwargs
    return parse_kwargs(args.convert or [], flag="--convert")


def _memory_child(args: argparse.Namespace) -> None:
    """In a fresh process: peak memory over training steps of one model; prints JSON."""
    import resource
    device = torch.device(args.device)
    model = _build(args.memory_child, args, device, convert=args.convert is not None)
    step = _step_fn(model, "train", DTYPES[args.dtypes.split(",")[0]], device, args.mem_batch_size,
                    args.img_size, compiled=args.memory_compiled)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):                                                       # AdamW state on step 1
        step()
    _sync(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"model": args.memory_child, "peak_bytes": peak}))


def _memory(name: str, args: argparse.Namespace, dtype: str, backend: str, convert: bool = False) -> int:
    cmd = [sys.executable, "-m", "dcvit.bench", "--memory-child", name, "--device", args.device,
           "--mem-batch-size", str(args.mem_batch_size), "--img-size", str(args.img_size),
           "--dtypes", dtype, "--threads", str(args.threads), "--impl", args.impl]
    if convert:
        cmd += ["--convert", *(args.convert or [])]
    if args.depth:
        cmd += ["--depth", str(args.depth)]
    if backend == "compile":
        cmd += ["--memory-compiled"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"memory measurement of {name} failed:\n{proc.stderr[-2000:]}")
    return int(json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"])


def _layer_bench(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    """DCMHA (automatic core) vs its plain formulation vs timm Attention, one layer."""
    import dcvit
    from dcvit.fused import attention_impl, select_impl
    torch.manual_seed(0)
    layer = dcvit.DCMHA(args.dim, args.heads).to(device)
    mha = layer.as_mha()
    x = torch.randn(args.batch_size, args.tokens, args.dim, device=device)
    heads = x.new_empty(args.batch_size, args.heads, args.tokens, args.dim // args.heads)
    impl = args.impl if args.impl != "auto" else select_impl("auto", heads)[0]
    out: Dict[str, Any] = {"shape": dict(B=args.batch_size, N=args.tokens, dim=args.dim, H=args.heads),
                           "fast_core": impl, "results": {}}
    for mode in args.modes.split(","):
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

            def make(module: torch.nn.Module, core: Optional[str]) -> Callable[[], None]:
                xi = x.clone().requires_grad_(mode == "train")

                def run() -> None:
                    ctx = attention_impl(core) if core else attention_impl("auto")
                    with ctx, autocast, torch.set_grad_enabled(mode == "train"):
                        y = module(xi)
                        if mode == "train":
                            y.float().sum().backward()
                return run
            fast, plain, sdpa = make(layer, impl), make(layer, "reference"), make(mha, None)
            vs_plain = time_pair(fast, plain, device, args.warmup, args.steps)
            vs_sdpa = time_pair(fast, sdpa, device, args.warmup, args.steps)
            key = f"{mode}/{dname}"
            out["results"][key] = {"dcmha_ms": vs_sdpa["dcvit_ms"], "plain_ms": vs_plain["vit_ms"],
                                   "attention_ms": vs_sdpa["vit_ms"],
                                   "speedup_vs_plain": vs_plain["vit_ms"] / vs_plain["dcvit_ms"],
                                   "ratio_vs_attention": vs_sdpa["ratio"]}
    print(f"DCMHA layer, B={args.batch_size} N={args.tokens} dim={args.dim} H={args.heads}, "
          f"{torch.get_num_threads()} threads, {device}, fast core '{impl}'")
    print(f"{'mode/dtype':<18}{'DCMHA ms':>10}{'plain ms':>10}{'SDPA ms':>10}{'vs plain':>10}{'vs SDPA':>10}")
    for key, r in out["results"].items():
        print(f"{key:<18}{r['dcmha_ms']:>10.1f}{r['plain_ms']:>10.1f}{r['attention_ms']:>10.1f}"
              f"{r['speedup_vs_plain']:>9.2f}x{r['ratio_vs_attention']:>10.2f}")
    return out


def _explain(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    """The core `dcvit.fused.select_impl` picks for the first DCMHA layer of ``--model`` (one
    sample), and its reason, per backend, dtype and mode: the layer runs once each way
    (compiled by dynamo alone, ``backend="eager"``, which runs the same choice)."""
    from .. import core as dcmha_core
    from ..conversion import converted_layers
    model = _build(args.model, args, device, args.convert is not None).eval()
    name = converted_layers(model)[0]
    layer = model.get_submodule(name)
    seen = []
    hook = layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()[:1]))
    with torch.no_grad():
        model(torch.zeros(1, 3, args.img_size, args.img_size, device=device))
    hook.remove()
    x = seen[0]
    choose = dcmha_core.select_impl
    rows: Dict[str, Dict[str, str]] = {}
    backends = ([] if args.compile_only else ["eager"]) + ([] if args.no_compile else ["compile"])
    try:
        for backend in backends:
            for dname in args.dtypes.split(","):
                for mode in args.modes.split(","):
                    picked = []

                    def record(*a: Any, **k: Any) -> Any:
                        picked.append(choose(*a, **k))
                        return picked[-1]
                    dcmha_core.select_impl = record
                    layer.train(mode == "train")
                    torch._dynamo.reset()
                    run = torch.compile(layer, backend="eager", fullgraph=True) if backend == "compile" else layer
                    dtype = DTYPES[dname]
                    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                        run(x)
                    core, reason = picked[0]
                    rows[f"{backend}/{dname}/{mode}"] = {"core": core, "reason": reason}
    finally:
        dcmha_core.select_impl = choose
    print(f"{args.model}: attention core of {name} ({type(layer).__name__}, {layer.num_heads} heads, "
          f"{tuple(x.shape[1:])} per sample) on {device}")
    for key, r in rows.items():
        print(f"  {key:<26} {r['core']:<10} {r['reason']}")
    return {"model": args.model, "layer": name, "explain": rows}


def _model_bench(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    converting = args.convert is not None
    baseline = args.model if converting else args.baseline or args.model.replace("dcvit_", "vit_", 1)
    out: Dict[str, Any] = {"model": args.model, "baseline": baseline, "figures": {}}
    if converting:
        out["convert"] = _convert_options(args)
    backends = ([] if args.compile_only else ["eager"]) + ([] if args.no_compile else ["compile"])
    for backend in backends:
        for dname in args.dtypes.split(","):
            for mode in args.modes.split(","):
                torch._dynamo.reset()
                a, b = _build(args.model, args, device, converting), _build(baseline, args, device)
                fa = _step_fn(a, mode, DTYPES[dname], device, args.batch_size, args.img_size, backend == "compile")
                fb = _step_fn(b, mode, DTYPES[dname], device, args.batch_size, args.img_size, backend == "compile")
                warmup = max(args.warmup, 2 if backend == "compile" else 0)
                r = time_pair(fa, fb, device, warmup, args.steps)
                r.update(mode=mode, dtype=dname, backend=backend, batch=args.batch_size)
                key = f"{mode}/{dname}/{backend}/b{args.batch_size}"
                out["figures"][key] = r
                print(f"  {key:<28} DCViT {r['dcvit_ms']:8.1f} ms  ViT {r['vit_ms']:8.1f} ms  "
                      f"ratio {r['ratio']:.3f}", flush=True)
                del a, b, fa, fb
    if not args.no_memory:
        for backend in args.memory_backends.split(","):
            for dname in args.dtypes.split(","):
                da = _memory(args.model, args, dname, backend, converting)
                db = _memory(baseline, args, dname, backend)
                key = f"memory/{dname}/{backend}/b{args.mem_batch_size}"
                out["figures"][key] = {
                    "dcvit_bytes": da, "vit_bytes": db, "ratio": da / db, "mode": "memory",
                    "dtype": dname, "backend": backend,
                    "kind": "peak_rss" if device.type == "cpu" else "cuda_max_allocated"}
                print(f"  {key:<28} DCViT {da / 2**20:8.0f} MiB ViT {db / 2**20:8.0f} MiB  "
                      f"ratio {da / db:.3f}", flush=True)
    return out


def _export_bench(args: argparse.Namespace) -> Dict[str, Any]:
    """``--onnx`` / ``--aoti``: the exported models side by side (`dcvit.bench.export`)."""
    from .export import bench_aoti, bench_onnx
    try:
        batches = [int(b) for b in args.onnx_batches.split(",")]
    except ValueError:
        raise SystemExit(f"dcvit-bench: --onnx-batches takes a comma list of integers, got {args.onnx_batches!r}")
    baseline = args.baseline or args.model.replace("dcvit_", "vit_", 1)
    threads, warmup = args.threads or 2, max(args.warmup, 2)
    out: Dict[str, Any] = {"model": args.model, "baseline": baseline}
    common = (args.model, baseline, args.img_size, args.depth, batches, threads, args.steps, warmup)
    if args.onnx:
        print(f"{args.model} vs {baseline}, exported to ONNX, ONNX Runtime CPU, {threads} threads")
        out["onnx"] = bench_onnx(*common, before=args.onnx_before, spinning=not args.onnx_no_spin)
    if args.aoti:
        print(f"{args.model} vs {baseline}, AOTInductor packages, {threads} threads")
        out["aoti"] = bench_aoti(*common, cpp=args.aoti_cpp)
    return out


def _print_table(result: Dict[str, Any]) -> None:
    name = result["model"] + (" + DCMHA (dcvit.convert)" if "convert" in result else "")
    print(f"\n{name} vs {result['baseline']} ({result['device']}, "
          f"{result['threads']} threads, img {result['img_size']})")
    print(f"{'figure':<34}{'DCViT':>12}{'ViT':>12}{'ratio':>8}{'pairwise':>10}{'target':>9}  met")
    for key, r in result["figures"].items():
        kind = key.split("/")[0]
        op, bound = TARGETS[kind]
        met = r["ratio"] >= bound if op == ">=" else r["ratio"] <= bound
        if kind == "memory":
            da, db = f"{r['dcvit_bytes'] / 2**20:.0f} MiB", f"{r['vit_bytes'] / 2**20:.0f} MiB"
        else:
            da, db = f"{r['dcvit_ms']:.1f} ms", f"{r['vit_ms']:.1f} ms"
        pairwise = f"{r['ratio_pairwise_median']:.3f}" if "ratio_pairwise_median" in r else "-"
        print(f"{key:<34}{da:>12}{db:>12}{r['ratio']:>8.3f}{pairwise:>10}{op + str(bound):>9}  "
              f"{'yes' if met else 'no'}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dcvit-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dcvit_small_patch16_224")
    p.add_argument("--baseline", default=None, help="default: the model name with dcvit_ -> vit_")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--mem-batch-size", type=int, default=32)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--depth", type=int, default=0, help="override the depth (smoke tests)")
    p.add_argument("--modes", default="inference,train", help="comma list of inference,train")
    p.add_argument("--dtypes", default="fp32", help="comma list of fp32,bf16 (bf16 = autocast)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile figures")
    p.add_argument("--compile-only", action="store_true", help="only the torch.compile timings")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory figure")
    p.add_argument("--steps", type=int, default=9, help="timed steps per model (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per model first")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--impl", default="auto", help="force DCMHA's attention core (dcvit.fused.IMPLS): "
                   "auto, triton (CUDA), cpp (CPU), compile, reference")
    p.add_argument("--explain", action="store_true", help="time nothing: print the attention core "
                   "one DCMHA layer of --model runs in each backend, dtype and mode, and why")
    p.add_argument("--memory-backends", default="eager",
                   help="comma list of eager,compile: peak memory of each (one figure per --dtypes)")
    p.add_argument("--json", default="benchmark.json", help="where to write the results")
    p.add_argument("--layer", action="store_true", help="time one DCMHA layer instead of models")
    p.add_argument("--tokens", type=int, default=197, help="--layer: sequence length N")
    p.add_argument("--dim", type=int, default=384, help="--layer: embedding dim")
    p.add_argument("--heads", type=int, default=6, help="--layer: heads H")
    p.add_argument("--convert", nargs="*", default=None, metavar="KEY=VALUE",
                   help="time --model converted to DCMHA (dcvit.convert with these DCMHA options, "
                        "e.g. rank=2) against --model itself")
    p.add_argument("--onnx", action="store_true",
                   help="export both models and time them in ONNX Runtime (CPU provider) at --onnx-batches")
    p.add_argument("--onnx-batches", default="1,16", help="--onnx: comma list of batch sizes")
    p.add_argument("--onnx-before", action="store_true",
                   help="--onnx: also time DCViT exported with the paper's formulation (Einsum)")
    p.add_argument("--onnx-no-spin", action="store_true",
                   help="--onnx: ONNX Runtime threads sleep instead of spinning (busy shared machines)")
    p.add_argument("--aoti", action="store_true",
                   help="compile both models with AOTInductor (CPU) and time the packages at --onnx-batches")
    p.add_argument("--aoti-cpp", action="store_true",
                   help="--aoti: also DCViT with the C++ attention core kept as a custom op")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--memory-compiled", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point (``dcvit-bench``)."""
    run(argv)


def run(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Parse ``argv``, run the benchmark, print the table, write the JSON; return the results."""
    args = _parser().parse_args(argv)
    from dcvit.fused import IMPLS
    if args.impl not in IMPLS:
        raise SystemExit(f"dcvit-bench: unknown --impl {args.impl!r}; choose one of {IMPLS}")
    for d in args.dtypes.split(","):
        if d not in DTYPES:
            raise SystemExit(f"dcvit-bench: unknown dtype {d!r} in --dtypes; choose from {sorted(DTYPES)}")
    for b in args.memory_backends.split(","):
        if b not in ("eager", "compile"):
            raise SystemExit(f"dcvit-bench: unknown backend {b!r} in --memory-backends; choose from eager,compile")
    for m in args.modes.split(","):
        if m not in ("inference", "train"):
            raise SystemExit(f"dcvit-bench: unknown mode {m!r} in --modes; choose from inference,train")
    try:
        _convert_options(args)
    except ValueError as e:
        raise SystemExit(f"dcvit-bench: {e}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        _memory_child(args)
        return {}
    device = torch.device(args.device)
    meta = {"device": str(device), "threads": torch.get_num_threads(), "img_size": args.img_size,
            "torch": torch.__version__, "platform": platform.platform(),
            "argv": list(argv) if argv is not None else sys.argv[1:],
            "steps": args.steps, "warmup": args.warmup, "impl": args.impl,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    if args.explain:
        result = {**meta, **_explain(args, device)}
    elif args.onnx or args.aoti:
        result = {**meta, **_export_bench(args)}
    elif args.layer:
        result = {**meta, **_layer_bench(args, device)}
    else:
        result = {**meta, **_model_bench(args, device)}
        _print_table(result)
    write_json(args.json, result)
    print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
