"""Stopping on a signal with a checkpoint: SIGTERM (what SLURM and torchrun send before they
kill), SIGUSR1 (``sbatch --signal=USR1@SECONDS``), SIGHUP (a closed terminal; torchrun passes it
on) or SIGINT (Ctrl-C) asks the run to stop. The run then exits with `EXIT_PREEMPTED` (75), or
`EXIT_INTERRUPTED` (130, as a shell reports Ctrl-C) when the signal was SIGINT (`exit_code`).

`StopOnSignal` installs the handlers while training runs; a handler only records the signal.
After every optimizer update the ranks agree whether any of them received one (`agreed`: one
all-reduce of a flag on the host, bounded by ``dist_timeout`` like every collective), so all
of them stop after the same update: the update in progress finishes, rank 0 writes the
checkpoint, and the run exits with `exit_code`. A signal that arrives during an
evaluation or a save is acted on when it ends (the epoch's checkpoint is written before its
evaluation). Once agreed, the answer stays yes. In the process that runs the trainer as its
program (`hold_after_stop`), a signal that follows the one acted on (SLURM and torchrun each
forward one; a second Ctrl-C) is ignored until the process exits, so that it exits with its
code instead of being killed by the second signal (status 143 or 130 lost to a requeue script).

The loaders' worker processes are started with these signals blocked (`shielded`): torchrun
and SLURM signal a rank's whole process group, and a DataLoader worker ends on SIGTERM, which
would end the epoch with an error instead of a checkpoint. The workers still end with their
rank.
"""
import signal
from typing import Any, Dict, Iterable, Iterator, Optional

from .distributed import any_rank, waiting_for

__all__ = ["EXIT_PREEMPTED", "EXIT_INTERRUPTED", "SIGNALS", "Preempted", "StopOnSignal",
           "agreed", "exit_code", "hold_after_stop", "received", "shielded"]

EXIT_PREEMPTED = 75                  # sysexits' EX_TEMPFAIL: stopped, to be run again
EXIT_INTERRUPTED = 130               # 128 + SIGINT: stopped by Ctrl-C, as a shell reports it
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)

_state: Dict[str, Any] = {"signal": None, "agreed": False, "hold": False}


class Preempted(Exception):
    """The ranks stopped on a signal after update `update`; `path` is the checkpoint that holds
    everything up to it."""

    def __init__(self, epoch: int, batch: int, update: int, totals: Any = None, path: str = ""):
        super().__init__(f"stopped at epoch {epoch}, batch {batch}, update {update}")
        self.epoch, self.batch, self.update, self.totals, self.path = epoch, batch, update, totals, path


def _record(signum: int, frame: Any) -> None:
    if _state["signal"] is None:
        _state["signal"] = signum


class StopOnSignal:
    """``with StopOnSignal():`` the signals of `SIGNALS` are recorded instead of ending the
    process; the previous handlers come back on exit."""

    def __enter__(self) -> "StopOnSignal":
        _state.update(signal=None, agreed=False)
        self.previous = {sig: signal.signal(sig, _record) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        stopping = _state["hold"] and _state["signal"] is not None
        for sig, handler in self.previous.items():
            signal.signal(sig, signal.SIG_IGN if stopping else handler)


def hold_after_stop() -> None:
    """For the process that runs the trainer as its program: once a stop signal was received,
    `StopOnSignal` leaves the stop signals ignored until the process exits."""
    _state["hold"] = True


def received() -> Optional[str]:
    """The name of the signal this process received (None if none)."""
    sig = _state["signal"]
    return None if sig is None else signal.Signals(sig).name


def exit_code() -> int:
    """The exit code of a run stopped by a signal: `EXIT_INTERRUPTED` after SIGINT (Ctrl-C)
    to this process, else `EXIT_PREEMPTED` (also on a rank stopped by another's signal)."""
    return EXIT_INTERRUPTED if _state["signal"] == signal.SIGINT else EXIT_PREEMPTED


def agreed(epoch: int, update: int) -> bool:
    """Whether any rank received a stop signal (a collective: every rank calls it at the same
    point). Sticky: once true it is true without asking again."""
    if not _state["agreed"]:
        waiting_for(f"the check for a stop signal after epoch {epoch}, update {update}")
        _state["agreed"] = any_rank(_state["signal"] is not None)
    return _state["agreed"]


def shielded(loader: Iterable[Any]) -> Iterator[Any]:
    """Iterates `loader`, whose worker processes start (when `iter` is called) with the stop
    signals blocked, so that they inherit the blocked set; a signal to this process in the
    meantime waits, and is handled when the set is restored."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        batches = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    yield from batches
