"""The steps of scripts/gpu_check.sh, what each is planned to cost, and the run that keeps to a budget.

    python3 scripts/gpu_check_plan.py plan --budget 500          # the CUDA plan (--dry-run: CPU)
    python3 scripts/gpu_check_plan.py run --budget 500 --out DIR --scratch DIR [--dry-run]
    python3 scripts/gpu_check_plan.py missing                    # what the check lacks here
    python3 scripts/gpu_check_plan.py requirements               # what gpu_wheels.sh builds

The steps run in `STEPS`' order, most valuable first. Before each one the time left is
the budget less the time spent; a step whose planned seconds exceed it is recorded as
skipped, one whose prerequisite did not pass likewise, and a step that runs is stopped
(its whole process group) at twice its plan or at the end of the budget, whichever comes
first. After every step the summary (``gpu_check.json``, `gpu_check_report`) and a
tarball of the logs are rewritten in ``--out``, so a run cut short still leaves its
figures; logs, per-step JSON, synthetic data and training runs live in ``--scratch``.

Planned seconds on CUDA come from `cost`: process starts, Triton and torch.compile
compilations (one block size per kernel, ``DCVIT_TRITON_AUTOTUNE=0``), and the timed
work, counted in training steps of the model at batch 256 and priced at the H100
estimate of ``python -m dcvit.bench.kernels --estimate`` (`KERNEL_REPORT`) times `SLACK`. Those unit
costs are assumptions until a GPU run measures them: each step's measured seconds are
in the summary next to its plan. The dry run (CPU, tiny sizes, the reference core) has
fixed costs measured on a 2-core machine.

Standard library only: it runs before the wheels of a bare image are installed. One file
over 400 lines for that reason: gpu_check.sh runs it as a script before anything (this
repository's packages included) can be imported, so its steps, costs and runner travel together.
"""
import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# The repository root, and every path the check uses below it: the one place to change if
# the scripts move (gpu_check.sh passes --root).
ROOT = Path(__file__).resolve().parents[1]


def paths(root: Path) -> Dict[str, Path]:
    scripts = root / "scripts"
    return dict(root=root, pyproject=root / "pyproject.toml", report=scripts / "gpu_check_report.py",
                loop_overhead=scripts / "loop_overhead.py", shards=scripts / "make_wds_shards.py",
                config=root / "configs" / "deit300_dcvit_small.yaml")


# (distribution, module) the check imports that a torch + timm image may lack; all pure
# Python, so scripts/gpu_wheels.sh builds them as wheels anywhere (versions: this
# environment's, else pyproject's minimum). fvcore's own needs are listed with it.
REQUIREMENTS = (("fvcore", "fvcore"), ("iopath", "iopath"), ("yacs", "yacs"), ("termcolor", "termcolor"),
                ("portalocker", "portalocker"), ("tabulate", "tabulate"), ("webdataset", "webdataset"),
                ("braceexpand", "braceexpand"), ("timm", "timm"), ("torchmetrics", "torchmetrics"),
                ("lightning-utilities", "lightning_utilities"))
# Compiled packages the check needs too: no wheel is built for them (the image must have them).
COMPILED = (("torch", "torch"), ("numpy", "numpy"), ("pyyaml", "yaml"), ("pillow", "PIL"),
            ("safetensors", "safetensors"))

# Unit costs of the CUDA plan (seconds), assumptions until a GPU run measures them.
START = 15.0            # a Python process: interpreter, torch, timm, dcvit, the CUDA context
TRITON_COMPILE = 12.0   # one Triton kernel variant compiled for the GPU
TORCH_COMPILE = 90.0    # one torch.compile graph (a model's training or inference step)
SLACK = 4.0             # a measured step against the estimate, a lower bound
# dcvit.bench.kernels --estimate's H100 training-step milliseconds at batch 256 (DCViT, ViT),
# used when the environment step could not compute them.
DEFAULT_STEP_MS = {"S/16": (17.4, 8.3), "B/16": (56.3, 29.5)}
# The smoke training run: images per class, classes, epochs, batch (CUDA; dry run).
SMOKE = {False: (160, 10, 4, 64), True: (16, 2, 2, 8)}


@dataclass
class Step:
    name: str
    what: str
    cuda_s: Callable[[Dict[str, Tuple[float, float]]], float]   # from the estimate's step ms
    dry_s: float
    argv: Callable[["Context"], List[str]]
    needs: Tuple[str, ...] = ()
    serves: Optional[str] = None    # a step run only for this later one: planned only with it


@dataclass
class Context:
    root: Path
    out: Path
    scratch: Path
    dry: bool
    python: str = sys.executable
    p: Dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.p = paths(self.root)


def _train_s(ms: Dict[str, Tuple[float, float]], label: str, steps: float, both: bool = True) -> float:
    """Seconds of ``steps`` training steps of DCViT (and ViT) at batch 256."""
    dc, vit = ms[label]
    return SLACK * steps * (dc + (vit if both else 0.0)) / 1e3


def _bench_s(label: str, warmup: int, steps: int) -> Callable:
    # 3 processes (timing, one memory child per model), one compile per kernel not yet cached;
    # per model: warm-up and timed training and inference steps (inference ~1/3 of a step),
    # and the memory child's 2 training steps.
    return lambda ms: 3 * START + 3 * TRITON_COMPILE + _train_s(ms, label, (warmup + steps) * 4 / 3 + 2)


def _bench_compiled_s(label: str) -> Callable:
    # the eager bench's processes and steps, plus the training and inference graphs of both
    # models and one graph per memory child
    return lambda ms: _bench_s(label, 2, 5)(ms) + 6 * TORCH_COMPILE


def _bench(model: str, core: str, compiled: bool) -> Callable[[Context], List[str]]:
    def argv(c: Context) -> List[str]:
        name = f"bench_{model}_{'compile' if compiled else 'eager'}_{core}"
        if c.dry:
            sizes = ["--device", "cpu", "--model", f"dcvit_{'small' if model == 'S' else 'base'}_patch16_224",
                     "--img-size", "32", "--depth", "1", "--batch-size", "2", "--mem-batch-size", "2",
                     "--steps", "1", "--warmup", "0", "--impl", "reference", "--no-memory"]
        else:
            sizes = ["--device", "cuda", "--model", f"dcvit_{'small' if model == 'S' else 'base'}_patch16_224",
                     "--batch-size", "256", "--mem-batch-size", "256", "--steps", "7" if model == "S" else "5",
                     "--warmup", "2", "--impl", core]
        mode = ["--memory-backends", "compile", "--compile-only"] if compiled else ["--no-compile"]
        return [c.python, "-m", "dcvit.bench", *sizes, "--dtypes", "bf16", *mode,
                "--json", str(c.scratch / f"{name}.json")]
    return argv


_ENVIRONMENT = r"""
import json, sys, torch, timm, dcvit
info = {"python": sys.version.split()[0], "torch": torch.__version__, "timm": timm.__version__,
        "cuda": torch.version.cuda, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
from dcvit.fused import select_impl
dev = "cuda" if torch.cuda.is_available() else "cpu"
for label, (h, dtype) in {"S/16": (6, torch.bfloat16), "B/16": (12, torch.bfloat16)}.items():
    core, why = select_impl("auto", torch.zeros(1, h, 197, 64, device=dev, dtype=dtype))
    info.setdefault("auto_core", core)
    info.setdefault("cores", {})[label] = {"core": core, "reason": why}
if sys.argv[3] != "dry":   # the CUDA plan's prices (the dry run's are fixed)
    from dcvit.bench import kernels
    est = kernels.estimate(jobs=6)   # its 6 kernels compiled side by side, for their issue slots
    info["estimate_step_ms"] = {k: [m["step_ms"]["dcvit"], m["step_ms"]["vit"]] for k, m in est["models"].items()}
info["wheels_installed"] = [n for n in sys.argv[2].split(",") if n]
print(json.dumps(info, indent=1))
json.dump(info, open(sys.argv[1], "w"), indent=1)
"""


def _environment(c: Context) -> List[str]:
    return [c.python, "-c", _ENVIRONMENT, str(c.scratch / "environment.json"),
            os.environ.get("DCVIT_GPU_CHECK_WHEELS", ""), "dry" if c.dry else "cuda"]


def _kernels(c: Context) -> List[str]:
    size = ["--device", "cpu", "--tokens", "5", "--batch-size", "1"] if c.dry else ["--batch-size", "16"]
    return [c.python, "-m", "dcvit.bench.gpu_kernels", *size, "--json", str(c.scratch / "kernels.json")]


def _kernel_times(c: Context) -> List[str]:
    # the dry run (CPU) checks the plumbing: the work alone, no compilation for issue slots
    return [c.python, "-m", "dcvit.bench.kernels", "--estimate", *(["--no-issue"] if c.dry else ["--measure"]),
            "--json", str(c.scratch / "kernel_times.json")]


def _loop(c: Context) -> List[str]:
    size = (["--device", "cpu", "--model", "dcvit_tiny_patch16_224", "--img-size", "32", "--depth", "1",
             "--batch-size", "2", "--steps", "2", "--repeats", "1"] if c.dry else
            ["--device", "cuda", "--model", "dcvit_small_patch16_224", "--batch-size", "256", "--steps", "30",
             "--repeats", "3"])
    return [c.python, str(c.p["loop_overhead"]), *size, "--amp", "bf16", "--json", str(c.scratch / "loop_overhead.json")]


_SYNTHETIC = r"""
import sys, numpy as np
from pathlib import Path
from PIL import Image
root, per_class, classes = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
for split, n in (("train", per_class), ("val", max(2, per_class // 10))):
    for c in range(classes):
        d = root / split / f"class{c:02d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(d / f"{i:05d}.jpg", quality=90)
"""


def _shards(c: Context) -> List[str]:
    per_class, classes, _, _ = SMOKE[c.dry]
    data, py, shards = c.scratch / "synthetic", c.python, c.p["shards"]
    return ["bash", "-c", "set -e; rm -rf \"$1\"; \"$2\" -c \"$3\" \"$1/folder\" $4 $5; "
            "\"$2\" \"$6\" --src \"$1/folder/train\" --out \"$1/shards\" --split train --shard-size 400 --no-progress; "
            "\"$2\" \"$6\" --src \"$1/folder/val\" --out \"$1/shards\" --split val --shard-size 400 "
            "--classes \"$1/shards/classes.json\" --no-progress; rm -rf \"$1/folder\"",
            "shards", str(data), py, _SYNTHETIC, str(per_class), str(classes), str(shards)]


def _train(compiled: bool) -> Callable[[Context], List[str]]:
    def argv(c: Context) -> List[str]:
        _, classes, epochs, batch = SMOKE[c.dry]
        shards = c.scratch / "synthetic" / "shards"
        run = c.scratch / f"run_{'compile' if compiled else 'eager'}"
        sizes = (["model=dcvit_tiny_patch16_224", "model_kwargs={img_size: 32, depth: 1}", "data.img_size=32",
                  "data.num_workers=1", "threads=1"] if c.dry else ["data.num_workers=8"])
        return [c.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "train_imagenet",
                "--config", str(c.p["config"]), f"data.train={shards}", f"data.val={shards}",
                f"data.num_classes={classes}", f"epochs={epochs}", f"batch_size={batch}", "amp=bf16",
                "sched.warmup_epochs=1", "ema.enabled=false", "save_every_steps=0", *sizes,
                *(["compile=true"] if compiled else []), f"output_dir={run}"]
    return argv


def _smoke_s(compiled: bool) -> Callable:
    per_class, classes, epochs, batch = SMOKE[False]
    updates = epochs * per_class * classes // batch
    # torchrun and 8 loader workers; updates at batch 64 (a quarter of a 256 step); per epoch
    # a validation pass and the log; compiled: the training and the evaluation graphs
    return lambda ms: (2 * START + _train_s(ms, "S/16", updates / 4, both=False) + 5 * epochs
                       + (2 * TORCH_COMPILE if compiled else 0.0))


# Most valuable first: the environment and the chosen core; the kernels against
# the reference; their times next to SDPA and the estimate; DCViT against ViT in eager mode;
# the training loop's overhead; then, while the budget lasts, smoke training and compiled figures.
STEPS = (
    # the automatic core runs the Triton kernels' one-time check (3 compilations per head count);
    # the estimate compiles the 6 production kernels in parallel (one compilation's time)
    Step("environment", "versions, GPU, the automatic core per model, the estimate",
         lambda ms: START + 15 + (2 * 3 + 1) * TRITON_COMPILE, 15, _environment),
    Step("kernels", "Triton core vs the float64 reference, S/16 and B/16 layers, bf16",
         lambda ms: START + 2 * 3 * TRITON_COMPILE, 20, _kernels),
    Step("kernel_times", "Triton kernels and SDPA timed next to the roofline estimate",
         lambda ms: START + 15 + 2 * TRITON_COMPILE + 8 * 0.3, 35, _kernel_times),
    Step("bench_S_eager_triton", "DCViT-S/16 vs ViT-S/16, eager bf16 b256: train, inference, memory",
         _bench_s("S/16", 2, 7), 20, _bench("S", "triton", False)),
    Step("bench_B_eager_triton", "DCViT-B/16 vs ViT-B/16, eager bf16 b256: train, inference, memory",
         _bench_s("B/16", 2, 5), 25, _bench("B", "triton", False)),
    Step("loop_overhead", "train_one_epoch against a bare loop, DCViT-S/16 b256 bf16",
         lambda ms: START + TRITON_COMPILE + _train_s(ms, "S/16", 2 * 3 * 30 + 10, both=False), 20, _loop),
    Step("synthetic_shards", "synthetic JPEGs written as WebDataset shards (scratch)",
         lambda ms: START + 10 + 0.005 * SMOKE[False][0] * SMOKE[False][1], 15, _shards,
         serves="train_smoke_eager"),
    Step("train_smoke_eager", "train_imagenet, one process, bf16, on the synthetic shards",
         _smoke_s(False), 20, _train(False), needs=("synthetic_shards",)),
    Step("bench_S_compile_triton", "DCViT-S/16 vs ViT-S/16 under torch.compile", _bench_compiled_s("S/16"), 60,
         _bench("S", "triton", True)),
    Step("train_smoke_compile", "train_imagenet with compile=true", _smoke_s(True), 80, _train(True),
         needs=("synthetic_shards",)),
    Step("bench_S_eager_compile", "DCViT-S/16 with the 'compile' core, eager model",
         lambda ms: _bench_s("S/16", 2, 7)(ms) + 2 * TORCH_COMPILE, 35, _bench("S", "compile", False)),
    Step("bench_B_compile_triton", "DCViT-B/16 vs ViT-B/16 under torch.compile", _bench_compiled_s("B/16"), 130,
         _bench("B", "triton", True)),
)
RESERVE = 5.0   # seconds kept for the last summary


def cost(step: Step, dry: bool, step_ms: Optional[Dict[str, Sequence[float]]] = None) -> float:
    """Planned seconds of one step (CUDA: from the estimate's step milliseconds)."""
    if dry:
        return float(step.dry_s)
    ms = {k: tuple(v) for k, v in (step_ms or DEFAULT_STEP_MS).items()}
    return round(step.cuda_s(ms), 1)


def _served(step: Step, dry: bool, step_ms: Optional[Dict[str, Sequence[float]]]) -> float:
    """Planned seconds of the step that ``step`` is run for (0 when it stands alone)."""
    return next((cost(s, dry, step_ms) for s in STEPS if s.name == step.serves), 0.0) if step.serves else 0.0


def plan(budget: float, dry: bool, step_ms: Optional[Dict[str, Sequence[float]]] = None) -> List[Dict]:
    """Each step in order, its planned seconds, and whether it fits what the steps before
    it leave of the budget (a skipped step leaves its time to the later ones; a step whose
    prerequisite is skipped is skipped too)."""
    rows, used, planned_in = [], 0.0, set()
    for s in STEPS:
        planned = cost(s, dry, step_ms)
        fits = (used + planned + _served(s, dry, step_ms) <= budget - RESERVE
                and all(n in planned_in for n in s.needs))
        planned_in |= {s.name} if fits else set()
        used += planned if fits else 0.0
        rows.append(dict(step=s.name, what=s.what, planned_s=planned, fits=fits))
    return rows


def _version(v: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def minimums(pyproject: Path) -> Dict[str, str]:
    """``name -> minimum version`` of pyproject.toml's dependencies."""
    text = pyproject.read_text() if pyproject.exists() else ""
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r'"([A-Za-z0-9_.-]+)>=([0-9][^",;\s]*)', text)}


def missing(pyproject: Path, wanted=REQUIREMENTS) -> List[str]:
    """The distributions of ``wanted`` that cannot be imported here, or are older than pyproject's minimum."""
    lows, out = minimums(pyproject), []
    for dist, module in wanted:
        if importlib.util.find_spec(module) is None:
            out.append(dist)
            continue
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if dist in lows and _version(have) < _version(lows[dist]):
            out.append(dist)
    return out


def requirements(pyproject: Path) -> List[str]:
    """What gpu_wheels.sh builds: this environment's version of each, else ``>=`` pyproject's minimum."""
    lows, out = minimums(pyproject), []
    for dist, _ in REQUIREMENTS:
        try:
            out.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{dist}>={lows[dist]}" if dist in lows else dist)
    return out


def _execute(argv: List[str], log: Path, limit: float, env: Dict[str, str]) -> Tuple[str, int]:
    """Run argv in its own process group, output to log; stopped (the whole group) at ``limit`` s."""
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(limit, 1.0))
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            return "timeout", -1
    return ("pass" if rc == 0 else "fail"), rc


def _publish(c: Context, meta: Dict) -> None:
    """The summary and the logs' tarball in --out, each written whole (temporary file, rename)."""
    (c.scratch / "steps.json").write_text(json.dumps(meta, indent=1))
    try:
        sys.path.insert(0, str(c.p["report"].parent))
        import gpu_check_report
        gpu_check_report.report(c.scratch, c.out, quiet=True)
    except Exception as e:  # noqa: BLE001  (the summary must not stop the check)
        (c.out / "gpu_check.json.tmp").write_text(json.dumps({**meta, "report_error": repr(e)}, indent=1))
        os.replace(c.out / "gpu_check.json.tmp", c.out / "gpu_check.json")
    tmp = c.out / "gpu_check_logs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(c.scratch.rglob("*")):
            rel = path.relative_to(c.scratch)
            if path.is_file() and rel.parts[0] not in ("synthetic", "site") and path.suffix in (
                    ".log", ".json", ".jsonl", ".yaml", ".txt"):
                tar.add(path, arcname=f"gpu_check/{rel}")
    os.replace(tmp, c.out / "gpu_check_logs.tar.gz")


def run(c: Context, budget: float) -> Dict:
    """Every step of `STEPS` that fits, in order; returns the steps' records."""
    start = time.monotonic()
    c.out.mkdir(parents=True, exist_ok=True)
    c.scratch.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DCVIT_TRITON_AUTOTUNE="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(c.root), env.get("PYTHONPATH", "")) if p)
    if c.dry:   # Triton's interpreter on CPU; no C++ kernel build (a minute, not what is checked)
        env.update(TRITON_INTERPRET="1", DCVIT_NO_CPP_KERNEL="1")
    step_ms = None
    meta = dict(budget_s=budget, dry_run=c.dry, scratch=str(c.scratch), plan=plan(budget, c.dry), steps=[])
    for s in STEPS:
        planned = cost(s, c.dry, step_ms)
        left = budget - RESERVE - (time.monotonic() - start)
        done = {r["step"]: r["status"] for r in meta["steps"]}
        row = dict(step=s.name, what=s.what, planned_s=planned, seconds=0.0, limit_s=0.0, log=None)
        unmet = [n for n in s.needs if done.get(n) != "pass"]
        if unmet:
            row.update(status="skipped", reason=f"needs {', '.join(unmet)}, which did not pass")
        elif planned + _served(s, c.dry, step_ms) > left:
            also = f" (with {s.serves}, which it is for)" if s.serves else ""
            row.update(status="skipped", reason=f"planned {planned + _served(s, c.dry, step_ms):.0f} s{also} > "
                                                f"{max(left, 0):.0f} s left of the budget")
        else:
            limit = min(left, max(2 * planned, planned + 30))
            print(f"{s.name:<26} planned {planned:5.0f} s, limit {limit:5.0f} s ... ", end="", flush=True)
            t = time.monotonic()
            status, rc = _execute(s.argv(c), c.scratch / f"{s.name}.log", limit, env)
            row.update(status=status, returncode=rc, seconds=round(time.monotonic() - t, 1),
                       limit_s=round(limit, 1), log=f"{s.name}.log")
            print(f"{status} in {row['seconds']:.0f} s", flush=True)
        if row["status"] == "skipped":
            print(f"{s.name:<26} skipped: {row['reason']}", flush=True)
        meta["steps"].append(row)
        if s.name == "environment" and row["status"] == "pass" and not c.dry:
            try:
                step_ms = json.loads((c.scratch / "environment.json").read_text())["estimate_step_ms"]
                meta["plan"] = plan(budget, c.dry, step_ms)
            except (OSError, ValueError, KeyError):
                pass
        meta["elapsed_s"] = round(time.monotonic() - start, 1)
        _publish(c, meta)
    return meta


def _estimate_ms(root: Path) -> Optional[Dict[str, List[float]]]:
    """dcvit.bench.kernels --estimate's step milliseconds, when torch, timm and dcvit import here."""
    try:
        sys.path[:0] = [str(root)]
        from dcvit.bench import kernels
        return {k: [m["step_ms"]["dcvit"], m["step_ms"]["vit"]] for k, m in kernels.estimate()["models"].items()}
    except Exception:  # noqa: BLE001  (a bare environment: the defaults)
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["plan", "run", "missing", "requirements"])
    p.add_argument("--budget", type=float, default=500.0)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--out", type=Path, default=Path("gpu_check"))
    p.add_argument("--scratch", type=Path, default=None)
    p.add_argument("--root", type=Path, default=ROOT)
    p.add_argument("--json", action="store_true", help="plan: print JSON")
    a = p.parse_args(argv)
    if a.budget <= RESERVE:
        p.error(f"--budget {a.budget:g}: give more than {RESERVE:g} seconds")
    pyproject = paths(a.root)["pyproject"]
    if a.command == "missing":
        print(" ".join(missing(pyproject)))
        return 0
    if a.command == "requirements":
        print("\n".join(requirements(pyproject)))
        return 0
    if a.command == "plan":
        ms = None if a.dry_run else _estimate_ms(a.root)
        rows = plan(a.budget, a.dry_run, ms)
        if a.json:
            print(json.dumps(dict(budget_s=a.budget, step_ms=ms or DEFAULT_STEP_MS, plan=rows), indent=1))
            return 0
        print(f"plan for {a.budget:.0f} s ({'dry run' if a.dry_run else 'CUDA'}; step ms "
              f"{'from the estimate' if ms else 'defaults'}: {ms or DEFAULT_STEP_MS})")
        for r in rows:
            print(f"  {r['step']:<26}{r['planned_s']:7.0f} s  {'run' if r['fits'] else 'skipped'}")
        print(f"  {'planned total':<26}{sum(r['planned_s'] for r in rows if r['fits']):7.0f} s")
        return 0
    if a.scratch is None:
        p.error("run needs --scratch DIR")
    meta = run(Context(a.root.resolve(), a.out.resolve(), a.scratch.resolve(), a.dry_run), a.budget)
    return 0 if all(r["status"] in ("pass", "skipped") for r in meta["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
