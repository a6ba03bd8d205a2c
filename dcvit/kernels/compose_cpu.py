"""DCMHA's C++ CPU kernels: built with ``torch.utils.cpp_extension`` on first use and
registered as torch operators in the namespace ``dcvit_cpu``.

The sources are ``dcvit/kernels/csrc/*.{h,cpp}`` (shipped with the package). `load` JIT-builds
them once per machine and source (``cpp_extension.load``, ninja, about a minute; a note goes
to stderr meanwhile) into a private cache directory, ``$DCVIT_KERNEL_CACHE`` (default
``~/.cache/dcvit``, one subdirectory per variant and source text), created mode
0700; a library file there that the user does not own is refused. Each load dates its
build's stamp file; a build of the same variant from other sources (another version or
checkout) that no process has loaded for `STALE_DAYS` days is then removed (`_prune`), so
that builds do not pile up while two installs used in turn keep theirs. Built with ``-fopenmp``
when torch runs on GNU OpenMP, so that ``libgomp.so.1`` resolves to torch's own copy and the
kernels run on torch's worker threads; with plain threads otherwise. When no compiler (or ninja) is found, or the build fails, `load` warns
once and returns False, and `dcvit.fused` picks its plain-PyTorch ``compile`` core. Set
``DCVIT_NO_CPP_KERNEL=1`` to skip it.

Built for the best instruction set the CPU has (`isa`, from /proc/cpuinfo's flags): ``avx512``
(64-byte vectors, a 12-row GEMM register tile for its 32 registers), ``avx2`` (32-byte
vectors, 6 rows) or ``generic``; each is its own cached library. ``DCVIT_CPU_ISA=avx2`` (or
``avx512``, ``generic``) forces one, e.g. to test or time the AVX2 build on an AVX-512
machine; a process loads one of them (the operators are registered once).

Operators (float32 and float64 CPU tensors; see ``csrc/compose_cpu.cpp``), each one call::

    dcvit_cpu::attention_forward(q, k, v, mask?, mq1?, mk1?, mq2?, mk2?, scale) -> out (B, T, H, D)
    dcvit_cpu::attention_backward(grad, q, k, v, mask?, mq1?, ..., scale, want) -> [dq, dk, dv, dmq1, dmk1, dmq2, dmk2]
    dcvit_cpu::slot_matrices(w, dd?, identity_slots, eps) -> m
    dcvit_cpu::slot_matrices_backward(w, dm, with_gate, eps) -> [dw, ddd]

(an empty tensor stands for an absent side's gradient, and for a matrix gradient that
``want``, four flags, says is not needed: it is not computed). They are the CPU kernels behind the
custom ops of `dcvit.fused` and `dcvit.matrices`, which own the autograd and fake-tensor
rules; a CUDA kernel plugs into those ops the same way (see `dcvit.fused.register_core`).

One "row" is (b, t): the scores of every head of one query against all S keys, an (H, S)
block that is composed, soft-maxed and composed again in vectors. Each Compose stage
applies, per key s, the H×H map ``out[h, s] = sum_g in[g, s] * (mq[b, t, g, h] + mk[b, s, g, h])``.
"""
import contextlib
import hashlib
import logging
import os
import re
import shutil
import stat
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ["load", "available", "isa", "ISAS", "MAX_HEADS"]

# The most heads the kernels take (`dcvit.fused` runs more on its 'compile' core): the one
# source of csrc/rows.h's kMaxHeads, which is built with -DDCVIT_MAX_HEADS=MAX_HEADS.
MAX_HEADS = 64

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")

_state: Dict[str, Any] = {}


# The instruction sets the kernels are built for, best first: the /proc/cpuinfo flags each
# needs and the compiler flags it is built with. "generic" is the compiler's baseline.
ISAS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "avx512": (("avx512f", "avx512dq", "avx512bw", "avx512vl", "avx2", "fma"),
               ("-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma",
                "-mprefer-vector-width=512")),
    "avx2": (("avx2", "fma"), ("-mavx2", "-mfma")),
    "generic": ((), ()),
}
ISA_ENV = "DCVIT_CPU_ISA"


def _cpuinfo_flags() -> List[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


def isa(cpu_flags: Optional[List[str]] = None) -> str:
    """The instruction set the kernels are built for: ``$DCVIT_CPU_ISA`` if set (``avx512``,
    ``avx2`` or ``generic``; one the CPU lacks is refused), else the best the CPU has."""
    have = set(_cpuinfo_flags() if cpu_flags is None else cpu_flags)
    supported = [name for name, (needs, _) in ISAS.items() if have.issuperset(needs)]
    forced = os.environ.get(ISA_ENV, "")
    if not forced:
        return supported[0]
    if forced not in ISAS:
        raise ValueError(f"{ISA_ENV}={forced!r} is not an instruction set of the kernels; "
                         f"use one of {', '.join(ISAS)} or unset it")
    if forced not in supported:
        missing = sorted(set(ISAS[forced][0]) - have)
        raise ValueError(f"{ISA_ENV}={forced!r}, but this CPU lacks {', '.join(missing)}; "
                         f"use one of {', '.join(supported)} or unset it")
    return forced


def _cpu_flags() -> List[str]:
    """Compiler flags of the selected instruction set (each set is built apart)."""
    return list(ISAS[isa()][1])


def _shares_torch_openmp() -> bool:
    """Whether torch runs on GNU OpenMP (libgomp.so.1 is loaded): a kernel built with -fopenmp
    then resolves libgomp.so.1 to that same copy and shares torch's thread pool."""
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:
        return False


def cache_dir() -> str:
    """Where the kernels are built: ``$DCVIT_KERNEL_CACHE`` or ``~/.cache/dcvit``."""
    return os.environ.get("DCVIT_KERNEL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dcvit"))


def _owner(path: str) -> int:
    return os.stat(path).st_uid


def _private_dir(path: str) -> str:
    """``path`` as a directory of this user's, mode 0700 (created so; tightened if it is ours);
    RuntimeError if another user owns it."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if _owner(path) != os.getuid():
        raise RuntimeError(f"kernel cache {path} belongs to another user (uid {_owner(path)}); "
                           "set DCVIT_KERNEL_CACHE to a directory of your own")
    if stat.S_IMODE(os.stat(path).st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def _check_owned(path: str) -> None:
    """Refuse a library file that the user does not own (it would run as this user's code)."""
    if os.path.exists(path) and _owner(path) != os.getuid():
        raise RuntimeError(f"refusing {path}: owned by uid {_owner(path)}, not by this user; "
                           "delete it or set DCVIT_KERNEL_CACHE to a directory of your own")


def _source_files() -> Dict[str, bytes]:
    return {f: Path(_CSRC, f).read_bytes() for f in sorted(os.listdir(_CSRC))
            if f.endswith((".h", ".cpp"))}


def _defines() -> List[str]:
    """The constants the Python side gives the sources (one source for both)."""
    return [f"-DDCVIT_MAX_HEADS={MAX_HEADS}"]


def _variant(openmp: bool) -> str:
    """The threading and vector-flag variant of a build: ``dcvit_cpu_omp_avx512``, ..."""
    tag = isa()
    return "dcvit_cpu_" + ("omp" if openmp else "threads") + ("" if tag == "generic" else "_" + tag)


def _library_name(openmp: bool) -> str:
    """One build (directory and library) per variant and per source text and defines:
    checkouts with the same sources share it."""
    text = hashlib.sha1(b"".join(n.encode() + b"\0" + d for n, d in _source_files().items())
                        + "\0".join(_defines()).encode())
    return _variant(openmp) + "_" + text.hexdigest()[:10]


def _sources_in(build_dir: str) -> str:
    """The sources copied into ``build_dir/src`` (written only when their text differs), so
    that ninja sees one stable path whichever checkout asks."""
    src = _private_dir(os.path.join(build_dir, "src"))
    for name, data in _source_files().items():
        path = os.path.join(src, name)
        if not os.path.exists(path) or Path(path).read_bytes() != data:
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
    return src


# A build's stamp file: a process that builds or loads the build holds a shared lock on it
# meanwhile and sets its modification time, so that `_prune` knows when it was last used.
USED = "used"
STALE_DAYS = 7     # another source's build of the same variant unused this long is removed


@contextlib.contextmanager
def _in_use(build_dir: str) -> Iterator[None]:
    """Hold ``build_dir`` while this process builds and loads it: a shared lock on its stamp,
    whose time is set to now (`_prune` waits for no one: it skips a build that is held)."""
    import fcntl
    try:
        stamp = open(os.path.join(_private_dir(build_dir), USED), "a")
    except FileNotFoundError:         # removed by a prune between the two calls: made again
        stamp = open(os.path.join(_private_dir(build_dir), USED), "a")
    with stamp:
        fcntl.flock(stamp, fcntl.LOCK_SH)
        os.utime(stamp.fileno())
        _private_dir(build_dir)       # (made again if a prune removed it before the lock)
        yield


def _last_used(build_dir: str, stamp: int) -> float:
    """When a build was last loaded: its stamp's time, or its library's last read (what a
    version without stamps leaves, where the file system records reads), whichever is later."""
    reads = [e.stat().st_atime for e in os.scandir(build_dir) if e.name.endswith(".so")]
    return max([os.fstat(stamp).st_mtime] + reads)


def _prune(keep: str) -> List[str]:
    """Remove the builds of ``keep``'s variant (threading and instruction set) made from other
    sources (another version or checkout) and not used for `STALE_DAYS` days; return them.

    Two installs used in turn on one machine keep both their builds (each load refreshes the
    stamp). Kept too: a build a process holds now (`_in_use`), other variants' builds, and
    whatever is not this user's or not a build. A build without a stamp gets one: its days
    count from then at the latest. Errors leave a build where it is; what a prune renamed
    away but did not finish removing goes with the next one."""
    import fcntl
    root = cache_dir()
    variant = keep.rsplit("_", 1)[0]
    removed = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        build = re.fullmatch(re.escape(variant) + r"_[0-9a-f]{10}(\.removing-[0-9]+)?", name)
        if (name == keep or not build or os.path.islink(path) or not os.path.isdir(path)
                or _owner(path) != os.getuid()):
            continue
        if build.group(1):                                 # left by a prune that stopped midway
            shutil.rmtree(path, ignore_errors=True)
            continue
        trash = f"{path}.removing-{os.getpid()}"
        try:
            with open(os.path.join(path, USED), "a") as stamp:
                try:
                    fcntl.flock(stamp, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:                    # being built or loaded now
                    continue
                if time.time() - _last_used(path, stamp.fileno()) < STALE_DAYS * 86400:
                    continue
                os.rename(path, trash)                     # gone for a loader that comes next
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(path)
        except OSError:
            continue
    return removed


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """cpp_extension runs ``ninja`` from PATH: add the ninja package's binary when PATH has none
    (a virtual environment that is not activated)."""
    old = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + old
        except ImportError:
            pass
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _build_and_load(openmp: bool) -> None:
    """Build (unless up to date) and load the library into the process (registers dcvit_cpu)."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)        # its import logs a CUDA_HOME guess, irrelevant here
    try:
        from torch.utils import cpp_extension
    finally:
        logger.setLevel(level)
    name = _library_name(openmp)
    build_dir = os.path.join(_private_dir(cache_dir()), name)
    cflags = (["-O3", "-fno-trapping-math", "-fopenmp" if openmp else "-fopenmp-simd", "-pthread"]
              + _cpu_flags() + _defines())
    with _in_use(build_dir), _ninja_on_path():
        library = os.path.join(build_dir, name + ".so")
        _check_owned(library)
        if not os.path.exists(library):
            sys.stderr.write(f"dcvit: building the C++ attention kernels into {build_dir} "
                             "(once per machine and source, about a minute)\n")
        src = _sources_in(build_dir)
        cpp_extension.load(name=name, sources=[os.path.join(src, "compose_cpu.cpp")], extra_include_paths=[src],
                           extra_cflags=cflags, extra_ldflags=["-fopenmp"] if openmp else ["-pthread"],
                           build_directory=build_dir, is_python_module=False, verbose=False)
    with contextlib.suppress(OSError):
        _prune(name)


def load() -> bool:
    """Whether the ``dcvit_cpu`` operators are loaded (built on first call), else False with
    one warning."""
    if "ok" in _state:
        return _state["ok"]
    ok = False
    if os.environ.get("DCVIT_NO_CPP_KERNEL", "") in ("", "0"):
        isa()                             # a bad $DCVIT_CPU_ISA is the user's error: raise it
        reason = ""
        for openmp in ([True, False] if _shares_torch_openmp() else [False]):
            try:
                _build_and_load(openmp)
                ok = True
                break
            except Exception as e:  # no compiler or ninja, read-only cache, no OpenMP, ...
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if not ok:
            warnings.warn(f"dcvit: the C++ attention kernel could not be built ({reason}); "
                          "using the plain-PyTorch 'compile' core instead", RuntimeWarning, stacklevel=2)
    _state["ok"] = ok
    return ok


@torch._dynamo.assume_constant_result
def available() -> bool:
    """Whether the operators load (inside torch.compile: evaluated once, while tracing)."""
    return load()
