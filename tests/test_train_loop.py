"""The training loop as a cluster sees it: one host sync and one all-reduce per `log_every`
updates (not per update), a NaN still caught inside that window and before any save, and
a progress line every `log_every` updates when stderr is not a terminal; the step itself
(`train_step`: accumulation, clipping, timm's NativeScaler) against plain torch."""
import itertools
import re

import pytest
import torch
import torch.distributed as dist

from train_imagenet.config import load_config
from train_imagenet.data import build_data
from timm.utils import NativeScaler

from train_imagenet.engine import EpochState, Loop, NonFiniteLoss, train_one_epoch, train_step

from train_helpers import digits, write_shards


@pytest.fixture
def pipe(tmp_path):
    x, y = digits(96)
    write_shards(str(tmp_path), "train", x, y, 24)
    cfg = load_config(None, [f"data.train={tmp_path}", f"data.val={tmp_path}", "data.num_classes=10",
                             "data.img_size=32", "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]",
                             "batch_size=8", "data.num_workers=0", "aug.no_aug=true",
                             "aug.mixup=0", "aug.cutmix=0"])
    return build_data(cfg, "train")                       # 12 batches


@pytest.fixture
def group():
    """A one-process gloo group, so the loop takes its distributed path."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Sched:
    def step_update(self, n):
        pass


def _epoch(pipe, options, on_update=None, loss_fn=torch.nn.CrossEntropyLoss()):
    """One epoch of a linear model over `pipe`, with the `Loop` settings `options`; the
    epoch's stats and its final state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loop = Loop(model, optimizer, _Sched(), loss_fn, torch.device("cpu"), **options)
    state = EpochState(0, 0)
    stats = train_one_epoch(loop, pipe, state, on_update)
    return {**stats, "updates": state.update}


def _count_syncs(monkeypatch):
    calls = {"all_reduce": 0, "host": 0}
    real_reduce, real_tolist, real_float = dist.all_reduce, torch.Tensor.tolist, torch.Tensor.__float__

    def all_reduce(t, *a, **k):
        calls["all_reduce"] += 1
        return real_reduce(t, *a, **k)

    def tolist(self):
        calls["host"] += 1
        return real_tolist(self)

    def to_float(self):
        calls["host"] += 1
        return real_float(self)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "__float__", to_float)
    return calls


@pytest.mark.parametrize("log_every, save_every, checks", [
    (5, 0, 3),      # updates 5, 10, 12 (the epoch's end)
    (50, 0, 1),     # 12
    (1, 0, 12),     # every update
    (5, 4, 3),      # saves at 4, 8, 12 end each window first
])
def test_one_sync_and_one_reduce_per_window(pipe, group, monkeypatch, log_every, save_every, checks):
    """12 updates: a window ends after log_every updates, at a save, and at the epoch's end."""
    calls = _count_syncs(monkeypatch)
    stats = _epoch(pipe, dict(log_every=log_every, save_every=save_every))
    assert stats["updates"] == 12
    assert calls == {"all_reduce": checks, "host": checks}


def test_mean_loss_is_independent_of_the_window(pipe):
    a = _epoch(pipe, dict(log_every=1))["train_loss"]
    b = _epoch(pipe, dict(log_every=7))["train_loss"]
    assert a == pytest.approx(b, rel=1e-6)


@pytest.mark.parametrize("save_every", [0, 4])
def test_nan_caught_in_its_window_before_any_save(pipe, group, save_every):
    saved, calls = [], itertools.count(1)

    def on_update(state):
        if save_every and state.update % save_every == 0:
            saved.append(state.update)

    def nan_at_7(out, y):                                 # one call per update here
        loss = torch.nn.functional.cross_entropy(out, y)
        return loss * float("nan") if next(calls) == 7 else loss
    with pytest.raises(NonFiniteLoss, match=r"loss is nan at epoch 0, update 7 \(found at batch"):
        _epoch(pipe, dict(log_every=5, save_every=save_every), on_update, nan_at_7)
    assert saved == ([4] if save_every else [])          # update 8's save never ran


def test_step_lines_without_a_terminal(pipe, capsys):
    _epoch(pipe, dict(log_every=5, step_lines=True))
    lines = [line for line in capsys.readouterr().err.splitlines() if "step" in line]
    assert [re.search(r"step (\d+/\d+)", line).group(1) for line in lines] == ["5/12", "10/12", "12/12"]
    pattern = (r"^\[train_imagenet\] epoch 0 step \d+/12 loss \d+\.\d{4} lr \d\.\d{2}e-\d\d "
               r"img/s \d+ ETA \d+:\d\d:\d\d$")
    assert all(re.match(pattern, line) for line in lines), lines
    _epoch(pipe, dict(log_every=5))                  # off: nothing printed
    assert "step" not in capsys.readouterr().err


@pytest.mark.parametrize("scaler", [None, "native"])
def test_step_accumulates_clips_and_steps_like_plain_torch(scaler):
    """Two micro-batches of one update (accum_steps=2, clip 0.1) through `train_step`, without a
    scaler (bf16/fp32) or with timm's NativeScaler (its GradScaler on CPU: the power-of-two
    scale is exact): the same as backward of each half loss, clip_grad_norm_, one step."""
    def setup():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        return model, torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(2, 8, 4) * 10, torch.randint(0, 3, (2, 8))
    a, opt_a = setup()
    loop = Loop(a, opt_a, _Sched(), torch.nn.functional.cross_entropy, torch.device("cpu"),
                scaler=NativeScaler("cpu") if scaler else None, accum_steps=2, clip_grad=0.1)
    state = EpochState(0, 0, pending=torch.zeros(()), window=torch.zeros(5))
    before = [p.detach().clone() for p in a.parameters()]
    state = train_step(loop, (x[0], y[0], 0), state)             # accumulate only
    assert (state.update, state.batch, state.in_window) == (0, 1, 0)
    assert all(p.grad is not None for p in a.parameters())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before))
    state = train_step(loop, (x[1], y[1], 2), state)
    assert (state.update, state.batch, state.in_window) == (1, 2, 1)
    assert (state.totals.samples, state.totals.skipped) == (16, 2)
    assert all(p.grad is None for p in a.parameters())          # zeroed after the update
    b, opt_b = setup()
    losses = [torch.nn.functional.cross_entropy(b(x[i]), y[i]) / 2 for i in range(2)]
    for loss in losses:
        loss.backward()
    torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    opt_b.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert state.window[0].item() == pytest.approx(sum(loss.item() for loss in losses), rel=1e-6)
    assert state.pending.item() == 0


def test_native_scaler_skips_a_non_finite_update():
    """fp16's guard: with the NativeScaler an update whose gradients are not finite leaves the
    weights as they were and halves the scale; its loss still reaches the window, where the
    check stops the run."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = NativeScaler("cpu")
    loop = Loop(model, opt, _Sched(), lambda out, y: out.sum() * float("inf"),
                torch.device("cpu"), scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    scale = scaler.state_dict()["scale"]
    state = train_step(loop, (torch.randn(8, 4), torch.zeros(8, dtype=torch.long), 0),
                       EpochState(0, 0, pending=torch.zeros(()), window=torch.zeros(5)))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert scaler.state_dict()["scale"] == scale / 2 and state.update == 1
    assert not torch.isfinite(state.window[0])
