"""The epoch loop: `train_one_epoch` and `evaluate` (DeiT's engine.py, on timm's parts)."""
import math
import resource
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from timm.utils import NativeScaler

from .checkpoint import CheckpointError, restore_rng
from .data import DataError, DataPipe
from .distributed import all_reduce_mean, waiting_for
from .metrics import EvalMetrics

__all__ = ["NonFiniteLoss", "StepOptions", "EpochTotals", "LossScaler", "train_one_epoch",
           "evaluate", "autocast", "peak_memory_mb"]


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or inf; the run stops without saving over good state."""


@dataclass
class StepOptions:
    accum_steps: int = 1
    clip_grad: Optional[float] = None
    clip_mode: str = "norm"
    amp: str = "none"
    nan_at_update: int = 0          # fault injection: the loss of this update becomes NaN
    progress: bool = False          # tqdm bar (rank 0, in a terminal)
    step_lines: bool = False        # a printed line every `log_every` updates (rank 0, no terminal)
    log_every: int = 50             # updates between loss checks (one sync, one all-reduce)
    save_every: int = 0             # updates between mid-epoch saves: the losses are checked first


@dataclass
class EpochTotals:
    """The running sums of an epoch's record, kept in its mid-epoch checkpoints so that a
    resumed epoch's record (train_loss, img/s, time, corrupt samples) is the whole epoch's."""
    loss_sum: float = 0.0           # the sum of the checked per-update losses (all-reduced)
    loss_n: int = 0                 # updates checked
    samples: int = 0                # samples trained, all ranks
    time_s: float = 0.0             # seconds spent training the epoch
    skipped: int = 0                # corrupt samples this rank skipped

    def to_saved(self, skipped_per_rank: List[int]) -> Dict[str, Any]:
        return {"loss_sum": self.loss_sum, "loss_n": self.loss_n, "samples": self.samples,
                "time_s": self.time_s, "skipped": skipped_per_rank}

    @classmethod
    def from_saved(cls, saved: Dict[str, Any], rank: int) -> "EpochTotals":
        skipped = saved.get("skipped") or []
        return cls(saved["loss_sum"], saved["loss_n"], saved["samples"], saved["time_s"],
                   skipped[rank] if rank < len(skipped) else 0)


class LossScaler(NativeScaler):
    """timm's NativeScaler (backward, then unscale, clip, step and update on the last
    micro-batch), with its GradScaler enabled only for fp16: disabled, it is a plain
    backward and optimizer step, so one code path serves every precision."""

    def __init__(self, enabled: bool, device: str = "cuda"):
        self._scaler = torch.amp.GradScaler(device if enabled else "cpu", enabled=enabled)


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
                    scaler: Optional["LossScaler"] = None, totals: Optional[EpochTotals] = None,
                    on_update: Optional[Callable[[int, int, EpochTotals], None]] = None
                    ) -> Dict[str, float]:
    """Runs batches `start_batch..` of `epoch`; `model` may be DDP-wrapped.

    `update` counts optimizer updates before this call. After each update,
    `on_update(batch_done, update, totals)` runs (checkpointing). A resumed epoch skips its
    first `start_batch` batches (the data order is a function of the seed and epoch), then
    restores `rng_state`, so it continues exactly where the interrupted run stopped, and adds
    to the epoch's `totals` of the batches before. A call that runs no update is an error.

    The losses stay on the device: every `opts.log_every` updates (and before a mid-epoch
    save, and at the epoch's end) the window's per-update losses are all-reduced in one call
    and copied to the host in one sync, then checked. A non-finite one raises NonFiniteLoss
    naming its update, before anything is saved; so the host can queue the next steps while
    the device works.
    """
    model.train()
    scaler = scaler or LossScaler(enabled=False)
    accum = opts.accum_steps
    world = dist.get_world_size() if dist.is_initialized() else 1
    total = pipe.batches_per_epoch
    if start_batch >= total:
        raise CheckpointError(f"epoch {epoch} would resume at batch {start_batch}, but it has "
                              f"{total} batches: the checkpoint was saved with other data or "
                              f"batches; set resume_at_epoch_boundary=true to continue from "
                              f"the next epoch boundary")
    bar = None
    if opts.progress:
        from tqdm import tqdm
        bar = tqdm(total=total, initial=start_batch, desc=f"epoch {epoch}", dynamic_ncols=True,
                   mininterval=1.0)
    if start_batch == 0 and rng_state is not None:
        restore_rng(rng_state)
    sums = EpochTotals(**vars(totals)) if totals is not None else EpochTotals()
    time_before, first_update = sums.time_s, update
    pending = torch.zeros((), device=device)   # the loss of the update being accumulated
    window = torch.zeros(opts.log_every, device=device)   # losses of the unchecked updates
    in_window = 0
    t0 = last_t = time.perf_counter()
    last_i, last_samples = start_batch, sums.samples

    def check_window(i: int) -> None:
        """One all-reduce and one host sync for the window's losses; NaN/inf raises."""
        nonlocal in_window, last_t, last_i, last_samples
        waiting_for(f"the loss check of epoch {epoch} at update {update}")
        values = all_reduce_mean(window[:in_window]).tolist()  # every rank stops alike
        first = update - in_window + 1
        for j, value in enumerate(values):
            if not math.isfinite(value):
                raise NonFiniteLoss(
                    f"loss is {value} at epoch {epoch}, update {first + j} (found at batch {i} "
                    f"after {in_window - j - 1} more updates, checked every log_every="
                    f"{opts.log_every}); stopping without saving. Lower optim.lr, enable "
                    f"optim.clip_grad, or use amp=bf16 instead of fp16")
        sums.loss_sum += sum(values)
        sums.loss_n += len(values)
        in_window = 0
        mean = sum(values) / len(values)
        lr = optimizer.param_groups[0]["lr"]
        if bar is not None:
            bar.set_postfix(loss=f"{mean:.4f}", lr=f"{lr:.2e}")
        if opts.step_lines:
            now = time.perf_counter()
            dt, steps = now - last_t, i + 1 - last_i
            rate = (sums.samples - last_samples) / dt if dt > 0 else 0.0
            eta = int((total - i - 1) * dt / steps) if steps else 0
            print(f"[train_imagenet] epoch {epoch} step {i + 1}/{total} loss {mean:.4f} "
                  f"lr {lr:.2e} img/s {rate:.0f} ETA {eta // 3600}:{eta // 60 % 60:02d}:"
                  f"{eta % 60:02d}", file=sys.stderr, flush=True)
            last_t, last_i, last_samples = now, i + 1, sums.samples

    optimizer.zero_grad(set_to_none=True)
    for i, (x, y, n_skipped) in enumerate(pipe.loader(epoch)):
        if i >= total:
            break
        if i < start_batch:
            if i == start_batch - 1 and rng_state is not None:
                restore_rng(rng_state)
            continue
        sums.skipped += int(n_skipped)
        waiting_for(f"the gradient all-reduce of epoch {epoch}, update {update + 1}")
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
            # backward; on the last micro-batch also (unscale,) clip and step the optimizer
            scaler(scaled, optimizer, clip_grad=opts.clip_grad or None, clip_mode=opts.clip_mode,
                   parameters=model.parameters(), need_update=last_micro)
        pending += scaled.detach()
        sums.samples += x.shape[0] * world
        if not last_micro:
            continue
        optimizer.zero_grad(set_to_none=True)
        update += 1
        scheduler.step_update(update)
        if ema is not None:
            ema.update(getattr(model, "module", model), step=update)
        window[in_window] = pending
        pending.zero_()
        in_window += 1
        if bar is not None:
            bar.update(accum)
        if in_window == opts.log_every or i + 1 == total or \
                (opts.save_every and update % opts.save_every == 0):
            check_window(i)
        if on_update is not None:
            sums.time_s = time_before + time.perf_counter() - t0
            on_update(i + 1, update, sums)
    if in_window:  # the loader ended early: check what is left
        check_window(total - 1)
    if bar is not None:
        bar.close()
    if update == first_update:
        raise DataError(f"epoch {epoch} ran no update (batches {start_batch}..{total - 1} were "
                        f"due, the loader ended first); check data.train")
    sums.time_s = time_before + time.perf_counter() - t0
    return {"train_loss": sums.loss_sum / max(sums.loss_n, 1), "lr": optimizer.param_groups[0]["lr"],
            "img_per_s": sums.samples / sums.time_s if sums.time_s > 0 else 0.0,
            "epoch_time_s": sums.time_s, "updates": update, "corrupt_skipped": sums.skipped}


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
