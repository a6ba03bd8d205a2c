"""The training loop's own cost: `train_imagenet.engine.train_one_epoch` against a bare loop.

Both run the same model, optimizer and in-memory batches (no data loading, no checkpoints),
alternately, after warm-up; the overhead is ``loop_time / bare_time - 1`` per update. It is
what the loop adds per step (host-device syncs, reductions, logging), which on a GPU shows
up as idle time between kernels. The loop runs as under SLURM or redirected torchrun logs:
a loss check and a step line every ``--log-every`` updates. Writes ``--json`` and prints one line.

    python scripts/loop_overhead.py --device cuda --model dcvit_small_patch16_224 \\
        --batch-size 256 --amp bf16 --steps 50 --json loop_overhead.json
"""
import argparse
import json
import statistics
import sys
import time
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F


class _MemoryPipe:
    """The two things `train_one_epoch` asks of its data pipe, over fixed device tensors."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batches: int) -> None:
        self.x, self.y, self.batches_per_epoch = x, y, batches

    def loader(self, epoch: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor, int]]:
        for _ in range(self.batches_per_epoch):
            yield self.x, self.y, 0


class _NoSchedule:
    def step_update(self, update: int) -> None:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="dcvit_small_patch16_224")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--depth", type=int, default=0, help="override the depth (smoke runs)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--amp", default="bf16", choices=["none", "bf16", "fp16"])
    p.add_argument("--steps", type=int, default=50, help="updates per timed epoch")
    p.add_argument("--repeats", type=int, default=3, help="timed epochs of each (median)")
    p.add_argument("--log-every", type=int, default=10,
                   help="the loop's loss check and step line (to stderr) every N updates")
    p.add_argument("--json", default="loop_overhead.json")
    args = p.parse_args(argv)

    import timm
    import dcvit  # noqa: F401  (registers the DCViT models)
    from timm.utils import NativeScaler
    from train_imagenet.engine import EpochState, Loop, autocast, train_one_epoch

    device = torch.device(args.device)
    kwargs: Dict[str, Any] = dict(img_size=args.img_size)
    if args.depth:
        kwargs["depth"] = args.depth
    torch.manual_seed(0)
    model = timm.create_model(args.model, **kwargs).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.05)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)
    pipe = _MemoryPipe(x, y, args.steps)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    parts = Loop(model, opt, _NoSchedule(), F.cross_entropy, device,
                 scaler=NativeScaler(device.type) if args.amp == "fp16" else None, amp=args.amp,
                 log_every=args.log_every, step_lines=True)  # as without a terminal

    def loop() -> None:
        train_one_epoch(parts, pipe, EpochState(0, 0))

    def bare() -> None:
        model.train()
        for _ in range(args.steps):
            with autocast(device, args.amp):
                loss = F.cross_entropy(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)

    times: Dict[str, list] = {"loop": [], "bare": []}
    for i in range(args.repeats + 1):                                        # first round: warm-up
        order = (("loop", loop), ("bare", bare)) if i % 2 == 0 else (("bare", bare), ("loop", loop))
        for name, fn in order:
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if i:
                times[name].append(time.perf_counter() - t0)
    loop_s, bare_s = statistics.median(times["loop"]), statistics.median(times["bare"])
    result = {"model": args.model, "device": str(device), "batch_size": args.batch_size,
              "amp": args.amp, "steps": args.steps, "repeats": args.repeats, "log_every": args.log_every,
              "loop_ms_per_step": loop_s / args.steps * 1e3, "bare_ms_per_step": bare_s / args.steps * 1e3,
              "overhead": loop_s / bare_s - 1.0, "loop_times_s": times["loop"], "bare_times_s": times["bare"]}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"loop {result['loop_ms_per_step']:.2f} ms/step, bare {result['bare_ms_per_step']:.2f} ms/step: "
          f"overhead {100 * result['overhead']:+.1f} %")
    return result


if __name__ == "__main__":
    measure(sys.argv[1:])
