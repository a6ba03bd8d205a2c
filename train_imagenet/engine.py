"""The epoch loop (DeiT's engine.py, on timm's parts): `Loop`, what every update uses;
`EpochState`, where an epoch stands; `train_step`, one micro-batch as a function of (loop,
batch, state) returning the state; `train_one_epoch`, a plain loop over the epoch's batches
with the loss checks, progress and `on_update` (checkpointing) between updates; and
`evaluate`. After every update the ranks agree whether a stop signal came
(`preemption.agreed`); if one did, the epoch ends there with `Preempted`."""
import math
import resource
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from timm.utils import NativeScaler, dispatch_clip_grad

from .checkpoint import CheckpointError, restore_rng
from .data import DataError, DataPipe
from .distributed import all_reduce_mean, waiting_for
from .metrics import EvalMetrics
from .preemption import Preempted, agreed, shielded

__all__ = ["NonFiniteLoss", "EpochTotals", "EpochState", "Loop", "train_step", "train_one_epoch",
           "evaluate", "autocast", "peak_memory_mb"]


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or inf; the run stops without saving over good state."""


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


@dataclass
class EpochState:
    """Where an epoch stands: its position (a resumed epoch starts at `batch`, restoring
    `rng_state` there) and its running sums. The losses stay on the device (`pending`: the
    update being accumulated; `window`: the updates not checked yet), so the host never waits
    for a step; `bar` and `shown` are rank 0's progress (a tqdm bar; the time, batch and
    samples of the last progress line)."""
    epoch: int
    update: int                     # optimizer updates of the run so far
    batch: int = 0                  # batches of the epoch done
    totals: EpochTotals = field(default_factory=EpochTotals)
    rng_state: Optional[Dict[str, Any]] = None
    pending: Optional[torch.Tensor] = None     # () the summed loss of this update's micro-batches
    window: Optional[torch.Tensor] = None      # (log_every,) the losses of the unchecked updates
    in_window: int = 0              # how many of `window` are filled
    bar: Any = None
    shown: Tuple[float, int, int] = (0.0, 0, 0)


@dataclass
class Loop:
    """What every update of a run uses: the model as trained (it may be compiled and
    DDP-wrapped), timm's optimizer, schedule (stepped per update), loss, mixup, EMA and loss
    scaler (amp=fp16 only, as in timm's train.py), and the loop's settings."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss_fn: Callable
    device: torch.device
    mixup: Optional[Callable] = None
    ema: Optional[Any] = None
    scaler: Optional[NativeScaler] = None
    accum_steps: int = 1
    clip_grad: Optional[float] = None
    clip_mode: str = "norm"
    amp: str = "none"
    log_every: int = 50             # updates between loss checks (one sync, one all-reduce)
    save_every: int = 0             # updates between mid-epoch saves: the losses are checked first
    progress: bool = False          # tqdm bar (rank 0, in a terminal)
    step_lines: bool = False        # a printed line every `log_every` updates (rank 0, no terminal)
    world_size: int = 1


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


def train_step(loop: Loop, batch: Any, state: EpochState) -> EpochState:
    """One micro-batch: forward and backward of `batch` (images, labels, corrupt samples skipped
    before it); on the accumulation's last micro-batch also the optimizer step (with clipping),
    the schedule, the EMA and the update's loss into the window. Returns `state`, advanced in
    place. With DDP the all-reduce runs on the last micro-batch of an update only."""
    x, y, n_skipped = batch
    model = loop.model
    state.totals.skipped += int(n_skipped)
    waiting_for(f"the gradient all-reduce of epoch {state.epoch}, update {state.update + 1}")
    x, y = x.to(loop.device, non_blocking=True), y.to(loop.device, non_blocking=True)
    if loop.mixup is not None:
        x, y = loop.mixup(x, y)
    last_micro = (state.batch + 1) % loop.accum_steps == 0
    sync = last_micro or not isinstance(model, torch.nn.parallel.DistributedDataParallel)
    with (nullcontext() if sync else model.no_sync()):
        with autocast(loop.device, loop.amp):
            loss = loop.loss_fn(model(x), y)                       # model(x): (B, num_classes)
        scaled = loss / loop.accum_steps
        _backward(loop, scaled, need_update=last_micro)
    state.pending += scaled.detach()
    state.totals.samples += x.shape[0] * loop.world_size
    state.batch += 1
    if not last_micro:
        return state
    loop.optimizer.zero_grad(set_to_none=True)
    state.update += 1
    loop.scheduler.step_update(state.update)
    if loop.ema is not None:
        loop.ema.update(getattr(model, "module", model), step=state.update)
    state.window[state.in_window] = state.pending
    state.pending.zero_()
    state.in_window += 1
    return state


def _backward(loop: Loop, loss: torch.Tensor, need_update: bool) -> None:
    """timm's train.py: with fp16, its NativeScaler (scaled backward; on an update unscale,
    clip, step and update the scale, skipping a step whose gradients are not finite);
    otherwise a plain backward and, on an update, clip and step."""
    if loop.scaler is not None:
        loop.scaler(loss, loop.optimizer, clip_grad=loop.clip_grad, clip_mode=loop.clip_mode,
                    parameters=loop.model.parameters(), need_update=need_update)
        return
    loss.backward()
    if need_update:
        if loop.clip_grad is not None:
            dispatch_clip_grad(loop.model.parameters(), loop.clip_grad, mode=loop.clip_mode)
        loop.optimizer.step()


def _batches(pipe: DataPipe, epoch: int, start_batch: int,
             rng_state: Optional[Dict[str, Any]]) -> Iterator[Any]:
    """Batches `start_batch..` of `epoch`. A resumed epoch reads and drops its first
    `start_batch` batches (the data order is a function of the seed and epoch), then restores
    `rng_state`, so the batches and the steps' randomness continue where the run stopped."""
    if start_batch == 0 and rng_state is not None:
        restore_rng(rng_state)
    for i, batch in enumerate(shielded(pipe.loader(epoch))):
        if i >= pipe.batches_per_epoch:
            return
        if i < start_batch:
            if i == start_batch - 1 and rng_state is not None:
                restore_rng(rng_state)
            continue
        yield batch


def _check_losses(state: EpochState, log_every: int) -> List[float]:
    """The window's losses, all-reduced in one call and copied to the host in one sync, added
    to the totals; the window is emptied. A NaN/inf raises NonFiniteLoss naming its update
    (every rank sees the same values, so every rank stops alike)."""
    waiting_for(f"the loss check of epoch {state.epoch} at update {state.update}")
    values = all_reduce_mean(state.window[:state.in_window]).tolist()
    first = state.update - state.in_window + 1
    for j, value in enumerate(values):
        if not math.isfinite(value):
            raise NonFiniteLoss(
                f"loss is {value} at epoch {state.epoch}, update {first + j} (found at batch "
                f"{state.batch - 1} after {state.in_window - j - 1} more updates, checked every "
                f"log_every={log_every}); stopping without saving. Lower optim.lr, enable "
                f"optim.clip_grad, or use amp=bf16 instead of fp16")
    for value in values:            # one at a time: the sum is the same however it is checked
        state.totals.loss_sum += value
    state.totals.loss_n += len(values)
    state.in_window = 0
    return values


def _start_progress(loop: Loop, state: EpochState, total: int) -> None:
    if loop.progress:
        from tqdm import tqdm
        state.bar = tqdm(total=total, initial=state.batch, desc=f"epoch {state.epoch}",
                         dynamic_ncols=True, mininterval=1.0)
    state.shown = (time.perf_counter(), state.batch, state.totals.samples)


def _show_progress(loop: Loop, state: EpochState, total: int, losses: List[float]) -> None:
    """Rank 0's progress after a loss check: the tqdm bar's postfix in a terminal, or without
    one (`step_lines`) a line with img/s over all ranks since the previous line and the ETA of
    the epoch's remaining batches."""
    mean, lr = sum(losses) / len(losses), loop.optimizer.param_groups[0]["lr"]
    if state.bar is not None:
        state.bar.set_postfix(loss=f"{mean:.4f}", lr=f"{lr:.2e}")
    if not loop.step_lines:
        return
    now = time.perf_counter()
    then, batch, samples = state.shown
    dt, steps = now - then, state.batch - batch
    rate = (state.totals.samples - samples) / dt if dt > 0 else 0.0
    eta = int((total - state.batch) * dt / steps) if steps else 0
    print(f"[train_imagenet] epoch {state.epoch} step {state.batch}/{total} loss {mean:.4f} lr "
          f"{lr:.2e} img/s {rate:.0f} ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}",
          file=sys.stderr, flush=True)
    state.shown = (now, state.batch, state.totals.samples)


def train_one_epoch(loop: Loop, pipe: DataPipe, state: EpochState,
                    on_update: Optional[Callable[[EpochState], None]] = None) -> Dict[str, float]:
    """Runs batches `state.batch..` of epoch `state.epoch` through `train_step`, adding to
    `state` (a resumed epoch continues exactly where the interrupted run stopped, with the
    running sums of the batches before). After each update `on_update(state)` runs
    (checkpointing). A call that runs no update is an error.

    The losses are checked every `loop.log_every` updates, before a mid-epoch save, before a
    stop and at the epoch's end (`_check_losses`: one all-reduce, one host sync), so the host
    can queue the next steps while the device works, and a NaN/inf stops the run before
    anything is saved. After every update the ranks agree whether a stop signal came
    (`preemption.agreed`: one host-side all-reduce among several ranks); if one did, the epoch
    ends there with `Preempted`.
    """
    total, first_batch, first_update = pipe.batches_per_epoch, state.batch, state.update
    if first_batch >= total:
        raise CheckpointError(f"epoch {state.epoch} would resume at batch {first_batch}, but it has "
                              f"{total} batches: the checkpoint was saved with other data or "
                              f"batches; set resume_at_epoch_boundary=true to continue from "
                              f"the next epoch boundary")
    loop.model.train()
    state.pending = torch.zeros((), device=loop.device)
    state.window = torch.zeros(loop.log_every, device=loop.device)
    _start_progress(loop, state, total)
    time_before, t0 = state.totals.time_s, time.perf_counter()

    loop.optimizer.zero_grad(set_to_none=True)
    for batch in _batches(pipe, state.epoch, first_batch, state.rng_state):
        before = state.update
        state = train_step(loop, batch, state)
        if state.update == before:
            continue
        if state.bar is not None:
            state.bar.update(loop.accum_steps)
        stop = agreed(state.epoch, state.update) and state.batch < total   # a signal, mid-epoch
        if state.in_window == loop.log_every or state.batch == total or stop or \
                (loop.save_every and state.update % loop.save_every == 0):
            _show_progress(loop, state, total, _check_losses(state, loop.log_every))
        state.totals.time_s = time_before + time.perf_counter() - t0
        if on_update is not None:
            on_update(state)
        if stop:
            _close_progress(state)
            raise Preempted(state.epoch, state.batch, state.update, state.totals)
    if state.in_window:  # the loader ended early: check what is left
        _show_progress(loop, state, total, _check_losses(state, loop.log_every))
    _close_progress(state)
    if state.update == first_update:
        raise DataError(f"epoch {state.epoch} ran no update (batches {first_batch}..{total - 1} "
                        f"were due, the loader ended first); check data.train")
    sums = state.totals
    sums.time_s = time_before + time.perf_counter() - t0
    return {"train_loss": sums.loss_sum / max(sums.loss_n, 1),
            "lr": loop.optimizer.param_groups[0]["lr"],
            "img_per_s": sums.samples / sums.time_s if sums.time_s > 0 else 0.0,
            "epoch_time_s": sums.time_s, "corrupt_skipped": sums.skipped}


def _close_progress(state: EpochState) -> None:
    if state.bar is not None:
        state.bar.close()
        state.bar = None


@torch.no_grad()
def evaluate(model: torch.nn.Module, pipe: DataPipe, num_classes: int, device: torch.device,
             amp: str = "none") -> Dict[str, float]:
    """Top-1/top-5 (percent), mean loss, sample count and corrupt samples skipped over every
    rank's share of `pipe`."""
    model.eval()
    metrics = EvalMetrics(num_classes, device)
    for x, y, n_skipped in shielded(pipe.loader(0)):
        metrics.skipped(int(n_skipped))
        if y.numel() == 0:
            continue
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, amp):
            out = model(x)                                               # (B, num_classes)
        metrics.update(out, y)
    return metrics.compute()
