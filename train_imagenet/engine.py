"""The epoch loop (DeiT's engine.py, on timm's parts): `Step`, one micro-batch as a function
of (model, batch, loop state) returning the state; `train_one_epoch`, a plain loop over the
epoch's batches with the loss checks, progress and `on_update` (checkpointing) between
updates; and `evaluate`. After every update the ranks agree whether a stop signal came
(`preemption.agreed`); if one did, the epoch ends there with `Preempted`."""
import math
import resource
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from timm.utils import NativeScaler, dispatch_clip_grad

from .checkpoint import CheckpointError, restore_rng
from .data import DataError, DataPipe
from .distributed import all_reduce_mean, waiting_for
from .metrics import EvalMetrics
from .preemption import Preempted, agreed, shielded

__all__ = ["NonFiniteLoss", "StepOptions", "EpochTotals", "LoopState", "Step", "train_one_epoch",
           "evaluate", "autocast", "peak_memory_mb"]


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or inf; the run stops without saving over good state."""


@dataclass
class StepOptions:
    accum_steps: int = 1
    clip_grad: Optional[float] = None
    clip_mode: str = "norm"
    amp: str = "none"
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


@dataclass
class LoopState:
    """Where an epoch stands. The losses stay on the device (`pending`: the update being
    accumulated; `window`: the updates not checked yet), so the host never waits for a step."""
    epoch: int
    update: int                     # optimizer updates of the run so far
    batch: int                      # batches of the epoch done
    totals: EpochTotals
    pending: torch.Tensor           # () the summed loss of the micro-batches of this update
    window: torch.Tensor            # (log_every,) the losses of the unchecked updates
    in_window: int = 0              # how many of `window` are filled


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


@dataclass
class Step:
    """One training step: ``step(model, batch, state)`` runs one micro-batch and returns the
    state advanced past it (the same object, updated in place). `model` may be DDP-wrapped
    (its all-reduce runs on the last micro-batch of an update only)."""
    optimizer: torch.optim.Optimizer
    scheduler: Any                  # a timm scheduler, stepped per update
    loss_fn: Callable
    device: torch.device
    opts: StepOptions
    mixup: Optional[Callable] = None
    ema: Optional[Any] = None
    scaler: Optional[NativeScaler] = None   # amp=fp16 only (timm's train.py does the same)
    world_size: int = 1

    def __call__(self, model: torch.nn.Module, batch: Any, state: LoopState) -> LoopState:
        """Forward and backward of `batch` (images, labels, corrupt samples skipped before
        it); on the accumulation's last micro-batch also the optimizer step (with clipping),
        the schedule, the EMA and the update's loss into the window."""
        x, y, n_skipped = batch
        opts = self.opts
        state.totals.skipped += int(n_skipped)
        waiting_for(f"the gradient all-reduce of epoch {state.epoch}, update {state.update + 1}")
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.mixup is not None:
            x, y = self.mixup(x, y)
        last_micro = (state.batch + 1) % opts.accum_steps == 0
        sync = last_micro or not isinstance(model, torch.nn.parallel.DistributedDataParallel)
        with (nullcontext() if sync else model.no_sync()):
            with autocast(self.device, opts.amp):
                loss = self.loss_fn(model(x), y)                   # model(x): (B, num_classes)
            scaled = loss / opts.accum_steps
            self._backward(scaled, model, need_update=last_micro)
        state.pending += scaled.detach()
        state.totals.samples += x.shape[0] * self.world_size
        state.batch += 1
        if not last_micro:
            return state
        self.optimizer.zero_grad(set_to_none=True)
        state.update += 1
        self.scheduler.step_update(state.update)
        if self.ema is not None:
            self.ema.update(getattr(model, "module", model), step=state.update)
        state.window[state.in_window] = state.pending
        state.pending.zero_()
        state.in_window += 1
        return state

    def _backward(self, loss: torch.Tensor, model: torch.nn.Module, need_update: bool) -> None:
        """timm's train.py: with fp16, its NativeScaler (scaled backward; on an update unscale,
        clip, step and update the scale, skipping a step whose gradients are not finite);
        otherwise a plain backward and, on an update, clip and step."""
        opts = self.opts
        if self.scaler is not None:
            self.scaler(loss, self.optimizer, clip_grad=opts.clip_grad, clip_mode=opts.clip_mode,
                        parameters=model.parameters(), need_update=need_update)
            return
        loss.backward()
        if need_update:
            if opts.clip_grad is not None:
                dispatch_clip_grad(model.parameters(), opts.clip_grad, mode=opts.clip_mode)
            self.optimizer.step()


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


def _check_losses(state: LoopState, log_every: int) -> List[float]:
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


class _Progress:
    """Rank 0's progress: a tqdm bar in a terminal (`opts.progress`), or a line per loss check
    without one (`opts.step_lines`: img/s over all ranks since the previous line, and the ETA
    of the epoch's remaining batches)."""

    def __init__(self, epoch: int, total: int, state: LoopState, opts: StepOptions):
        self.epoch, self.total, self.lines = epoch, total, opts.step_lines
        self.bar = None
        if opts.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=state.batch, desc=f"epoch {epoch}",
                            dynamic_ncols=True, mininterval=1.0)
        self.last_t, self.last_batch, self.last_samples = \
            time.perf_counter(), state.batch, state.totals.samples

    def advance(self, batches: int) -> None:
        if self.bar is not None:
            self.bar.update(batches)

    def show(self, state: LoopState, losses: List[float], lr: float) -> None:
        mean = sum(losses) / len(losses)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{mean:.4f}", lr=f"{lr:.2e}")
        if not self.lines:
            return
        now = time.perf_counter()
        dt, steps = now - self.last_t, state.batch - self.last_batch
        rate = (state.totals.samples - self.last_samples) / dt if dt > 0 else 0.0
        eta = int((self.total - state.batch) * dt / steps) if steps else 0
        print(f"[train_imagenet] epoch {self.epoch} step {state.batch}/{self.total} loss "
              f"{mean:.4f} lr {lr:.2e} img/s {rate:.0f} ETA {eta // 3600}:{eta // 60 % 60:02d}:"
              f"{eta % 60:02d}", file=sys.stderr, flush=True)
        self.last_t, self.last_batch, self.last_samples = now, state.batch, state.totals.samples

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train_one_epoch(model: torch.nn.Module, pipe: DataPipe, epoch: int, *,
                    optimizer: torch.optim.Optimizer, scheduler: Any, loss_fn: Callable,
                    device: torch.device, opts: StepOptions, update: int,
                    start_batch: int = 0, rng_state: Optional[Dict[str, Any]] = None,
                    mixup: Optional[Callable] = None, ema: Optional[Any] = None,
                    scaler: Optional[NativeScaler] = None, totals: Optional[EpochTotals] = None,
                    on_update: Optional[Callable[[int, int, int, EpochTotals], None]] = None
                    ) -> Dict[str, float]:
    """Runs batches `start_batch..` of `epoch` through a `Step`; `model` may be DDP-wrapped.

    `update` counts optimizer updates before this call. After each update,
    `on_update(epoch, batch_done, update, totals)` runs (checkpointing). A resumed epoch
    (`start_batch`, `rng_state`) continues exactly where the interrupted run stopped and adds
    to the epoch's `totals` of the batches before. A call that runs no update is an error.

    The losses are checked every `opts.log_every` updates, before a mid-epoch save and at the
    epoch's end (`_check_losses`: one all-reduce, one host sync), so the host can queue the
    next steps while the device works, and a NaN/inf stops the run before anything is saved.
    """
    total = pipe.batches_per_epoch
    if start_batch >= total:
        raise CheckpointError(f"epoch {epoch} would resume at batch {start_batch}, but it has "
                              f"{total} batches: the checkpoint was saved with other data or "
                              f"batches; set resume_at_epoch_boundary=true to continue from "
                              f"the next epoch boundary")
    model.train()
    world = dist.get_world_size() if dist.is_initialized() else 1
    step = Step(optimizer, scheduler, loss_fn, device, opts, mixup, ema, scaler, world)
    state = LoopState(epoch, update, start_batch,
                      EpochTotals(**vars(totals)) if totals is not None else EpochTotals(),
                      torch.zeros((), device=device), torch.zeros(opts.log_every, device=device))
    progress = _Progress(epoch, total, state, opts)
    time_before, t0 = state.totals.time_s, time.perf_counter()

    optimizer.zero_grad(set_to_none=True)
    for batch in _batches(pipe, epoch, start_batch, rng_state):
        before = state.update
        state = step(model, batch, state)
        if state.update == before:
            continue
        progress.advance(opts.accum_steps)
        stop = agreed(epoch, state.update) and state.batch < total   # a stop signal, mid-epoch
        if state.in_window == opts.log_every or state.batch == total or stop or \
                (opts.save_every and state.update % opts.save_every == 0):
            progress.show(state, _check_losses(state, opts.log_every), optimizer.param_groups[0]["lr"])
        state.totals.time_s = time_before + time.perf_counter() - t0
        if on_update is not None:
            on_update(epoch, state.batch, state.update, state.totals)
        if stop:
            progress.close()
            raise Preempted(epoch, state.batch, state.update, state.totals)
    if state.in_window:  # the loader ended early: check what is left
        progress.show(state, _check_losses(state, opts.log_every), optimizer.param_groups[0]["lr"])
    progress.close()
    if state.update == update:
        raise DataError(f"epoch {epoch} ran no update (batches {start_batch}..{total - 1} were "
                        f"due, the loader ended first); check data.train")
    sums = state.totals
    sums.time_s = time_before + time.perf_counter() - t0
    return {"train_loss": sums.loss_sum / max(sums.loss_n, 1), "lr": optimizer.param_groups[0]["lr"],
            "img_per_s": sums.samples / sums.time_s if sums.time_s > 0 else 0.0,
            "epoch_time_s": sums.time_s, "updates": state.update, "corrupt_skipped": sums.skipped}


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
