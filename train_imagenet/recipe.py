"""What a config makes of a model for training, from timm's parts: the optimizer (linear lr
scaling, weight decay, parameter groups), the per-update schedule, the loss scaler, mixup and
the loss. `check_recipe` tries the names on a dummy parameter, before any data is read."""
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
from timm.utils import NativeScaler

from dcvit.cli import did_you_mean

from .config import Config, ConfigError
from .finetune import param_group_fn
from .mixup import RollMixup

__all__ = ["Recipe", "build_recipe", "check_recipe"]


@dataclass
class Recipe:
    optimizer: torch.optim.Optimizer
    scheduler: Any                       # a timm scheduler, stepped per update
    scaler: Optional[NativeScaler]       # timm's loss scaler, for amp=fp16 only
    mixup: Optional[Callable]
    loss_fn: Callable
    lr: float                            # after linear scaling to the global batch
    global_batch: int


def check_recipe(cfg: Config) -> None:
    """Fails on what only timm knows: an unknown optimizer or scheduler name (made on a dummy
    parameter, so before any data is read)."""
    from timm.optim import create_optimizer_v2, list_optimizers
    from timm.scheduler import create_scheduler_v2
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("tensorboard=true needs the tensorboard package: "
                          "pip install 'dcvit[tensorboard]' (or set tensorboard=false)")
    dummy = torch.nn.Linear(1, 1)
    try:
        optimizer = create_optimizer_v2(dummy, opt=cfg.optim.opt, lr=cfg.optim.lr)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"optim.opt={cfg.optim.opt!r} is not a timm optimizer ({e})"
                          f"{did_you_mean(cfg.optim.opt.lower(), list_optimizers())}") from e
    try:
        create_scheduler_v2(optimizer, sched=cfg.sched.sched, num_epochs=cfg.epochs,
                            step_on_epochs=False, updates_per_epoch=1)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"sched.sched={cfg.sched.sched!r} is not a timm scheduler ({e}); use "
                          f"one of cosine, tanh, step, multistep, plateau, poly") from e


def build_recipe(cfg: Config, model: torch.nn.Module, batches_per_epoch: int,
                 world_size: int) -> Recipe:
    """The optimizer, schedule, scaler, mixup and loss of `cfg` for `model`."""
    from timm.data import Mixup
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2

    global_batch = cfg.batch_size * cfg.accum_steps * world_size
    lr = cfg.optim.lr * (global_batch / cfg.optim.lr_batch_size if cfg.optim.lr_batch_size else 1.0)
    opt_kwargs: Dict[str, Any] = {}
    if cfg.optim.betas:
        opt_kwargs["betas"] = tuple(cfg.optim.betas)
    if cfg.optim.eps:
        opt_kwargs["eps"] = cfg.optim.eps
    weight_decay = cfg.optim.weight_decay
    if cfg.optim.decoupled_weight_decay is not None:   # AdamW decays by lr_t·wd: wd = wd_abs / lr
        weight_decay = cfg.optim.decoupled_weight_decay / lr
    if cfg.convert.enabled:  # the DCMHA parameters: their own lr multiplier and weight decay
        opt_kwargs["param_group_fn"] = param_group_fn(cfg, weight_decay)
    optimizer = create_optimizer_v2(model, opt=cfg.optim.opt, lr=lr, weight_decay=weight_decay,
                                    momentum=cfg.optim.momentum, **opt_kwargs)
    updates_per_epoch = batches_per_epoch // cfg.accum_steps
    warmup_epochs = cfg.sched.warmup_epochs
    if cfg.sched.warmup_steps is not None:             # timm counts warm-up in epochs
        warmup_epochs = cfg.sched.warmup_steps / max(updates_per_epoch, 1)
    scheduler, _ = create_scheduler_v2(optimizer, sched=cfg.sched.sched, num_epochs=cfg.epochs,
                                       warmup_epochs=warmup_epochs,
                                       warmup_prefix=cfg.sched.warmup_prefix,
                                       warmup_lr=cfg.sched.warmup_lr, min_lr=cfg.sched.min_lr,
                                       cooldown_epochs=cfg.sched.cooldown_epochs,
                                       step_on_epochs=False, updates_per_epoch=updates_per_epoch)
    # bf16 and fp32 need no loss scale (timm's train.py); fp16 runs on CUDA only (checked first)
    scaler = NativeScaler(device="cuda") if cfg.amp == "fp16" else None
    a = cfg.aug
    mixup = None
    if a.mixup > 0 or a.cutmix > 0:
        mixup = Mixup(mixup_alpha=a.mixup, cutmix_alpha=a.cutmix, prob=a.mixup_prob,
                      switch_prob=a.mixup_switch_prob, mode=a.mixup_mode,
                      label_smoothing=a.smoothing, num_classes=cfg.data.num_classes)
        loss_fn = SoftTargetCrossEntropy()
    elif a.bv_mixup > 0:
        mixup = RollMixup(a.bv_mixup, cfg.data.num_classes, a.smoothing)
        loss_fn = SoftTargetCrossEntropy()
    elif a.smoothing > 0:
        loss_fn = LabelSmoothingCrossEntropy(a.smoothing)
    else:
        loss_fn = torch.nn.CrossEntropyLoss()
    return Recipe(optimizer, scheduler, scaler, mixup, loss_fn, lr, global_batch)
