"""The epoch loop: `train_one_epoch` and `evaluate` (DeiT's engine.py, on timm's parts)."""
import math
import resource
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
from timm.utils import dispatch_clip_grad

from .checkpoint import restore_rng
from .data import DataPipe
from .metrics import EvalMetrics

__all__ = ["NonFiniteLoss", "StepOptions", "train_one_epoch", "evaluate", "autocast",
           "peak_memory_mb"]


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or inf; the run stops without saving over good state."""


@dataclass
class StepOptions:
    accum_steps: int = 1
    clip_grad: Optional[float] = None
    clip_mode: str = "norm"
    amp: str = "none"
    nan_at_update: int = 0          # fault injection: the loss of this update becomes NaN
    progress: bool = False          # tqdm bar (rank 0)
    log_every: int = 50


def autocast(device: torch.device, amp: str):
    """bf16 autocast on CPU or GPU, fp16 on GPU, or nothing."""
    if amp == "none":
        return nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train_one_epoch(model: torch.nn.Module, pipe: DataPipe, epoch: int, *,
                    optimizer: torch.optim.Optimizer, scheduler: Any, loss_fn: Callable,
                    device: torch.device, opts: StepOptions, update: int,
                    start_batch: int = 0, rng_state: Optional[Dict[str, Any]] = None,
                    mixup: Optional[Callable] = None, ema: Optional[Any] = None,
                    scaler: Optional[torch.amp.GradScaler] = None,
                    on_update: Optional[Callable[[int, int], None]] = None) -> Dict[str, float]:
    """Runs batches `start_batch..` of `epoch`; `model` may be DDP-wrapped.

    `update` counts optimizer updates before this call. After each update,
    `on_update(batch_done, update)` runs (checkpointing). A resumed epoch skips its first
    `start_batch` batches (the data order is a function of the seed and epoch) and then
    restores `rng_state`, so it continues exactly where the interrupted run stopped.
    """
    model.train()
    accum = opts.accum_steps
    world = dist.get_world_size() if dist.is_initialized() else 1
    total = pipe.batches_per_epoch
    bar = None
    if opts.progress:
        from tqdm import tqdm
        bar = tqdm(total=total, initial=start_batch, desc=f"epoch {epoch}", dynamic_ncols=True,
                   mininterval=1.0)
    if start_batch == 0 and rng_state is not None:
        restore_rng(rng_state)
    loss_sum, loss_n, samples, skipped = 0.0, 0, 0, 0
    pending = torch.zeros((), device=device)   # the loss of the update being accumulated
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    for i, (x, y, n_skipped) in enumerate(pipe.loader(epoch)):
        if i >= total:
            break
        if i < start_batch:
            if i == start_batch - 1 and rng_state is not None:
                restore_rng(rng_state)
            continue
        skipped += int(n_skipped)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if mixup is not None:
            x, y = mixup(x, y)
        last_micro = (i + 1) % accum == 0
        sync = last_micro or not isinstance(model, torch.nn.parallel.DistributedDataParallel)
        with (nullcontext() if sync else model.no_sync()):
            with autocast(device, opts.amp):
                out = model(x)                                           # (B, num_classes)
                loss = loss_fn(out, y)
            if opts.nan_at_update and update + 1 == opts.nan_at_update:
                loss = loss * float("nan")
            scaled = loss / accum
            if scaler is not None:
                scaler.scale(scaled).backward()
            else:
                scaled.backward()
        pending += scaled.detach()
        samples += x.shape[0] * world
        if not last_micro:
            continue
        if dist.is_initialized():  # every rank sees the same value, so all stop together
            dist.all_reduce(pending)
            pending /= world
        value = float(pending)
        pending.zero_()
        if not math.isfinite(value):
            raise NonFiniteLoss(f"loss is {value} at epoch {epoch}, batch {i}, update {update + 1}; "
                                f"stopping without saving. Lower optim.lr, enable optim.clip_grad, "
                                f"or use amp=bf16 instead of fp16")
        if scaler is not None:
            if opts.clip_grad:
                scaler.unscale_(optimizer)
                dispatch_clip_grad(model.parameters(), opts.clip_grad, mode=opts.clip_mode)
            scaler.step(optimizer)
            scaler.update()
        else:
            if opts.clip_grad:
                dispatch_clip_grad(model.parameters(), opts.clip_grad, mode=opts.clip_mode)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update += 1
        scheduler.step_update(update)
        if ema is not None:
            ema.update(getattr(model, "module", model), step=update)
        loss_sum += value
        loss_n += 1
        if bar is not None:
            bar.update(accum)
            if update % opts.log_every == 0 or i + 1 == total:
                bar.set_postfix(loss=f"{value:.4f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
        if on_update is not None:
            on_update(i + 1, update)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t0
    return {"train_loss": loss_sum / max(loss_n, 1), "lr": optimizer.param_groups[0]["lr"],
            "img_per_s": samples / elapsed if elapsed > 0 else 0.0, "epoch_time_s": elapsed,
            "updates": update, "corrupt_skipped": skipped}


@torch.no_grad()
def evaluate(model: torch.nn.Module, pipe: DataPipe, num_classes: int, device: torch.device,
             amp: str = "none") -> Dict[str, float]:
    """Top-1/top-5 (percent), mean loss and sample count over every rank's share of `pipe`."""
    model.eval()
    metrics = EvalMetrics(num_classes, device)
    for x, y, _ in pipe.loader(0):
        if y.numel() == 0:
            continue
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, amp):
            out = model(x)                                               # (B, num_classes)
        metrics.update(out, y)
    return metrics.compute()
