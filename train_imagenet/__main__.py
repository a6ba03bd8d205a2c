"""Train or evaluate an image classifier on ImageNet-style data, under torchrun or alone.

    python -m train_imagenet --config configs/quickstart.yaml [key=value ...]
    torchrun --nproc_per_node=8 -m train_imagenet --config configs/deit300_dcvit_small.yaml
    python -m train_imagenet --config ... --eval-only checkpoint=runs/x/ckpt-e0300-u00375300.pth

The wiring only: config -> model -> data -> engine -> checkpoints/logs. Every check that can
fail (optimizer/scheduler names, the output directory and its lock, data paths, shards and
labels of both splits, checkpoint checksum and architecture) runs before training starts,
and the run's config.yaml is written only once they all passed.
"""
import argparse
import os
import shlex
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

from dcvit.io import atomic_write

from .checkpoint import CheckpointError, list_checkpoints, seed_all
from .config import Config, ConfigError, load_config
from .data import DataError, build_data, count_samples, is_remote, resolve_source
from .distributed import (DistInfo, broadcast_object, init_distributed, log_main,
                          lost_peer_message, shutdown, timeout_message, waiting_for)
from .engine import NonFiniteLoss
from .preemption import (EXIT_INTERRUPTED, Preempted, StopOnSignal, exit_code, hold_after_stop,
                         received)
from .finetune import conversion_to_apply
from .model import build_model, input_norm
from .recipe import check_recipe
from .run_lock import RunDirError, RunLock, prepare_run_dir
from .start import checkpoint_to_start
from .trainer import evaluate_checkpoint, train

__all__ = ["main", "run"]


def _on_main(info: DistInfo, fn: Callable[[], Any], error: Callable[[Exception], Exception],
             what: str) -> Any:
    """`fn()` on rank 0 (`what` it does), its result broadcast to every rank; an exception
    there is broadcast too (a user error as itself, anything else through `error`), so every
    rank raises it instead of waiting in the next collective."""
    waiting_for(f"rank 0's {what}")
    result: Any = None
    if info.is_main:
        try:
            result = fn()
        except (ConfigError, DataError, CheckpointError, RunDirError) as e:
            result = e
        except Exception as e:  # e.g. FileNotFoundError from ImageFolder: every rank must hear
            result = error(e)
    result = broadcast_object(result)
    if isinstance(result, Exception):
        raise result
    return result


def _counts(cfg: Config, split: str, info: DistInfo) -> Dict[str, int]:
    """Sample/class counts of a split, found (and its shards checked) once on rank 0 and
    shared with every rank."""
    def count() -> Dict[str, int]:
        given = getattr(cfg.data, f"{split}_samples")
        src = resolve_source(getattr(cfg.data, split), f"data.{split}")
        if given and src.kind == "wds" and any(is_remote(s) for s in src.shards):
            return {"num_samples": given, "num_classes": 0}   # remote: nothing to check
        result = count_samples(src, f"data.{split}", cfg.data.num_classes, cfg.output_dir)
        if given:
            result["num_samples"] = given
        return result
    return _on_main(info, count, lambda e: DataError(
        f"data.{split}={getattr(cfg.data, split)!r} cannot be read ({type(e).__name__}: {e})"),
        f"check of data.{split} (its shards and labels)")


def run(cfg: Config) -> int:
    check_recipe(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible to this process "
                          "(torch.cuda.is_available() is False); use device=cpu or device=auto")
    info = init_distributed(cfg.device, cfg.dist_timeout)
    device = info.device
    if cfg.amp == "fp16" and device.type != "cuda":
        raise ConfigError("amp=fp16 needs a CUDA device (it uses a GradScaler); use amp=bf16 on CPU")
    held: List[RunLock] = []                    # rank 0's lock stays in its process
    _on_main(info, lambda: held.append(prepare_run_dir(cfg.output_dir)), lambda e: RunDirError(
        f"output_dir={cfg.output_dir!r} cannot be used ({type(e).__name__}: {e})"),
        "set-up of output_dir (its lock)")
    try:
        # The checkpoint this run loads (picked once; a damaged newest one is set aside) decides
        # whether it converts (a converted run's checkpoint converts again) and whether the
        # pretrained file is read (not when resuming/evaluating).
        start, state = checkpoint_to_start(cfg, info)
        resuming = cfg.eval_only or bool(start)
        conversion_to_apply(cfg, start or cfg.checkpoint, lambda msg: log_main(info, msg))
        seed_all(cfg.seed)  # the same initial weights on every rank and world size
        model = build_model(cfg, pretrained=not resuming)
        norm = input_norm(cfg, model)   # the config stays as given (data.mean: null = the model's)
        val = build_data(cfg, "val", info.rank, info.world_size, _counts(cfg, "val", info), norm)
        train_data = None if cfg.eval_only else build_data(
            cfg, "train", info.rank, info.world_size, _counts(cfg, "train", info), norm)
        model.to(device)
        if cfg.eval_only:
            return evaluate_checkpoint(cfg, model, val, info, start)
        with StopOnSignal():
            return train(cfg, model, train_data, val, info, start, state)
    finally:
        for lock in held:
            lock.release()


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train_imagenet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML recipe (configs/*.yaml)")
    p.add_argument("--eval-only", action="store_true", help="evaluate checkpoint=PATH and exit")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of a refused command (exit code 2/3) too")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=1e-3")
    return p.parse_intermixed_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """`run` with its exit code (see `_main`); rank 0 also writes the code to the file that the
    environment variable DCVIT_EXIT_FILE names, if set (scripts/slurm_train.sh reads it to
    decide whether to requeue the job: an uncaught exception is written as 1, a Ctrl-C before
    training, where nothing is saved, as 130 like one while training). A file that cannot be
    written is a warning: the process keeps its exit code."""
    code: Any = 1
    try:
        code = _main(argv)
        return code
    except SystemExit as e:
        code = e.code
        raise
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED     # Python's traceback; the process ends by SIGINT (shell: 130)
        raise
    finally:
        path = os.environ.get("DCVIT_EXIT_FILE")
        if path and os.environ.get("RANK", "0") == "0":
            try:
                atomic_write(path, lambda tmp: _write_text(tmp, f"{code}\n"))
            except OSError as e:
                print(f"warning: cannot write the exit code to DCVIT_EXIT_FILE={path!r} "
                      f"({type(e).__name__}: {e.strerror or e}); the run's exit code {code} stands",
                      file=sys.stderr, flush=True)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _main(argv: Optional[List[str]] = None) -> int:
    """Exit codes: 0 done, 2 bad config/data/checkpoint/output directory, 3 non-finite loss,
    4 a collective that waited longer than dist_timeout or lost a peer rank's process or
    node, 75 stopped by SIGTERM/SIGUSR1/SIGHUP with a checkpoint and 130 by SIGINT (Ctrl-C)
    with a checkpoint (`preemption`), each with a one-line message (and the traceback with
    --debug). The errors of 2 and 3 and a stop are raised on
    every rank alike, so the process group is closed cleanly; after a timeout or a lost peer,
    and for any other exception (which
    propagates), it is not closed (closing could wait for a peer blocked in a collective),
    and torchrun then stops the remaining ranks."""
    args = parse_args(argv)
    cfg = None
    try:
        cfg = load_config(args.config, args.overrides + (["eval_only=true"] if args.eval_only else []))
        code = run(cfg)
    except NonFiniteLoss as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        code = 3
    except (ConfigError, DataError, CheckpointError, RunDirError) as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except Preempted as p:
        code = exit_code()
        if os.environ.get("RANK", "0") == "0":
            print(f"[train_imagenet] stopped by {received() or 'a stop signal to another rank'} "
                  f"after epoch {p.epoch}, batch {p.batch}, update {p.update}: {p.path} holds the "
                  f"run up to there; exit code {code}; {_to_continue(args)}",
                  file=sys.stderr, flush=True)
    except Exception as e:
        timeout, lost = timeout_message(e, cfg.dist_timeout if cfg else 0), lost_peer_message(e)
        if (timeout or lost) is None or args.debug:
            raise
        kept = list_checkpoints(cfg.output_dir) if cfg else []
        last = kept[-1] if kept else ""
        resume = f"Resume from {last}: run the job again with resume=auto" if last else \
            "No checkpoint was saved yet: run the job again"
        print(f"error: {timeout}; the last checkpoint is {last or 'none yet'}" if timeout else
              f"error: {lost}. {resume}", file=sys.stderr, flush=True)
        return 4
    shutdown()
    return code


def _to_continue(args: argparse.Namespace) -> str:
    """How to continue a stopped run: this command with resume=auto (under a launcher such as
    torchrun, the launcher's command)."""
    if "LOCAL_RANK" in os.environ:
        return "to continue, run the job again with resume=auto"
    words = ["python", "-m", "train_imagenet", *(["--config", args.config] if args.config else []),
             *(o for o in args.overrides if not o.startswith("resume=")), "resume=auto"]
    return f"to continue: {shlex.join(words)}"


if __name__ == "__main__":
    hold_after_stop()   # a second stop signal while this process ends leaves its exit code
    sys.exit(main())
