"""`python -m train_imagenet` as a worker killed mid-epoch: on torchrun's first attempt every
rank exits hard (`os._exit`: no cleanup, no save, like a SIGKILL) right after optimizer update
N; a restarted attempt (TORCHELASTIC_RESTART_COUNT > 0) trains normally. Test-only.

    torchrun --max-restarts=1 ... tests/exit_after_update.py N [train_imagenet arguments]
"""
import os
import sys

import train_imagenet.engine as engine
from train_imagenet.__main__ import main

EXIT_CODE = 17


def exit_after(update: int) -> None:
    """Wraps the training step: the one that completes update `update` exits the process."""
    real_step = engine.train_step

    def step(loop, batch, state):
        done = state.update
        state = real_step(loop, batch, state)
        if state.update == update != done:
            print(f"rank {os.environ.get('RANK', 0)}: exiting hard after update {update} "
                  f"(simulated failure)", file=sys.stderr, flush=True)
            os._exit(EXIT_CODE)
        return state
    engine.train_step = step


if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        exit_after(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
