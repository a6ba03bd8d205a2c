"""The Triton core against the reference core in one DCMHA layer at DCViT-S/16 and B/16 shapes.

For each model a DCMHA layer of its width and head count (S/16: 384 wide, 6 heads; B/16:
768, 12; head dim 64) runs a forward and a backward three times: under bf16 autocast on the
Triton core (``dcvit.attention_impl("triton")``), under bf16 autocast on the
``reference`` core (the formula of docs/spec.md §1.1 in PyTorch ops), and in float64 on the
reference core. Per tensor (output, input gradient, every parameter's gradient) the error
is the largest difference from float64 relative to that tensor's largest value. The bf16
layer rounds its dense layers too, so the Triton core passes when its error is at most
`FACTOR` times the bf16 reference core's, or under `FLOOR`, in every tensor. One block size
per kernel (``DCVIT_TRITON_AUTOTUNE=0``): each model costs three compilations (forward,
query-side and key-side backward).

    python -m dcvit.bench.gpu_kernels --json kernels.json             # on CUDA: 197 tokens
    TRITON_INTERPRET=1 python -m dcvit.bench.gpu_kernels --tokens 5    # on CPU (interpreter)

Exit status 1 when a model fails or its Triton run raised.
"""
import argparse
import json
import os
import sys
import time
from typing import Dict, Optional, Sequence

import torch

SHAPES = {"S/16": (384, 6), "B/16": (768, 12)}   # width, heads (head dim 64)
FACTOR, FLOOR = 2.0, 1e-2


def _run(layer: torch.nn.Module, x: torch.Tensor, impl: str, dtype: Optional[torch.dtype]):
    """Output and gradients (input, then parameters) of one forward and backward."""
    from dcvit import attention_impl
    xi = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with attention_impl(impl), torch.autocast(x.device.type, dtype=dtype or torch.float32,
                                              enabled=dtype is not None):
        y = layer(xi)
    y.float().square().mean().backward()
    return [y.detach()] + [xi.grad] + [p.grad for p in layer.parameters()]


def check(label: str, device: torch.device, batch: int, tokens: int) -> Dict:
    """One model's layer: per tensor the Triton core's and the bf16 reference core's error,
    the tensor where the Triton core is worst against the reference core, and its first run's seconds."""
    import dcvit
    width, heads = SHAPES[label]
    torch.manual_seed(0)
    layer = dcvit.DCMHA(width, heads, qkv_bias=True).to(device)
    with torch.no_grad():                                    # dynamic weights large enough to matter
        for p in layer.core.dynamic_weights.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(batch, tokens, width, device=device)
    start = time.perf_counter()
    got = _run(layer, x, "triton", torch.bfloat16)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    plain = _run(layer, x, "reference", torch.bfloat16)
    want = _run(layer.double(), x.double(), "reference", None)
    names = ["output", "input grad"] + [f"grad {n}" for n, _ in layer.named_parameters()]
    errors, reference = {}, {}
    for name, a, r, b in zip(names, got, plain, want):
        if a is None or b is None:
            continue
        scale = b.abs().max().clamp_min(1e-12)
        errors[name] = ((a.double() - b).abs().max() / scale).item()
        reference[name] = ((r.double() - b).abs().max() / scale).item()
    ratio = {n: e / max(reference[n], FLOOR / FACTOR) for n, e in errors.items()}
    worst = max(ratio, key=ratio.get)
    return dict(width=width, heads=heads, head_dim=width // heads, batch=batch, tokens=tokens,
                dtype="bf16 autocast", errors=errors, reference_errors=reference, worst=worst,
                max_error=errors[worst], reference_error=reference[worst], factor=FACTOR, floor=FLOOR,
                passed=errors[worst] <= max(FACTOR * reference[worst], FLOOR), first_run_s=seconds)


def triton_on_cpu() -> None:
    """The Triton core registered for CPU tensors, where Triton runs its interpreter (the
    library registers it for CUDA only): for this step's dry run and for the tests
    (tests/conftest.py)."""
    from dcvit import fused
    from dcvit.kernels import triton_core
    if not triton_core.interpreted():
        raise RuntimeError("on CPU the Triton kernels run only in Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported")
    if ("cpu", "triton") not in fused._CORES:
        fused.register_core("cpu", "triton", *fused._CORES[("cuda", "triton")])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--tokens", type=int, default=197)
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    os.environ.setdefault("DCVIT_TRITON_AUTOTUNE", "0")
    device = torch.device(a.device)
    if device.type == "cpu":
        triton_on_cpu()
    result = {"device": str(device), "models": {}}
    for label in a.models:
        try:
            result["models"][label] = check(label, device, a.batch_size, a.tokens)
        except Exception as e:  # noqa: BLE001  (a compile error is a result: record it, go on)
            result["models"][label] = dict(passed=False, error=f"{type(e).__name__}: {str(e)[:500]}")
        r = result["models"][label]
        print(f"{label}: " + (f"error {r['max_error']:.2e} against the bf16 reference core's "
                              f"{r['reference_error']:.2e} ({r['worst']}), first run {r['first_run_s']:.1f} s"
                              if "error" not in r else r["error"])
              + f" -> {'pass' if r['passed'] else 'FAIL'}", flush=True)
    result["passed"] = all(r["passed"] for r in result["models"].values())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
