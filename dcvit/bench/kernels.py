"""Resources of the Triton attention kernels, measured ahead of time without a GPU.

Every kernel variant that `dcvit.kernels.triton_core` can launch (kernel, heads, head dim,
dtype, mask, which Compose stages and matrix sides are present, every `block_sizes`
candidate) is compiled by Triton for a GPU target (sm_80 A100, sm_90 H100, sm_100 B200
where the installed Triton knows it; named by ``--targets``, sm_86, sm_89 and sm_120 too,
GPUs with 99 KiB of shared memory a block) and its PTX assembled by ``ptxas -v``, the assembler in
Triton's wheel. Per variant: registers per thread, spill store/load bytes per thread,
shared memory per block (Triton's, allocated dynamically), and the static count of
tensor-core instructions (``mma``/``wgmma``/``tcgen05.mma`` in the PTX) and of fp32 FMAs
(``fma.rn.f32``). A spill means a loop's working set goes through local memory; a block
above the GPU's shared memory per block cannot launch at all.

The kernels' arguments are the ones ``attention_forward``/``attention_backward`` pass (the
launch is captured, not run), for q, k, v as views of one (B, N, 3, H, D) qkv projection
and N = 197 tokens, so Triton's own specialisation (strides of 1 as constants, 16-byte
alignment) is what a real launch gets.

    python -m dcvit.bench.kernels --quick                 # the masked production variants
    python -m dcvit.bench.kernels --quick --mask heads    # the same, a mask per head
    python -m dcvit.bench.kernels --production --check    # DCViT's own variants; status 1 if one does not fit
    python -m dcvit.bench.kernels --production --targets sm86 sm120 --check  # the same, 99 KiB GPUs
    python -m dcvit.bench.kernels --heads 6 12 --targets sm90 --json out.json
    python -m dcvit.bench.kernels --estimate              # expected H100 time (docs/performance.md)
    python -m dcvit.bench.kernels --production --heads 6 --kernels fwd --targets sm90 --lines
                                                          # which source lines its loops' instructions are

Needs only the triton wheel (and torch); runs on CPU, compiling in a pool of 2 processes.
It runs under any Triton put first on ``PYTHONPATH`` (tests/test_triton_releases.py), which
is why it imports triton, torch and the model code only inside the functions that need them.
One module over 400 lines: the variants, their compilation and the estimate read the same
kernel table, and the GPU check runs all three.
"""
import argparse
import collections
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

ATTENTION_KERNELS = ("forward_kernel", "backward_query_kernel", "backward_key_kernel")
KERNELS = ATTENTION_KERNELS + ("score_grad_products_kernel",)     # the last where the map is used
SHORT = {"forward_kernel": "fwd", "backward_query_kernel": "bwd_q", "backward_key_kernel": "bwd_k",
         "score_grad_products_kernel": "products"}
DTYPES = ("bf16", "fp16", "fp32")
# A Compose stage: absent, query-side matrices only, or both sides.
STAGES = ("", "q", "qk")
N_TOKENS = 197
SHARED_BUDGET = 160 * 1024          # what every variant must fit: an A100's block, with room
SMALL_SHARED_BUDGET = 99 * 1024     # on sm_86, 89, 120 (`triton_core.small_shared`): their block


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
    G: int = 1
    maxnreg: Optional[int] = None
    mask_heads: bool = False          # the mask differs between heads (a converted Swin's)
    TAIL: bool = False                # a half-height body for the last row block (`block_sizes`)

    @property
    def name(self) -> str:
        mask = (",mask/h" if self.mask_heads else ",mask") if self.mask else ""
        flags = f"pre={self.pre or '-'},post={self.post or '-'}{mask}"
        return (f"{SHORT[self.kernel]} sm{self.arch} H={self.H} D={self.D} {self.dtype} {flags} "
                f"BT={self.BT} BS={self.BS} G={self.G} w={self.num_warps} st={self.num_stages}")


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
        try:
            path = get_ptxas(arch).path
        except TypeError:                               # Triton 3.4, 3.5: one ptxas for every target
            path = get_ptxas().path if arch < 100 else None
    except Exception:  # noqa: BLE001
        return None
    return path if path and os.path.exists(path) else None


def known_archs(default: bool = True) -> List[int]:
    """The targets the installed Triton compiles for: 80 and 90, and 100 with a Blackwell ptxas;
    not ``default``: also 86, 89 and 120 (GPUs with 99 KiB of shared memory a block, their own
    candidates: `triton_core.block_sizes`; 120 with a Blackwell ptxas)."""
    return [a for a in ((80, 90, 100) if default else (80, 86, 89, 90, 100, 120)) if ptxas(a)]


def shared_budget(arch: int) -> int:
    """The shared memory a variant for sm_<arch> must fit: an A100's block (with room), or a
    whole block where a GPU gives 99 KiB."""
    from dcvit.kernels.triton_core import small_shared
    return SMALL_SHARED_BUDGET if small_shared(arch) else SHARED_BUDGET


def variants(heads: Iterable[int] = (3, 6, 12, 16), dims: Iterable[int] = (32, 64),
             dtypes: Iterable[str] = DTYPES, archs: Iterable[int] = (80, 90),
             masks: Iterable[bool] = (False, True), stages: Optional[Sequence] = None,
             kernels: Iterable[str] = KERNELS, mask_heads: Iterable[bool] = (False,)) -> List[Variant]:
    """Every combination, times every `block_sizes` candidate of its head count (the
    score-gradient map's products kernel, which no stage changes, once per target, heads,
    head dim and dtype). ``stages``: (pre, post) pairs from `STAGES`, default all nine;
    ``mask_heads``: a mask shared by every head (False, as ViT's and DCViT's masks are), one
    per head (True), or both."""
    from dcvit.kernels.triton_core import block_sizes
    stages = list(stages) if stages is not None else list(itertools.product(STAGES, STAGES))
    out, products = [], set()
    for kernel, arch, H, D, dtype, mask, by_head, (pre, post) in itertools.product(
            kernels, archs, heads, dims, dtypes, masks, mask_heads, stages):
        if by_head and not mask:
            continue
        candidates = block_sizes(H, kernel, arch, mask)
        if kernel == "score_grad_products_kernel" and candidates:   # the same whatever the stages: once
            if (arch, H, D, dtype) in products:
                continue
            products.add((arch, H, D, dtype))
        for c in candidates:
            out.append(Variant(kernel, arch, H, D, dtype, mask, pre, post, c["BT"], c["BS"], c["num_warps"],
                               c["num_stages"], c["G"], c.get("maxnreg"), by_head, c.get("TAIL", False)))
    return out


@contextlib.contextmanager
def _captured_launches(arch: int):
    """Run `triton_core` on CPU tensors with its launches recorded instead of run, as on a GPU
    of compute capability ``arch`` (not the interpreter's precision)."""
    from dcvit.kernels import triton_core
    seen: Dict[str, tuple] = {}
    saved = triton_core._launch, triton_core._launch_products, triton_core.interpreted, triton_core._arch
    triton_core._launch = lambda name, device, H, rows, block, B, args, kwargs: seen.__setitem__(name, (args, kwargs))
    triton_core._launch_products = lambda device, B, H, args, kwargs: seen.__setitem__(
        "score_grad_products_kernel", (args, kwargs))
    triton_core.interpreted = lambda: False
    triton_core._arch = lambda device: arch
    try:
        yield seen
    finally:
        triton_core._launch, triton_core._launch_products, triton_core.interpreted, triton_core._arch = saved


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
    mask = (torch.zeros(H, N, N) if v.mask_heads else torch.zeros(N, N)) if v.mask else None
    with _captured_launches(v.arch) as seen:
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


def _loops(ins: Sequence[tuple]) -> List[tuple]:
    """(first, last) addresses of each loop of a disassembly's ``(address, text)``
    instructions, in address order: a loop runs from a backward branch's target to the
    branch (the kernels nest no loops)."""
    spans = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr))
    return sorted(spans)


def _sass_figures(sass: str) -> Dict:
    """Static instruction counts of one kernel's machine code (``cuobjdump -sass``): all of
    them (``sass``), those inside its loops (``sass_loop``), each loop's (``loops``, in
    address order; 16 bytes an instruction), the warp shuffles inside them
    (``loop_shuffles``: values moved between lanes, by a reduction or a layout change), and
    per body a program may run (``bodies``, `_bodies`) its instructions and loops."""
    ins = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = _loops(ins)
    loops = [(last - first) // 16 + 1 for first, last in spans]
    shuffles = sum(1 for a, text in ins if re.search(r"\bSHFL\b", text) and any(f <= a <= l for f, l in spans))
    return dict(sass=len(ins), sass_loop=sum(loops), loops=loops, loop_shuffles=shuffles, bodies=_bodies(ins, spans))


def _bodies(ins: Sequence[tuple], spans: Sequence[tuple]) -> List[Dict]:
    """What a program runs of a kernel's ``(address, text)`` instructions: the whole code
    (``sass``) and loops, or where the kernel has two bodies (`triton_attention`'s TAIL: its
    first instructions branch to the second, the first ends in an ``EXIT`` between the two
    halves of its loops), each body with those first instructions, and its own loops."""
    whole = [dict(sass=len(ins), loops=[(last - first) // 16 + 1 for first, last in spans])]
    half = len(spans) // 2
    if not half or len(spans) % 2:
        return whole
    ends = [a for a, text in ins if spans[half - 1][1] < a < spans[half][0] and text.strip() == "EXIT"]
    second = min((a for a, _ in ins if ends and a > ends[0]), default=None)
    entry = [a for a, text in ins if second is not None and a < spans[0][0]
             and re.search(rf"\bBRA\b.*?0x0*{second:x}\b", text)]
    if not entry:
        return whole
    first_part = sum(1 for a, _ in ins if a <= ends[0])
    second_part = sum(1 for a, _ in ins if a <= entry[0] or a >= second)
    return [dict(sass=first_part, loops=whole[0]["loops"][:half]),
            dict(sass=second_part, loops=whole[0]["loops"][half:])]


def _specialize(backend, arg):
    """(kind, specialization) of a launch argument as the running Triton's launcher computes
    it: its native function from 3.6, the Python one before."""
    try:
        from triton._C.libtriton import native_specialize_impl
    except ImportError:
        from triton.runtime.jit import create_specialize_impl
        return create_specialize_impl(backend.get_arg_specialization)(arg, False, True, True)
    return native_specialize_impl(backend, arg, False, True, True)


def _error_line(e: BaseException) -> str:
    """The innermost cause of a compile error, its last line that says something (Triton's
    CompilationError wraps the failing call's own, under a source excerpt and a caret)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip(" ^~\t")]
    return f"{type(e).__name__}: {lines[-1][:200] if lines else ''}"


def _compile(v: Variant):
    """``v`` compiled by the installed Triton for its target (its launch's specialisation)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from dcvit.kernels import triton_attention, triton_core
    fn = getattr(triton_attention, v.kernel)
    args, kwargs = launch_arguments(v)
    kwargs = dict(kwargs, BT=v.BT, BS=v.BS, G=v.G, **({"TAIL": v.TAIL} if "TAIL" in fn.arg_names else {}))
    signature, constexprs, attrs = {}, {}, {}
    for i, arg_name in enumerate(fn.arg_names):
        if arg_name in kwargs:                          # a compile-time argument
            signature[arg_name] = "constexpr"
            constexprs[arg_name] = kwargs[arg_name]
            continue
        kind, spec = _specialize(CUDABackend, args[i])
        signature[arg_name] = kind
        if kind == "constexpr":
            constexprs[arg_name] = spec
        elif spec:
            attrs[(i,)] = CUDABackend.parse_attr(spec)
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": v.num_warps, "num_stages": v.num_stages, "maxnreg": v.maxnreg,
               **triton_core.COMPILE_OPTIONS}
    return triton.compile(src, target=GPUTarget("cuda", v.arch, 32), options=options)


def _assemble(v: Variant, ptx: str, tmp: str, *flags: str) -> tuple:
    """(ptxas's log, the cubin's path) of ``ptx`` assembled for v's target in ``tmp``."""
    path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
    with open(path, "w") as f:
        f.write(ptx)
    gpu = f"sm_{v.arch}a" if v.arch >= 90 else f"sm_{v.arch}"
    log = subprocess.run([ptxas(v.arch), *flags, f"--gpu-name={gpu}", path, "-o", cubin],
                         capture_output=True, text=True, check=True).stderr
    return log, cubin


def _tool(arch: int, name: str) -> Optional[str]:
    """A CUDA binary utility shipped next to Triton's ptxas (cuobjdump, nvdisasm), or None."""
    path = os.path.join(os.path.dirname(ptxas(arch) or ""), name)
    return path if os.path.exists(path) else None


def compile_variant(v: Variant) -> Dict:
    """Compile ``v`` for its target and measure it: a row of the report (``error`` set when
    Triton or ptxas rejects it)."""
    row = dict(dataclasses.asdict(v), name=v.name)
    try:
        compiled = _compile(v)
        ptx = compiled.asm["ptx"]
        with tempfile.TemporaryDirectory() as tmp:
            log, cubin = _assemble(v, ptx, tmp, "-v")
            objdump = _tool(v.arch, "cuobjdump")
            if objdump:
                row.update(_sass_figures(subprocess.run([objdump, "-sass", cubin], capture_output=True,
                                                        text=True, check=True).stdout))
    except Exception as e:  # noqa: BLE001  (out of resources, compiler errors: a figure too)
        row["error"] = _error_line(e)
        return row
    row.update(_ptxas_figures(log))
    row["shared"] = int(compiled.metadata.shared) + row.pop("static_smem")
    row["tensor_core"] = len(re.findall(r"^\s*(?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)\b", ptx, re.M))
    row["fma_f32"] = len(re.findall(r"^\s*fma\.rn(?:\.ftz)?\.f32\b", ptx, re.M))
    return row


def loop_lines(v: Variant) -> List[Dict]:
    """Where ``v``'s loop instructions come from: per source line of the kernels (the
    innermost one ptxas's line table names), its instructions inside the loops over whole
    blocks (a block's visit of each pass; not the last, partial block's loops) and the most
    frequent opcodes, most first. The "measure why" of an issue time (nvdisasm's line info)."""
    with tempfile.TemporaryDirectory() as tmp:
        _, cubin = _assemble(v, _compile(v).asm["ptx"], tmp, "-lineinfo")
        sass = subprocess.run([_tool(v.arch, "nvdisasm"), "--print-line-info", "-c", cubin],
                              capture_output=True, text=True, check=True).stdout
    where, labels, pending, ins = None, {}, [], []
    for line in sass.splitlines():
        if m := re.search(r'//## File "([^"]+)", line (\d+)', line):
            where = (os.path.basename(m.group(1)), int(m.group(2)))
        elif m := re.match(r"\s*(\.L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);", line):
            addr = int(m.group(1), 16)
            labels.update({lab: addr for lab in pending})
            pending = []
            ins.append((addr, m.group(2).strip(), where))
    spans = sorted((labels[m.group(1)], addr) for addr, text, _ in ins
                   if (m := re.search(r"\bBRA\b.*?\((\.L_x_\d+)\)", text)) and labels.get(m.group(1), addr) < addr)
    spans = spans[1::2]                                                 # (last block, whole blocks) pairs
    passes = 1 if v.kernel == "backward_key_kernel" else 2
    if len(spans) == 2 * passes:                                        # two bodies (TAIL): the full one's
        spans = max(spans[:passes], spans[passes:], key=lambda ss: sum(b - a for a, b in ss))
    counts: Dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    for addr, text, src in ins:
        if any(a <= addr <= b for a, b in spans):
            counts[src][re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]] += 1
    rows = [dict(file=src[0] if src else "?", line=src[1] if src else 0, instructions=sum(c.values()),
                 ops=dict(c.most_common(4))) for src, c in counts.items()]
    return sorted(rows, key=lambda r: -r["instructions"])


def measure(vs: Sequence[Variant], jobs: int = 2) -> List[Dict]:
    """`compile_variant` over ``vs`` in a pool of ``jobs`` processes, in order, with a
    progress bar on stderr when it is a terminal (a whole set takes half an hour)."""
    if (jobs <= 1 or len(vs) <= 1) and not os.environ.get("TRITON_INTERPRET"):
        return list(_progress(map(compile_variant, vs), len(vs)))
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")          # no inherited torch/triton threads
    with _compiling(), concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        return list(_progress(pool.map(compile_variant, vs), len(vs)))


def _progress(rows: Iterable[Dict], total: int) -> Iterable[Dict]:
    """``rows`` under a tqdm bar (none where stderr is no terminal, or tqdm is missing: a
    bare GPU image, scripts/gpu_check.sh)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return rows
    return tqdm(rows, total=total, desc="compiling", unit="variant", file=sys.stderr, disable=None,
                leave=False)


@contextlib.contextmanager
def _compiling():
    """The pool's processes compile for a GPU even where their parent runs Triton's
    interpreter (the test session sets TRITON_INTERPRET=1): they start without it, before
    anything imports Triton in them (importing this module imports `dcvit`, and Triton)."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def problems(rows: Sequence[Dict]) -> List[str]:
    """One line per variant that does not compile, spills or needs more than `shared_budget`."""
    out = []
    for r in rows:
        if "error" in r:
            out.append(f"{r['name']}: {r['error']}")
        elif r["spill_stores"] or r["spill_loads"]:
            out.append(f"{r['name']}: spills {r['spill_stores']} B stored, {r['spill_loads']} B loaded")
        elif r["shared"] > shared_budget(r["arch"]):
            out.append(f"{r['name']}: {r['shared'] / 1024:.0f} KiB of shared memory")
    return out


def table(rows: Sequence[Dict]) -> str:
    """One line per variant."""
    head = (f"{'variant':<84} {'regs':>4} {'spill st':>8} {'spill ld':>8} {'smem KiB':>8} {'mma':>5} {'fma':>6} "
            f"{'sass':>6} {'in loops':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:<84} error: {r['error']}")
        else:
            lines.append(f"{r['name']:<84} {r['registers']:>4} {r['spill_stores']:>8} {r['spill_loads']:>8} "
                         f"{r['shared'] / 1024:>8.1f} {r['tensor_core']:>5} {r['fma_f32']:>6} "
                         f"{r.get('sass', '-'):>6} {r.get('sass_loop', '-'):>8}")
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


# ------------------------------------------------------------------ expected speed

# H100 SXM published peaks: dense bf16 tensor cores, TF32 tensor cores (half of bf16), fp32
# CUDA cores (an FMA counted as 2 FLOPs: 132 SMs x 128 lanes x 1.98 GHz x 2), the special
# function unit's exp (16 per SM per clock, 1/8 of the FMA lanes) and HBM3 bandwidth; and
# the instruction issue: 132 SMs of 4 schedulers, each issuing one warp instruction a clock.
H100 = dict(name="H100 SXM", bf16=989e12, tf32=494.5e12, fp32=67e12, exp=67e12 / 16, hbm=3.35e12,
            sms=132, schedulers=4, clock=1.98e9)
MODELS = {"S/16": ("dcvit_small_patch16_224", "vit_small_patch16_224"),
          "B/16": ("dcvit_base_patch16_224", "vit_base_patch16_224")}


def partial_step(kernel: str, block: int) -> int:
    """The tokens a step of a pass's last, partial loop takes: a whole block, but at most
    `triton_attention.EDGE_BLOCK` keys in the forward (its 32-key blocks leave their last keys
    in steps of 16)."""
    from dcvit.kernels.triton_attention import EDGE_BLOCK
    return min(block, EDGE_BLOCK.value) if kernel == "forward_kernel" else block


def kernel_work(kernel: str, B: int, H: int, N: int, D: int, half: int = 2) -> Dict[str, float]:
    """Work of one launch of ``kernel`` over B sequences of N tokens (every stage, both matrix
    sides, no mask, every matrix gradient wanted), counted from its loops with the blocks and
    head groups of the first `block_sizes` candidate and the padded head count (and rows: a
    tensor-core product pads 8 rows to 16, which one side of each Compose stage has when a
    block is 8 rows, but for 16 output heads, `triton_attention._mix`; the forward's last keys
    in steps of `EDGE_BLOCK`; the last query block by the rows of its body, `last_rows`):
    tensor-core FLOPs in the
    operands' dtype (``bf16``: q·kᵀ, p·v and their gradients) and in TF32 (``tf32``: Compose's
    head mixing and the matrix gradients), CUDA-core FLOPs (``fp32``: the element-wise steps,
    one per operation) and exponentials (``exp``), and the bytes each tensor costs in HBM read
    once (re-reads of k, v and the matrices across a sequence's blocks are L2 hits: one
    sequence's working set is under 1 MB). A product side that the running Triton's
    `tl.dot` takes only padded (`dot_min`: the head mixing's 8-head contraction under
    3.4-3.7, 8-head rows and columns under 3.4) counts twice, as it is computed. A head
    mixing padded in its contraction runs on bf16 operands for 2-byte ones
    (`triton_attention._mm`): its FLOPs count as ``bf16``, and casting its operands (per
    stage the tile, whose cast the compiled kernels share between the two sides, and each
    side's matrices; 0.5 operation per element: a cvt packs two) as ``fp32``."""
    from dcvit.kernels.triton_core import block_sizes, dot_min, matrix_side, score_grad_map, score_grad_map_row
    from dcvit.kernels.triton_core import _padded_heads
    c = block_sizes(H, kernel, 90)[0]
    grad_map = score_grad_map(H)                        # dq, dk left to the map's products (`grad_map_work`)
    hp, dp = _padded_heads(H), max(16, 1 << (D - 1).bit_length())
    edge = partial_step(kernel, c["BS"])                # key blocks visited, the partial ones by their width
    nt, ns = -(-N // c["BT"]), N // c["BS"] + -(-(N % c["BS"]) // edge) * edge / c["BS"]
    if kernel != "backward_key_kernel":                 # the last query block, by the rows of its body
        nt += last_rows(c.get("TAIL", False), c["BT"], N) / c["BT"] - 1
    tile = c["BT"] * c["BS"] * hp                       # (rows, cols, heads) elements
    pairs = B * nt * ns                                 # (query block, key block) visits
    qk = 2 * tile * dp                                  # one q·kᵀ (or do·vᵀ, p·v, ds·k, ...)
    mix = 2 * tile * hp                                 # one side of a Compose stage, or a dM
    pad = 16 // min(c["BT"], c["BS"], 16)               # a block of 8 rows: the side of a stage batched
    if hp // c["G"] >= 16 and c["G"] == 1:              # over the others has 8 product rows, padded to 16,
        pad = 1                                         # unless taken transposed (16 output heads, `_mix`)
    compose = mix + pad * mix
    m, n, k = dot_min(32, 90)
    heads_out = 2 if hp // c["G"] < max(m, n) else 1    # a product's columns: the output heads
    compose *= (2 if hp < k else 1) * heads_out         # Compose: (cols, heads) @ (heads, heads)
    mix_bf16 = hp < k and half == 2                     # padded in K: bf16 operands, cast per stage:
    casts = tile + (c["BT"] + c["BS"]) * hp * hp        # the tile (both sides share its cast, as
                                                        # compiled) and both sides' matrices
    dm = mix * (2 if hp < max(m, n) else 1) * heads_out # dM: (heads, cols) @ (cols, heads)
    if kernel == "forward_kernel":
        bf16 = 2 * qk + qk                              # q·kᵀ in both passes, p·v
        stages, grads = 3, 0                            # pre-compose in both passes, post
        ops = (1 + 1 + 1 + 2) + (1 + 1 + 1) + 2 * 1 + 1 # scale, where, max, l update; scale, where, sub; compose adds; cast
        exps = 2
    elif kernel == "backward_query_kernel":
        bf16 = 2 * (qk + qk) + (0 if grad_map else qk)  # q·kᵀ, do·vᵀ in both passes; ds·k (or ds stored)
        one_sided = hp <= 8 and c["G"] == 1             # pass 1's post T by its key side alone (delta's
        stages = 5 - (1 / (1 + pad) if one_sided else 0)  # query side by dMq2, `DELTA_BY_DMQ2`): pre both
        grads = 2                                       # passes, post T both, pre T; dMq1, dMq2
        ops = 2 * (1 + 1 + 1) + 2 + 3 + (5 - one_sided) + 1   # scale, where, sub x2; delta; ds; compose adds; cast
        exps = 2
    else:                                               # G programs per key block, each for HP/G heads:
        g = c["G"]                                      # the scores and both stages for all heads in each
        own = 1 if grad_map else 2                      # p2ᵀ·do, dsᵀ·q for its heads (dk: a product outside)
        bf16 = g * 2 * qk + own * qk                    # k·qᵀ, v·doᵀ in each
        stages, grads = g * 2 + own, 2                  # pre, post T in each; post, pre T, dMk1, dMk2 for its heads
        ops = g * (1 + 1 + 1 + 1 + 2 + 2) + 2 * own     # scale, where, sub, where, ds, 2 compose adds; adds, casts
        exps = g
    if mix_bf16:
        bf16, tf32, cast_ops = bf16 + stages * compose, grads * dm, stages * casts / 2
    else:
        tf32, cast_ops = stages * compose + grads * dm, 0
    tok = B * N * H                                     # (token, head) pairs
    side = matrix_side(H, 90)                           # the matrices' rows, as the kernels read them
    # tensors read and written once: (B, N, H, D) in the operands' dtype, (B, H, N) float32
    # statistics, (B, N, side, side) float32 matrices (4 read; matrix gradients written)
    reads, writes = {"forward_kernel": ((3, 0, 4), (1, 1, 0)),
                     "backward_query_kernel": ((4, 1, 4), (0 if grad_map else 1, 1, 2)),
                     "backward_key_kernel": ((4, 2, 4), (1 if grad_map else 2, 0, 2))}[kernel]
    sizes = (tok * D * half, tok * 4, B * N * side * side * 4)
    nbytes = sum(n * size for n, size in zip(reads + writes, 2 * sizes))
    if grad_map and kernel == "backward_query_kernel":
        nbytes += B * H * N * score_grad_map_row(N) * half   # the score-gradient map written, rows padded
    return dict(bf16=pairs * bf16, tf32=pairs * tf32, fp32=pairs * (tile * ops + cast_ops), exp=pairs * tile * exps,
                bytes=nbytes)


def grad_map_work(B: int, H: int, N: int, D: int, half: int = 2) -> Dict[str, float]:
    """dq = scale · ds k and dk = scale · dsᵀ q from the score-gradient map
    (`triton_core.score_grad_map`): their FLOPs on bf16 tensor cores, q and k read and dq
    and dk written once, and the map read once by `score_grad_products_kernel` where N ≤
    `triton_core.PRODUCTS_MAX_KEYS`, else by each of two batched products (cuBLAS); its rows
    as they are laid out (`triton_core.score_grad_map_row`: the padding's sectors are read)."""
    from dcvit.kernels.triton_core import PRODUCTS_MAX_KEYS, score_grad_map_row
    reads = 1 if N <= PRODUCTS_MAX_KEYS else 2
    return dict(bf16=2 * 2 * B * H * N * N * D, tf32=0, fp32=0, exp=0,
                bytes=reads * B * H * N * score_grad_map_row(N) * half + 4 * B * N * H * D * half)


def padding_work(B: int, H: int, N: int, matrices: int = 4) -> Dict[str, float]:
    """The four Compose matrices copied zero-padded to HP×HP per token
    (`triton_core.pads_matrices`), once a layer, before the forward (`kernel_matrices`:
    autograd keeps the padded ones for the backward): each read (H×H float32) and written
    (HP×HP) once."""
    from dcvit.kernels.triton_core import _padded_heads
    return dict(bf16=0, tf32=0, fp32=0, exp=0, bytes=matrices * 4 * B * N * (H * H + _padded_heads(H) ** 2))


def warp_instructions(row: Dict, B: int, N: int) -> float:
    """The warp instructions one launch of a compiled variant (a `compile_variant` row with
    its machine code counted) issues over B sequences of N tokens: per program its code
    outside the loops once and its loops' once per block they visit, times its warps;
    programs per (row block, head group, sequence) as `triton_core` launches them. Without
    a mask (the variants estimated) each pass over the other axis is two loops
    (`triton_attention`): the last, partial block's, visited once per `partial_step` where N
    leaves one, then the whole blocks', visited N // block times. A kernel with two bodies
    (``bodies``, `_bodies`) runs its smaller one in the last program where `last_rows` says
    so, the other everywhere else."""
    if row["kernel"] == "score_grad_products_kernel":  # a program per (head, sequence), one loop over
        per_program = row["sass"] - row["sass_loop"] + -(-N // row["BT"]) * sum(row["loops"])   # query blocks
        return float(B * row["H"] * row["num_warps"] * per_program)
    nt, ns = -(-N // row["BT"]), -(-N // row["BS"])
    blocks, step = (ns, row["BT"]) if row["kernel"] == "backward_key_kernel" else (nt, row["BS"])
    passes = 1 if row["kernel"] == "backward_key_kernel" else 2
    bodies = sorted(row.get("bodies") or [dict(sass=row["sass"], loops=row["loops"])], key=lambda b: sum(b["loops"]))
    if any(len(b["loops"]) != 2 * passes for b in bodies):
        raise ValueError(f"{row['kernel']}: {len(row['loops'])} loops in its machine code, expected "
                         f"{2 * passes} (the last block, then the whole ones, per pass) per body")
    visits = [-(-(N % step) // partial_step(row["kernel"], step)), N // step] * passes
    per_program = [b["sass"] - sum(b["loops"]) + sum(v * n for v, n in zip(visits, b["loops"])) for b in bodies]
    half = len(bodies) == 2 and last_rows(row.get("TAIL", False), row["BT"], N) < row["BT"]
    total = (blocks - half) * per_program[-1] + half * per_program[0]   # the last program's body: the smaller
    return float(B * row["G"] * row["num_warps"] * total)


def last_rows(tail: bool, block: int, N: int) -> int:
    """The rows of the body that the last program runs over N tokens in blocks of ``block``:
    half of them where the kernel has a half-height body (``tail``: its `block_sizes`
    candidate's TAIL) and that block holds at most half, else all."""
    return block // 2 if tail and 0 < N % block <= block // 2 else block


def roofline_ms(work: Dict[str, float], gpu: Dict = H100) -> Dict[str, float]:
    """Milliseconds per unit at the published peaks, and, where the compiled code was
    counted (``warp_instructions``), at the schedulers' issue rate; the estimate is the
    slowest unit (the units overlap at best: a lower bound of the kernel's time)."""
    t = dict(tensor=1e3 * (work["bf16"] / gpu["bf16"] + work["tf32"] / gpu["tf32"]),
             cuda=1e3 * (work["fp32"] / (gpu["fp32"] / 2) + work["exp"] / gpu["exp"]),
             memory=1e3 * work["bytes"] / gpu["hbm"])
    if work.get("warp_instructions"):
        t["issue"] = 1e3 * work["warp_instructions"] / (gpu["sms"] * gpu["schedulers"] * gpu["clock"])
    t["estimate"] = max(t.values())
    return t


def sdpa_work(B: int, H: int, N: int, D: int) -> Dict[str, Dict[str, float]]:
    """FlashAttention's forward and backward (recomputing q·kᵀ): 2 and 5 products of
    2·N²·D FLOPs per head, one exp per score each, q, k, v (o, do, dq, dk, dv) in bf16."""
    mm = 2 * B * H * N * N * D
    tok = B * H * N * D * 2
    return {"forward": dict(bf16=2 * mm, tf32=0, fp32=4 * B * H * N * N, exp=B * H * N * N, bytes=4 * tok),
            "backward": dict(bf16=5 * mm, tf32=0, fp32=6 * B * H * N * N, exp=B * H * N * N, bytes=8 * tok)}


def _mix_ops(stage: str, backward: bool) -> List[tuple]:
    """One Compose stage's kernels under Inductor (see `compile_core_work`)."""
    if not backward:
        return [(f"{stage} query side", 1, 1, 0, 1), (f"{stage} key side, permuted copy", 1, 1, 0, 0),
                (f"{stage} key side", 1, 1, 0, 1), (f"{stage} permuted add", 2, 1, 0, 0)]
    return [(f"{stage}ᵀ query side", 1, 1, 0, 1), (f"{stage} query matrices' gradient", 2, 0, 0, 1),
            (f"{stage}ᵀ key side, permuted copy", 1, 1, 0, 0), (f"{stage}ᵀ key side", 1, 1, 0, 1),
            (f"{stage} key matrices' gradient", 2, 0, 0, 1), (f"{stage}ᵀ permuted add", 2, 1, 0, 0)]


def compile_core_work(B: int, H: int, N: int, D: int) -> Dict[str, Dict[str, float]]:
    """The ``compile`` core's forward and backward (every stage with both matrix sides, no
    mask) by the same model as the kernels: each Inductor kernel or cuBLAS product reads and
    writes whole (B, H, N, N) bf16 maps in HBM (a map is 2·B·H·N² bytes; q, k, v and the
    matrices are small beside them), its products on bf16 tensor cores. Per direction:
    ``ops`` (name, maps read, maps written, q·kᵀ-sized products, one-side mixings), and the
    summed work; `compile_core_ms` takes each kernel's slowest unit and adds them (kernels
    run one after another)."""
    fwd = [("q·kᵀ", 0, 1, 1, 0), *_mix_ops("pre-compose", False), ("softmax", 1, 1, 0, 0),
           *_mix_ops("post-compose", False), ("p·v", 1, 0, 1, 0)]
    bwd = [("dO·vᵀ, pᵀ·dO", 1, 1, 2, 0), *_mix_ops("post-compose", True), ("softmax backward", 2, 1, 0, 0),
           *_mix_ops("pre-compose", True), ("ds·k, dsᵀ·q", 2, 0, 2, 0)]
    qk, mix, nmap = 2 * B * H * N * N * D, 2 * B * N * N * H * H, 2 * B * H * N * N
    out = {}
    for name, ops in (("forward", fwd), ("backward", bwd)):
        per_op = [dict(op=o, bf16=n_qk * qk + n_mix * mix, tf32=0, fp32=0, exp=N * N * B * H if o == "softmax" else 0,
                       bytes=(r + w) * nmap) for o, r, w, n_qk, n_mix in ops]
        out[name] = dict(ops=per_op, **{k: sum(op[k] for op in per_op) for k in ("bf16", "tf32", "fp32", "exp", "bytes")})
    return out


def compile_core_ms(work: Dict, gpu: Dict = H100) -> float:
    """Milliseconds of one direction of `compile_core_work`: each kernel's slowest unit at the
    published peaks, added."""
    return sum(max(roofline_ms(op, gpu)[u] for u in ("tensor", "cuda", "memory")) for op in work["ops"])


def _compiled_production(shapes: Sequence[tuple], jobs: int) -> tuple:
    """Each kernel compiled for sm_90 as DCViT trains with it (bf16, no mask, both stages with
    both sides, the first `block_sizes` candidate) at each (heads, head dim): ({(kernel, H):
    row}, None), or ({}, why not) where it cannot be compiled and counted here."""
    if triton_module() is None or ptxas(90) is None:
        return {}, "no Triton with a ptxas for sm_90 here"
    if not _tool(90, "cuobjdump"):
        return {}, "no cuobjdump next to Triton's ptxas"
    from dcvit.kernels.triton_core import block_sizes
    vs = [Variant(k, 90, H, D, "bf16", False, "qk", "qk", **block_sizes(H, k, 90)[0])
          for H, D in shapes for k in KERNELS if block_sizes(H, k, 90)]
    rows = measure(vs, jobs)
    bad = [r["name"] for r in rows if "sass" not in r]
    if bad:
        return {}, f"{bad[0]} did not compile"
    return {(r["kernel"], r["H"]): r for r in rows}, None


def estimate(batch: int = 256, jobs: int = 2, issue: bool = True) -> Dict:
    """Per model: each kernel's work and roofline time for one layer, with its issue time
    where the running Triton compiles it for sm_90 here (`warp_instructions`), the layers'
    total, and the training-step ratio DCViT / ViT (SDPA) when the dense layers (same in
    both, plus DCViT's dynamic-weight projections) run at the same tensor-core peak; also
    the ratio without the issue times (``train_ratio_roofline``). ``issue=False``: no
    compilation, the work alone."""
    import timm
    import dcvit  # noqa: F401  (registers the DCViT models)
    from dcvit.accounting import analytic_macs
    from dcvit.kernels.triton_core import PRODUCTS_MAX_KEYS, pads_matrices, score_grad_map
    tri = triton_module()
    nets = {label: (timm.create_model(dc_name), timm.create_model(vit_name))
            for label, (dc_name, vit_name) in MODELS.items()}
    shapes = {label: (dc.blocks[0].attn.num_heads, dc.embed_dim // dc.blocks[0].attn.num_heads)
              for label, (dc, _) in nets.items()}
    compiled, not_counted = (_compiled_production(sorted(set(shapes.values())), jobs) if issue
                             else ({}, "not asked for (--no-issue)"))
    out = {"gpu": H100, "batch": batch, "models": {},
           "triton": tri.__version__ if tri else None,       # its tl.dot sizes decide the padding counted
           "issue_counted": not_counted is None, "issue_not_counted": not_counted}
    for label, (dc, vit) in nets.items():
        (H, D), (dc_name, vit_name) = shapes[label], MODELS[label]
        N, depth = dc.patch_embed.num_patches + dc.num_prefix_tokens, len(dc.blocks)
        kernels = {}
        for k in ATTENTION_KERNELS:
            w = kernels[SHORT[k]] = dict(kernel_work(k, batch, H, N, D))
            if compiled:
                w["warp_instructions"] = warp_instructions(compiled[(k, H)], batch, N)
                w["registers"] = compiled[(k, H)]["registers"]
            w.update(roofline_ms(w))
        products = None                                 # cuBLAS's code (N > 256) is not Triton's to count
        if score_grad_map(H):
            products = grad_map_work(batch, H, N, D)
            if ("score_grad_products_kernel", H) in compiled and N <= PRODUCTS_MAX_KEYS:
                products["warp_instructions"] = warp_instructions(compiled[("score_grad_products_kernel", H)],
                                                                  batch, N)
            products.update(roofline_ms(products))
        padding = None                                  # in each direction, memory-bound
        if pads_matrices(H, 90):
            padding = padding_work(batch, H, N)
            padding.update(roofline_ms(padding))
        extra = (products["estimate"] if products else 0.0) + (padding["estimate"] if padding else 0.0)
        sdpa = sdpa_work(batch, H, N, D)
        for w in sdpa.values():
            w.update(roofline_ms(w))
        other = compile_core_work(batch, H, N, D)
        for w in other.values():
            w.update(roofline_ms(w))
            w["estimate"] = compile_core_ms(w)              # its kernels one after another
        dense = ("patch_embed", "qkv", "proj", "mlp", "head", "dynamic_weights")
        macs_dc, macs_vit = analytic_macs(dc, batch), analytic_macs(vit, batch)
        # training: forward + backward (twice the forward's products), 2 FLOPs per MAC
        dense_ms = {name: 1e3 * 3 * 2 * sum(m[k] for k in dense) / H100["bf16"]
                    for name, m in (("dcvit", macs_dc), ("vit", macs_vit))}
        core_dc = depth * (sum(w["estimate"] for w in kernels.values()) + extra)
        roof_dc = depth * (sum(max(w["tensor"], w["cuda"], w["memory"]) for w in kernels.values()) + extra)
        core_vit = depth * sum(w["estimate"] for w in sdpa.values())
        core_other = depth * sum(w["estimate"] for w in other.values())
        step_dc, step_vit = dense_ms["dcvit"] + core_dc, dense_ms["vit"] + core_vit
        out["models"][label] = dict(
            dcvit=dc_name, vit=vit_name, heads=H, head_dim=D, tokens=N, depth=depth,
            kernels=kernels, products=products, padding=padding, sdpa=sdpa, compile_core=other,
            dense_ms=dense_ms,
            core_ms=dict(dcvit=core_dc, vit=core_vit, compile=core_other),
            step_ms=dict(dcvit=step_dc, vit=step_vit, compile=dense_ms["dcvit"] + core_other),
            train_ratio=step_vit / step_dc, train_ratio_compile=step_vit / (dense_ms["dcvit"] + core_other),
            lower_estimate="triton" if core_dc <= core_other else "compile",
            train_ratio_roofline=step_vit / (dense_ms["dcvit"] + roof_dc))
    return out


def estimate_table(est: Dict) -> str:
    """The markdown of docs/performance.md's "Triton core on an H100: expected speed"."""
    g = est["gpu"]
    lines = [f"{g['name']}: {g['bf16'] / 1e12:.0f} TFLOP/s bf16 tensor, {g['tf32'] / 1e12:.0f} TF32, "
             f"{g['fp32'] / 1e12:.0f} fp32 (FMA = 2), {g['exp'] / 1e12:.1f} T exp/s, "
             f"{g['hbm'] / 1e12:.2f} TB/s; batch {est['batch']}, bf16, one layer; "
             f"kernels as Triton {est.get('triton')} compiles them; issue: {g['sms']} SMs x "
             f"{g['schedulers']} schedulers x {g['clock'] / 1e9:.2f} GHz, one warp instruction a clock"
             + ("" if est.get("issue_counted") else f" (not counted: {est.get('issue_not_counted')})"), "",
             "| model | kernel | bf16 TC GFLOP | TF32 TC GFLOP | CUDA-core GFLOP | exp G | MB | G warp instr | "
             "tensor ms | CUDA-core ms | memory ms | issue ms | estimate ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, m in est["models"].items():
        rows = (list(m["kernels"].items()) + ([("dq, dk products", m["products"])] if m.get("products") else [])
                + ([("matrices padded (forward)", m["padding"])] if m.get("padding") else [])
                + [(f"SDPA {k}", w) for k, w in m["sdpa"].items()]
                + [(f"`compile` core {k}", w) for k, w in m["compile_core"].items()])
        for name, w in rows:
            wi, issue = w.get("warp_instructions"), w.get("issue")
            lines.append(f"| {label} (H={m['heads']}) | {name} | {w['bf16'] / 1e9:.1f} | {w['tf32'] / 1e9:.1f} | "
                         f"{w['fp32'] / 1e9:.1f} | {w['exp'] / 1e9:.2f} | {w['bytes'] / 1e6:.0f} | "
                         f"{'-' if wi is None else f'{wi / 1e9:.2f}'} | {w['tensor']:.3f} | {w['cuda']:.3f} | "
                         f"{w['memory']:.3f} | {'-' if issue is None else f'{issue:.3f}'} | {w['estimate']:.3f} |")
    lines += ["", "| model | layers | dense layers, train step ms (DCViT / ViT) | attention cores ms "
              "(DCViT / SDPA) | step ms (DCViT / ViT) | training ratio ViT/DCViT | without the issue times | "
              "`compile` core: cores ms / ratio |",
              "|---|---|---|---|---|---|---|---|"]
    for label, m in est["models"].items():
        lines.append(f"| {label} | {m['depth']} | {m['dense_ms']['dcvit']:.1f} / {m['dense_ms']['vit']:.1f} | "
                     f"{m['core_ms']['dcvit']:.1f} / {m['core_ms']['vit']:.1f} | "
                     f"{m['step_ms']['dcvit']:.1f} / {m['step_ms']['vit']:.1f} | {m['train_ratio']:.2f} | "
                     f"{m['train_ratio_roofline']:.2f} | {m['core_ms']['compile']:.1f} / "
                     f"{m['train_ratio_compile']:.2f} |")
    return "\n".join(lines)


def _padding_ms(model: Dict) -> float:
    """The matrices' padded copy (`padding_work`, before the forward), or 0."""
    return model["padding"]["estimate"] if model.get("padding") else 0.0


def forward_estimate(model: Dict) -> float:
    """One layer's forward in ms as `estimate` gives it: the kernel and, where the matrices
    are padded, their copy."""
    return model["kernels"]["fwd"]["estimate"] + _padding_ms(model)


def backward_estimate(model: Dict) -> float:
    """One layer's backward in ms as `estimate` gives it: the two kernels and, where the
    score-gradient map is used, the products that give dq and dk (the matrices come padded
    from the forward)."""
    k, products = model["kernels"], model.get("products")
    return k["bwd_q"]["estimate"] + k["bwd_k"]["estimate"] + (products["estimate"] if products else 0.0)


def measure_on_gpu(est: Dict, steps: int = 20) -> Dict:
    """On CUDA: each model's layer-shaped core timed (forward launch, backward's launches, with
    the score-gradient map's products where it is used, and SDPA forward/backward on the
    same q, k, v), in ms, next to the estimates."""
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench
    from dcvit.kernels import triton_core
    out = {}
    for label, m in est["models"].items():
        B, H, N, D = est["batch"], m["heads"], m["tokens"], m["head_dim"]
        g = torch.Generator(device="cuda").manual_seed(0)
        qkv = torch.randn(B, N, 3, H, D, device="cuda", dtype=torch.bfloat16, generator=g).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        mats = [torch.eye(H, device="cuda") + 0.1 * torch.randn(B, N, H, H, device="cuda", generator=g)
                for _ in range(4)]
        scale = D ** -0.5
        o, lse = triton_core.attention_forward(q, k, v, None, *mats, scale)
        do = torch.randn_like(o)
        fwd = do_bench(lambda: triton_core.attention_forward(q, k, v, None, *mats, scale), rep=steps * 10)
        bwd = do_bench(lambda: triton_core.attention_backward(do, q, k, v, None, *mats, lse, scale), rep=steps * 10)
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        y = F.scaled_dot_product_attention(qs, ks, vs)
        gy = torch.randn_like(y)
        s_fwd = do_bench(lambda: F.scaled_dot_product_attention(q, k, v), rep=steps * 10)
        s_all = do_bench(lambda: torch.autograd.grad(F.scaled_dot_product_attention(qs, ks, vs), (qs, ks, vs), gy),
                         rep=steps * 10)
        ker = m["kernels"]
        out[label] = {"forward": dict(estimate=forward_estimate(m), measured=fwd),
                      "backward": dict(estimate=backward_estimate(m), measured=bwd),
                      "sdpa_forward": dict(estimate=m["sdpa"]["forward"]["estimate"], measured=s_fwd),
                      "sdpa_backward": dict(estimate=m["sdpa"]["backward"]["estimate"], measured=s_all - s_fwd),
                      "train_ratio_estimate": m["train_ratio"]}
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, nargs="+", default=[3, 6, 12, 16])
    p.add_argument("--dims", type=int, nargs="+", default=[32, 64])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--targets", nargs="+", default=None, metavar="smXX",
                   help="sm80 sm86 sm89 sm90 sm100 sm120 (default: sm80 sm90, and sm100 where the installed "
                        "Triton knows it)")
    p.add_argument("--kernels", nargs="+", default=list(SHORT.values()), choices=list(SHORT.values()))
    p.add_argument("--mask", choices=["both", "yes", "no", "heads", "all"], default="both",
                   help="with and without a mask shared by all heads (both), only with (yes) or without (no); "
                        "a mask per head only (heads), or none, shared and per head (all)")
    p.add_argument("--quick", action="store_true",
                   help="D=64, bf16, sm80+sm90, a mask, pre+post with both sides")
    p.add_argument("--production", action="store_true",
                   help="the variants DCViT trains with: D=64, bf16, pre+post with both sides, no mask")
    p.add_argument("--check", action="store_true",
                   help="exit with status 1 when a variant fails to compile, spills or needs over 160 KiB "
                        "(99 KiB for sm86, sm89, sm120)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--estimate", action="store_true",
                   help="print the expected H100 times of DCViT-S/16 and B/16 instead (compiles 6 variants)")
    p.add_argument("--no-issue", action="store_true",
                   help="with --estimate: the work alone, without compiling the kernels for their issue slots")
    p.add_argument("--measure", action="store_true",
                   help="with --estimate on a CUDA machine: time the kernels and SDPA next to the estimates")
    p.add_argument("--lines", action="store_true",
                   help="per variant (e.g. --production --heads 6 --kernels fwd --targets sm90): the source "
                        "lines its loop instructions come from")
    a = p.parse_args(argv)
    if a.estimate:
        est = estimate(jobs=a.jobs, issue=not a.no_issue)
        print(estimate_table(est))
        if a.measure:
            est["measured"] = measure_on_gpu(est)
            print(f"\n{'model':<6} {'':<14} {'estimate ms':>11} {'measured ms':>11}")
            for label, rows in est["measured"].items():
                for name, r in rows.items():
                    if isinstance(r, dict):
                        print(f"{label:<6} {name:<14} {r['estimate']:>11.3f} {r['measured']:>11.3f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(est, f, indent=1)
        return 0
    if triton_module() is None:
        print("error: triton is not installed (pip install triton)", file=sys.stderr)
        return 2
    archs = known_archs(default=not a.targets)
    if not archs:
        print("error: Triton's ptxas was not found (its wheel bundles one; or set TRITON_PTXAS_PATH)",
              file=sys.stderr)
        return 2
    if a.targets:
        try:
            want = [int(t.lower().removeprefix("sm_").removeprefix("sm")) for t in a.targets]
        except ValueError:
            print(f"error: --targets takes sm80 sm86 sm89 sm90 sm100 sm120, got {a.targets}", file=sys.stderr)
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
    masks = {"both": (False, True), "yes": (True,), "no": (False,), "heads": (True,), "all": (False, True)}[a.mask]
    by_head = {"heads": (True,), "all": (False, True)}.get(a.mask, (False,))
    if a.quick or a.production:
        vs = variants(a.heads, (64,), ("bf16",), archs if a.targets else [x for x in archs if x in (80, 90)],
                      (not a.production,), [("qk", "qk")], kernels, (False,) if a.production else by_head)
    else:
        vs = variants(a.heads, a.dims, a.dtypes, archs, masks, None, kernels, by_head)
    if a.lines:
        from dcvit.kernels import triton_attention
        with open(triton_attention.__file__) as f:
            source = f.read().splitlines()
        for v in vs:
            rows = loop_lines(v)
            print(f"\n{v.name}: {sum(r['instructions'] for r in rows)} instructions in its loops")
            for r in rows[:12]:
                text = source[r["line"] - 1].strip() if r["file"] == "triton_attention.py" else r["file"]
                print(f"{r['instructions']:6d}  {r['line']:4d}  {text[:64]:<64}  {r['ops']}")
        return 0
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
    bad = problems(rows)
    print(f"\nTriton {triton_module().__version__}: {len(rows) - len(bad)} of {len(rows)} variants compile, "
          f"spill nothing and fit {SHARED_BUDGET // 1024} KiB (sm_86, sm_89, sm_120: {SMALL_SHARED_BUDGET // 1024})")
    for line in bad:
        print(f"  {line}")
    return 1 if a.check and bad else 0


def _ptxas_version(arch: int) -> str:
    out = subprocess.run([ptxas(arch), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release ([\d.]+)", out)
    return f"CUDA {m.group(1)}" if m else "version unknown"


if __name__ == "__main__":
    sys.exit(main())
