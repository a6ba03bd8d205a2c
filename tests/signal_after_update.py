"""`python -m train_imagenet` whose rank sends a stop signal right after optimizer update N,
as SLURM or an operator would mid-epoch. Test-only.

    torchrun ... tests/signal_after_update.py WHO N [train_imagenet arguments]

WHO is `launcher` (rank 0 sends SIGTERM to its parent, the torchrun agent, which passes it
on to every rank), `rank1` (rank 1 sends SIGUSR1 to itself only; the ranks agree to stop) or
`node1` (rank 1 SIGKILLs its torchrun agent and itself: its node is lost outright) or
`twice-SIGNAME` (rank 0 sends itself SIGNAME twice, 50 ms apart, as SLURM and torchrun each
forward one). The trainer runs as `python -m train_imagenet` runs it (its `__main__`).
"""
import os
import runpy
import signal
import sys
import threading

import train_imagenet.engine as engine


def signal_after(who: str, update: int) -> None:
    real_step = engine.train_step
    rank = int(os.environ.get("RANK", "0"))

    def step(loop, batch, state):
        done = state.update
        state = real_step(loop, batch, state)
        if state.update == update != done:
            if who == "launcher" and rank == 0:
                os.kill(os.getppid(), signal.SIGTERM)
            elif who == "rank1" and rank == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            elif who == "node1" and rank == 1:
                os.kill(os.getppid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            elif who.startswith("twice-") and rank == 0:
                sig = signal.Signals[who[len("twice-"):]]
                os.kill(os.getpid(), sig)
                threading.Timer(0.05, os.kill, (os.getpid(), sig)).start()
        return state
    engine.train_step = step


if __name__ == "__main__":
    signal_after(sys.argv[1], int(sys.argv[2]))
    sys.argv = ["train_imagenet", *sys.argv[3:]]
    runpy.run_module("train_imagenet", run_name="__main__", alter_sys=True)
