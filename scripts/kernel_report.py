"""Resources of the Triton attention kernels, measured ahead of time without a GPU.

Every kernel variant that `dcvit.kernels.triton_core` can launch (kernel, heads, head dim,
dtype, mask, which Compose stages and matrix sides are present, every `block_sizes`
candidate) is compiled by Triton for a GPU target (sm_80 A100, sm_90 H100, sm_100 B200
where the installed Triton knows it) and its PTX assembled by ``ptxas -v``, the assembler
in Triton's wheel. Per variant: registers per thread, spill store/load bytes per thread,
shared memory per block (Triton's, allocated dynamically), and the static count of
tensor-core instructions (``mma``/``wgmma``/``tcgen05.mma`` in the PTX) and of fp32 FMAs
(``fma.rn.f32``). A spill means a loop's working set goes through local memory; a block
above the GPU's shared memory per block cannot launch at all.

The kernels' arguments are the ones ``attention_forward``/``attention_backward`` pass (the
launch is captured, not run), for q, k, v as views of one (B, N, 3, H, D) qkv projection
and N = 197 tokens, so Triton's own specialisation (strides of 1 as constants, 16-byte
alignment) is what a real launch gets.

    python scripts/kernel_report.py --quick                 # the resource test's variants
    python scripts/kernel_report.py --heads 6 12 --targets sm90 --json out.json
    python scripts/kernel_report.py --estimate              # expected H100 time (docs/performance.md)

Needs only the triton wheel (and torch); runs on CPU, compiling in a pool of 2 processes.
"""
import argparse
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, Iterable, List, Optional, Sequence

KERNELS = ("forward_kernel", "backward_query_kernel", "backward_key_kernel")
SHORT = {"forward_kernel": "fwd", "backward_query_kernel": "bwd_q", "backward_key_kernel": "bwd_k"}
DTYPES = ("bf16", "fp16", "fp32")
# A Compose stage: absent, query-side matrices only, or both sides.
STAGES = ("", "q", "qk")
N_TOKENS = 197
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}   # opt-in bytes per block


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled kernel: what the dispatcher would launch for these operands."""
    kernel: str
    arch: int
    H: int
    D: int
    dtype: str
    mask: bool
    pre: str
    post: str
    BT: int
    BS: int
    num_warps: int
    num_stages: int = 3
    maxnreg: int = 0

    @property
    def name(self) -> str:
        flags = f"pre={self.pre or '-'},post={self.post or '-'}{',mask' if self.mask else ''}"
        return (f"{SHORT[self.kernel]} sm{self.arch} H={self.H} D={self.D} {self.dtype} {flags} "
                f"BT={self.BT} BS={self.BS} w={self.num_warps} st={self.num_stages}")


def triton_module():
    """triton, or None when it is missing."""
    try:
        import triton
        return triton
    except Exception:  # noqa: BLE001
        return None


def ptxas(arch: int) -> Optional[str]:
    """Path of the ptxas Triton uses for ``arch`` (its wheel's, or TRITON_PTXAS_PATH), or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        path = get_ptxas(arch).path
    except Exception:  # noqa: BLE001
        return None
    return path if path and os.path.exists(path) else None


def known_archs() -> List[int]:
    """The targets the installed Triton compiles for: 80 and 90, and 100 with a Blackwell ptxas."""
    return [a for a in (80, 90, 100) if ptxas(a)]


def variants(heads: Iterable[int] = (3, 6, 12, 16), dims: Iterable[int] = (32, 64),
             dtypes: Iterable[str] = DTYPES, archs: Iterable[int] = (80, 90),
             masks: Iterable[bool] = (False, True), stages: Optional[Sequence] = None,
             kernels: Iterable[str] = KERNELS) -> List[Variant]:
    """Every combination, times every `block_sizes` candidate of its head count. ``stages``:
    (pre, post) pairs from `STAGES`, default all nine."""
    from dcvit.kernels.triton_core import block_sizes
    stages = list(stages) if stages is not None else list(itertools.product(STAGES, STAGES))
    out = []
    for kernel, arch, H, D, dtype, mask, (pre, post) in itertools.product(
            kernels, archs, heads, dims, dtypes, masks, stages):
        for c in block_sizes(H, kernel):
            out.append(Variant(kernel, arch, H, D, dtype, mask, pre, post, c["BT"], c["BS"], c["num_warps"],
                               c.get("num_stages", 3), c.get("maxnreg") or 0))
    return out


@contextlib.contextmanager
def _captured_launches():
    """Run `triton_core` on CPU tensors with its launches recorded instead of run, as on a GPU
    (not the interpreter's precision)."""
    from dcvit.kernels import triton_core
    seen: Dict[str, tuple] = {}
    saved = triton_core._launch, triton_core.interpreted
    triton_core._launch = lambda name, device, H, rows, block, B, args, kwargs: seen.__setitem__(name, (args, kwargs))
    triton_core.interpreted = lambda: False
    try:
        yield seen
    finally:
        triton_core._launch, triton_core.interpreted = saved


def launch_arguments(v: Variant):
    """(positional arguments, compile-time keyword arguments) of the kernel ``v.kernel`` as
    `triton_core` launches it for a (1, N_TOKENS) problem of v's kind."""
    import torch
    from dcvit.kernels import triton_core
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[v.dtype]
    B, H, N, D = 1, v.H, N_TOKENS, v.D
    qkv = torch.zeros(B, N, 3, H, D, dtype=dtype).permute(2, 0, 3, 1, 4)
    q, k, w = qkv.unbind(0)
    mats = []
    for stage in (v.pre, v.post):
        mats += [torch.zeros(B, N, H, H) if stage else None, torch.zeros(B, N, H, H) if stage == "qk" else None]
    mask = torch.zeros(N, N) if v.mask else None
    with _captured_launches() as seen:
        if v.kernel == "forward_kernel":
            triton_core.attention_forward(q, k, w, mask, *mats, D ** -0.5)
        else:
            lse = torch.zeros(B, H, N)
            triton_core.attention_backward(torch.zeros(B, N, H, D, dtype=dtype), q, k, w, mask, *mats,
                                           lse, D ** -0.5)
    return seen[v.kernel]


def _ptxas_figures(text: str) -> Dict[str, int]:
    """Registers, spill store/load bytes and static shared memory from ``ptxas -v``'s log."""
    def grab(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0
    return dict(registers=grab(r"Used (\d+) registers"),
                spill_stores=grab(r"(\d+) bytes spill stores"),
                spill_loads=grab(r"(\d+) bytes spill loads"),
                stack=grab(r"(\d+) bytes stack frame"),
                static_smem=grab(r"(\d+) bytes smem"))


def compile_variant(v: Variant) -> Dict:
    """Compile ``v`` for its target and measure it: a row of the report (``error`` set when
    Triton or ptxas rejects it)."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from dcvit.kernels import triton_attention
    row = dict(dataclasses.asdict(v), name=v.name)
    fn = getattr(triton_attention, v.kernel)
    args, kwargs = launch_arguments(v)
    kwargs = dict(kwargs, BT=v.BT, BS=v.BS)
    signature, constexprs, attrs = {}, {}, {}
    for i, arg_name in enumerate(fn.arg_names):
        if arg_name in kwargs:
            signature[arg_name], constexprs[arg_name] = "constexpr", kwargs[arg_name]
            continue
        kind, spec = native_specialize_impl(CUDABackend, args[i], False, True, True)
        signature[arg_name] = kind
        if kind == "constexpr":
            constexprs[arg_name] = spec
        elif spec:
            attrs[(i,)] = CUDABackend.parse_attr(spec)
    try:
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": v.num_warps, "num_stages": v.num_stages}
        if v.maxnreg:
            options["maxnreg"] = v.maxnreg
        compiled = triton.compile(src, target=GPUTarget("cuda", v.arch, 32), options=options)
        ptx = compiled.asm["ptx"]
        gpu = f"sm_{v.arch}a" if v.arch >= 90 else f"sm_{v.arch}"
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            log = subprocess.run([ptxas(v.arch), "-v", f"--gpu-name={gpu}", path, "-o", os.path.join(tmp, "k.cubin")],
                                 capture_output=True, text=True, check=True).stderr
    except Exception as e:  # noqa: BLE001  (out of resources, compiler errors: a figure too)
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else ''}"
        return row
    row.update(_ptxas_figures(log))
    row["shared"] = int(compiled.metadata.shared) + row.pop("static_smem")
    row["tensor_core"] = len(re.findall(r"^\s*(?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)\b", ptx, re.M))
    row["fma_f32"] = len(re.findall(r"^\s*fma\.rn(?:\.ftz)?\.f32\b", ptx, re.M))
    return row


def measure(vs: Sequence[Variant], jobs: int = 2) -> List[Dict]:
    """`compile_variant` over ``vs`` in a pool of ``jobs`` processes, in order."""
    if jobs <= 1 or len(vs) <= 1:
        return [compile_variant(v) for v in vs]
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")          # no inherited torch/triton threads
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        return list(pool.map(compile_variant, vs))


def table(rows: Sequence[Dict]) -> str:
    """One line per variant."""
    head = f"{'variant':<84} {'regs':>4} {'spill st':>8} {'spill ld':>8} {'smem KiB':>8} {'mma':>5} {'fma':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:<84} error: {r['error']}")
        else:
            lines.append(f"{r['name']:<84} {r['registers']:>4} {r['spill_stores']:>8} {r['spill_loads']:>8} "
                         f"{r['shared'] / 1024:>8.1f} {r['tensor_core']:>5} {r['fma_f32']:>6}")
    return "\n".join(lines)


def summary(rows: Sequence[Dict]) -> str:
    """Per (target, heads, kernel): ranges of spill stores, registers and shared memory over
    the variants (the markdown table of docs/performance.md)."""
    groups: Dict[tuple, List[Dict]] = {}
    for r in rows:
        groups.setdefault((r["arch"], r["H"], r["kernel"]), []).append(r)

    def span(vals, fmt="{:d}"):
        lo, hi = min(vals), max(vals)
        return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}–{fmt.format(hi)}"
    lines = ["| target | heads | kernel | variants | spill stores (B) | registers | shared (KiB) | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for (arch, H, kernel), rs in sorted(groups.items()):
        ok = [r for r in rs if "error" not in r]
        cells = [span([r["spill_stores"] for r in ok]), span([r["registers"] for r in ok]),
                 span([r["shared"] / 1024 for r in ok], "{:.0f}")] if ok else ["-", "-", "-"]
        lines.append(f"| sm_{arch} | {H} | {SHORT[kernel]} | {len(rs)} | {' | '.join(cells)} | {len(rs) - len(ok)} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, nargs="+", default=[3, 6, 12, 16])
    p.add_argument("--dims", type=int, nargs="+", default=[32, 64])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--targets", nargs="+", default=None, metavar="smXX",
                   help="sm80 sm90 sm100 (default: every one the installed Triton knows)")
    p.add_argument("--kernels", nargs="+", default=list(SHORT.values()), choices=list(SHORT.values()))
    p.add_argument("--mask", choices=["both", "yes", "no"], default="both")
    p.add_argument("--quick", action="store_true",
                   help="the resource test's variants: D=64, bf16, sm80+sm90, mask, pre+post with both sides")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--estimate", action="store_true",
                   help="print the expected H100 times of DCViT-S/16 and B/16 instead (no compiling)")
    a = p.parse_args(argv)
    if a.estimate:
        from kernel_estimate import main as estimate
        return estimate()
    if triton_module() is None:
        print("error: triton is not installed (pip install triton)", file=sys.stderr)
        return 2
    archs = known_archs()
    if not archs:
        print("error: Triton's ptxas was not found (its wheel bundles one; or set TRITON_PTXAS_PATH)",
              file=sys.stderr)
        return 2
    if a.targets:
        try:
            want = [int(t.lower().removeprefix("sm_").removeprefix("sm")) for t in a.targets]
        except ValueError:
            print(f"error: --targets takes sm80 sm90 sm100, got {a.targets}", file=sys.stderr)
            return 2
        missing = [t for t in want if t not in archs]
        if missing:
            print(f"error: no ptxas for sm_{missing[0]} in this Triton (known: {archs})", file=sys.stderr)
            return 2
        archs = want
    bad = [h for h in a.heads if not 1 <= h <= 16]
    if bad:
        print(f"error: the kernels take 1 to 16 heads, got {bad[0]}", file=sys.stderr)
        return 2
    kernels = [k for k in KERNELS if SHORT[k] in a.kernels]
    masks = {"both": (False, True), "yes": (True,), "no": (False,)}[a.mask]
    if a.quick:
        vs = variants(a.heads, (64,), ("bf16",), [x for x in archs if x in (80, 90)], (True,),
                      [("qk", "qk")], kernels)
    else:
        vs = variants(a.heads, a.dims, a.dtypes, archs, masks, None, kernels)
    for arch in archs:
        print(f"ptxas for sm_{arch}: {ptxas(arch)} ({_ptxas_version(arch)})")
    print(f"compiling {len(vs)} variants with {a.jobs} processes ...", flush=True)
    rows = measure(vs, a.jobs)
    print(table(rows))
    print()
    print(summary(rows))
    if a.json:
        import triton
        with open(a.json, "w") as f:
            json.dump(dict(triton=triton.__version__, ptxas={a_: ptxas(a_) for a_ in archs},
                           n_tokens=N_TOKENS, rows=rows), f, indent=1)
        print(f"wrote {a.json}")
    return 0


def _ptxas_version(arch: int) -> str:
    out = subprocess.run([ptxas(arch), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release ([\d.]+)", out)
    return f"CUDA {m.group(1)}" if m else "version unknown"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
