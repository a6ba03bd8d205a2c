"""The Triton attention kernels fit a GPU: no register spills, shared memory that launches.

Each kernel variant DCViT trains with (its head counts 3, 6, 12, 16 at head dim 64, bf16,
pre- and post-compose with both matrix sides and a mask: forward and both backward kernels,
every autotune candidate) is compiled ahead of time for sm_80 (A100) and sm_90 (H100) and
assembled by ``ptxas -v`` from Triton's wheel (`scripts/kernel_report.py`); no GPU needed.
A spill puts a loop's working set in local memory; a block over 160 KiB of shared memory
cannot launch on an A100 (164 KiB per block). Compiled once per session, in a pool of two
processes (Triton's cache makes later sessions quick).
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import kernel_report  # noqa: E402

if kernel_report.triton_module() is None:
    pytest.skip("triton is not installed: nothing to compile", allow_module_level=True)
if not all(kernel_report.ptxas(a) for a in (80, 90)):
    pytest.skip("Triton's ptxas is missing (its wheel bundles one; or set TRITON_PTXAS_PATH)",
                allow_module_level=True)

SHARED_LIMIT = 160 * 1024
HEADS = (3, 6, 12, 16)


@pytest.fixture(scope="module")
def rows():
    variants = kernel_report.variants(HEADS, (64,), ("bf16",), (80, 90), (True,), [("qk", "qk")])
    return kernel_report.measure(variants, jobs=2)


def test_every_variant_compiles(rows):
    assert len(rows) >= 2 * len(HEADS) * 3
    assert not [r["name"] for r in rows if "error" in r]


def test_no_variant_spills(rows):
    spilled = [f"{r['name']}: {r['spill_stores']} B stored, {r['spill_loads']} B loaded"
               for r in rows if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, "\n".join(spilled)


def test_shared_memory_launches_on_an_a100(rows):
    over = [f"{r['name']}: {r['shared'] / 1024:.0f} KiB" for r in rows if r["shared"] > SHARED_LIMIT]
    assert not over, "\n".join(over)


def test_products_run_on_tensor_cores(rows):
    """q·kᵀ, p·v and Compose's head mixing are tensor-core instructions, not fp32 FMAs."""
    assert all(r["tensor_core"] > 0 for r in rows)
