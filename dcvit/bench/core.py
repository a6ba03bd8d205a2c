"""Time DCMHA's attention core alone, robust to a busy machine: one thread,
``time.process_time``, the minimum over many repeats (`dcvit.bench.timing.time_steps`).

q, k, v are views of one (B, N, 3, H, D) projection (as in the layer), both Compose stages
have query- and key-wise matrices; the core runs through its custom op,
``dcvit::composed_attention``; ``--impl sdpa`` times plain attention on the same views
(``torch.nn.functional.scaled_dot_product_attention``, what timm's ViT runs) for comparison.
Usage::

    python -m dcvit.bench.core [--impl cpp|sdpa] [--threads 1] [--repeats 15] [-B 16] [-N 197] [--heads 6] [-D 64]
"""
import argparse
import json
import time

import torch

import dcvit.fused  # noqa: F401  (registers the dcvit:: custom ops)

from .timing import time_steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="cpp", help="the core: cpp, or sdpa (plain attention)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("-B", type=int, default=16)
    p.add_argument("-N", type=int, default=197)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("-D", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    B, N, H, D = args.B, args.N, args.heads, args.D
    qkv = torch.randn(B, N, 3, H, D, generator=g).requires_grad_()
    eye = torch.eye(H)
    mats = [(torch.randn(B, N, H, H, generator=g) * 0.1 + (eye if i % 2 == 0 else 0)).requires_grad_()
            for i in range(4)]                                          # mq1, mk1, mq2, mk2
    up = torch.randn(B, N, H, D, generator=g)

    def forward():
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)                  # (B, H, N, D) views
        if args.impl == "sdpa":
            return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        out, _ = torch.ops.dcvit.composed_attention(q, k, v, None, *mats, args.impl, D ** -0.5)
        return out                                                      # (output, statistics)

    def forward_backward():
        torch.autograd.grad(forward(), [qkv] + ([] if args.impl == "sdpa" else mats), up)

    def best(fn) -> float:
        times = time_steps(fn, torch.device("cpu"), warmup=2, steps=args.repeats, clock=time.process_time)
        return round(min(times) * 1e3, 2)

    with torch.no_grad():
        fwd = best(forward)
    print(json.dumps({"impl": args.impl, "shape": dict(B=B, N=N, H=H, D=D), "threads": args.threads,
                      "forward_ms": fwd, "forward_backward_ms": best(forward_backward)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
