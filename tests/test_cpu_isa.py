"""The C++ kernels' instruction-set builds (``dcvit.kernels.compose_cpu``): which one is chosen,
how ``$DCVIT_CPU_ISA`` forces one, and that each build the CPU can run computes the attention
core of docs/spec.md §1.1 as the same formula evaluated in float64.

Also: the kernels' head limit has one source, and the cache keeps the current build of
each variant, removing other sources' builds only when they are stale.

The build this machine picks runs in-process (default tier); every other build the CPU
supports (AVX2 and generic on an AVX-512 machine) is built and checked in a subprocess of
its own (slow tier: about 45 s of compiler time each, once per machine and source), since a
process registers the ``dcvit_cpu`` operators once.
"""
import os
import subprocess
import sys
import time

import pytest
import torch

from dcvit.kernels import compose_cpu

AVX512 = ["fpu", "avx", "avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl"]


@pytest.mark.parametrize("flags, expected", [
    (AVX512, "avx512"),
    (["avx", "avx2", "fma", "avx512f"], "avx2"),          # AVX-512 foundation alone is not enough
    (["avx", "avx2", "fma"], "avx2"),
    (["avx", "avx2"], "generic"),                         # no FMA
    ([], "generic"),
])
def test_best_isa_from_cpu_flags(monkeypatch, flags, expected):
    monkeypatch.delenv(compose_cpu.ISA_ENV, raising=False)
    assert compose_cpu.isa(flags) == expected


def test_isa_forced_by_environment(monkeypatch):
    monkeypatch.setenv(compose_cpu.ISA_ENV, "avx2")
    assert compose_cpu.isa(AVX512) == "avx2"
    monkeypatch.setenv(compose_cpu.ISA_ENV, "generic")
    assert compose_cpu.isa(AVX512) == "generic"


def test_bad_isa_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(compose_cpu.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match=r"DCVIT_CPU_ISA='sse9'.*avx512, avx2, generic"):
        compose_cpu.isa(AVX512)
    monkeypatch.setenv(compose_cpu.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match=r"lacks avx512bw, avx512dq, avx512f, avx512vl.*avx2, generic"):
        compose_cpu.isa(["avx2", "fma"])
    monkeypatch.setenv(compose_cpu.ISA_ENV, "sse9")
    monkeypatch.setattr(compose_cpu, "_state", {})
    with pytest.raises(ValueError, match="DCVIT_CPU_ISA='sse9'"):  # load raises it, not a warning
        compose_cpu.load()


def test_each_isa_has_its_own_library(monkeypatch):
    names = {}
    for name in compose_cpu.ISAS:
        monkeypatch.setattr(compose_cpu, "isa", lambda name=name: name)
        names[name] = compose_cpu._library_name(True)
    assert len(set(names.values())) == len(names)
    assert "_avx512_" in names["avx512"] and "_avx2_" in names["avx2"]
    assert "avx" not in names["generic"]


def test_max_heads_has_one_source(monkeypatch):
    """The kernels are built with the Python side's MAX_HEADS (a define, part of the build's
    name): the loaded operators take that many heads and refuse one more themselves."""
    assert compose_cpu.load(), "the C++ kernels did not build"
    H = compose_cpu.MAX_HEADS
    for heads in (H, H + 1):
        q = torch.randn(1, heads, 3, 2)
        mq = torch.eye(heads).expand(1, 3, heads, heads)
        if heads == H:
            out = torch.ops.dcvit_cpu.attention_forward(q, q, q, None, mq, None, None, None, 1.0)
            torch.testing.assert_close(out.transpose(1, 2), torch.softmax(q @ q.transpose(-1, -2), -1) @ q)
        else:
            with pytest.raises(RuntimeError, match=f"at most {H} heads, got {H + 1}"):
                torch.ops.dcvit_cpu.attention_forward(q, q, q, None, mq, None, None, None, 1.0)
    name = compose_cpu._library_name(True)
    monkeypatch.setattr(compose_cpu, "MAX_HEADS", H // 2)
    assert f"-DDCVIT_MAX_HEADS={H // 2}" in compose_cpu._defines()
    assert compose_cpu._library_name(True) != name


def _build(cache, name, days_unused=None, days_unread=30):
    """A fake build directory ``name`` in ``cache``, its stamp dated ``days_unused`` ago (None:
    no stamp, as a build from before stamps), its library last read ``days_unread`` ago."""
    path = cache / name
    path.mkdir(mode=0o700)
    library = path / (name + ".so")
    library.write_bytes(b"")
    past = time.time() - days_unread * 86400
    os.utime(library, (past, past))
    if days_unused is not None:
        stamp = path / compose_cpu.USED
        stamp.touch()
        past = time.time() - days_unused * 86400
        os.utime(stamp, (past, past))
    return path


def test_prune_removes_only_stale_builds_of_other_sources(monkeypatch, tmp_path):
    """Builds of the current variant from other sources go once unused for STALE_DAYS; the
    current build, recent ones (another install used in turn; one without stamps whose
    library was read), one held by a process, other instruction sets and threading
    variants, other users' and non-builds stay; what a stopped prune renamed away goes."""
    import fcntl
    monkeypatch.setenv("DCVIT_KERNEL_CACHE", str(tmp_path))
    days = compose_cpu.STALE_DAYS
    current = _build(tmp_path, "dcvit_cpu_omp_avx512_" + "a" * 10, days + 30)
    stale = _build(tmp_path, "dcvit_cpu_omp_avx512_" + "b" * 10, days + 1)
    recent = _build(tmp_path, "dcvit_cpu_omp_avx512_" + "c" * 10, days - 1)
    read = _build(tmp_path, "dcvit_cpu_omp_avx512_" + "0" * 10, days + 1, days_unread=1)   # by an old version
    unstamped = _build(tmp_path, "dcvit_cpu_omp_avx512_" + "d" * 10)
    held = _build(tmp_path, "dcvit_cpu_omp_avx512_" + "e" * 10, days + 1)
    foreign = _build(tmp_path, "dcvit_cpu_omp_avx512_" + "f" * 10, days + 1)
    leftover = _build(tmp_path, "dcvit_cpu_omp_avx512_" + "9" * 10 + ".removing-123", 0)
    kept = [current, recent, read, unstamped, held, foreign,
            _build(tmp_path, "dcvit_cpu_omp_avx2_" + "b" * 10, days + 1),
            _build(tmp_path, "dcvit_cpu_threads_avx512_" + "b" * 10, days + 1),
            _build(tmp_path, "dcvit_cpu_omp_" + "b" * 10, days + 1),
            _build(tmp_path, "dcvit_cpu_omp_avx512_notes", days + 1)]
    owner = compose_cpu._owner
    monkeypatch.setattr(compose_cpu, "_owner", lambda p: os.getuid() + 1 if p == str(foreign) else owner(p))
    with open(held / compose_cpu.USED) as f:
        fcntl.flock(f, fcntl.LOCK_SH)                   # as a process that loads it holds it
        assert compose_cpu._prune(current.name) == [str(stale)]
    assert not stale.exists() and not leftover.exists() and all(p.is_dir() for p in kept)
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in kept)
    assert (unstamped / compose_cpu.USED).exists()     # its unused days count from now
    assert compose_cpu._prune(current.name) == [str(held)]   # released, it goes too


def test_loading_dates_the_stamp_and_prunes(monkeypatch, tmp_path):
    """`load` holds its build while building and loading it, dates its stamp, then removes
    stale builds of other sources (the compiler is replaced: nothing is built here)."""
    from torch.utils import cpp_extension
    monkeypatch.setenv("DCVIT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(compose_cpu, "_state", {})
    monkeypatch.setattr(compose_cpu, "_shares_torch_openmp", lambda: False)
    name = compose_cpu._library_name(False)
    current = _build(tmp_path, name, compose_cpu.STALE_DAYS + 1)
    stale = _build(tmp_path, name[:-10] + "0" * 10, compose_cpu.STALE_DAYS + 1)
    held = []

    def fake_load(build_directory, **kwargs):
        import fcntl
        with open(os.path.join(build_directory, compose_cpu.USED)) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(True)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert compose_cpu.load() is True
    assert held == [True] and not stale.exists()
    assert time.time() - os.stat(current / compose_cpu.USED).st_mtime < 60


def _reference(q, k, v, mask, mats, scale):
    """The core in float64 as docs/spec.md §1.1 writes it: (B, T, H, D)."""
    mq1, mk1, mq2, mk2 = mats

    def compose(a, mq, mk):     # out[b, h, t, s] = sum_g a[b, g, t, s] (mq[b, t, g, h] + mk[b, s, g, h])
        return torch.einsum("bgts,btgh->bhts", a, mq) + torch.einsum("bgts,bsgh->bhts", a, mk)

    a = compose(scale * q @ k.transpose(-1, -2), mq1, mk1)
    p = torch.softmax(a + mask, dim=-1)
    return (compose(p, mq2, mk2) @ v).transpose(1, 2)


def _check_kernels():
    """The loaded kernels against `_reference`: output and every gradient, float32 within
    1e-4 of the largest reference value and float64 within 1e-10, for a head count compiled
    in (6) and one read at run time (5), lengths and head dims off the vector widths."""
    assert compose_cpu.load(), "the C++ kernels did not build"
    g = torch.Generator().manual_seed(0)
    for H, T, S, D in [(6, 37, 41, 40), (5, 19, 19, 24)]:
        B = 2
        q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (T, S, S))
        eye = torch.eye(H, dtype=torch.float64)
        mats = [torch.randn(B, n, H, H, generator=g, dtype=torch.float64) * 0.3 + (eye if i % 2 == 0 else 0)
                for i, n in enumerate((T, S, T, S))]
        mask = torch.randn(B, 1, T, S, generator=g, dtype=torch.float64)
        up = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
        inputs = [t.clone().requires_grad_() for t in (q, k, v, *mats)]
        ref = _reference(*inputs[:3], mask, inputs[3:], D ** -0.5)
        ref_grads = torch.autograd.grad(ref, inputs, up)
        for dtype, tol in ((torch.float32, 1e-4), (torch.float64, 1e-10)):
            c = [t.to(dtype) for t in (q, k, v, mask, *mats)]
            out = torch.ops.dcvit_cpu.attention_forward(*c, D ** -0.5)
            grads = torch.ops.dcvit_cpu.attention_backward(up.to(dtype).transpose(1, 2), *c, D ** -0.5,
                                                           [True] * 4)
            for name, got, want in [("out", out, ref)] + list(zip(
                    ["dq", "dk", "dv", "dmq1", "dmk1", "dmq2", "dmk2"], grads, ref_grads)):
                err = (got.double() - want).abs().max().item() / want.abs().max().item()
                assert err < tol, f"{compose_cpu.isa()} {dtype} H={H}: {name} off by {err:.2e}"


def test_kernels_of_this_machine_match_float64():
    _check_kernels()


def _supported_isas():
    have = compose_cpu._cpuinfo_flags()
    return [name for name, (needs, _) in compose_cpu.ISAS.items() if set(needs) <= set(have)]


@pytest.mark.slow
@pytest.mark.parametrize("name", _supported_isas())
def test_every_isa_build_matches_float64(name):
    env = dict(os.environ, **{compose_cpu.ISA_ENV: name})
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert f"checked {name}" in r.stdout


if __name__ == "__main__":
    _check_kernels()
    print("checked", compose_cpu.isa())
