"""The attention cores the tests run on one machine, and the device each runs on.

The Triton core runs on CUDA tensors; without CUDA the tests run it in Triton's interpreter
on CPU tensors (conftest.py registers it for them). A test that runs every core puts the
model and its inputs on `device_for(core)`, so it runs the same on both kinds of machine.
"""
import os

import torch

from dcvit.kernels import compose_cpu, triton_core

CUDA = torch.cuda.is_available()

# reference and compile everywhere; cpp where built; triton on CUDA or in the interpreter.
CORES = (["reference", "compile"] + (["cpp"] if compose_cpu.available() else [])
         + (["triton"] if triton_core.available() and (CUDA or os.environ.get("TRITON_INTERPRET") == "1") else []))


def device_for(core: str) -> torch.device:
    """Where ``core`` runs in the tests: CUDA for the Triton core when there is a GPU, else CPU."""
    return torch.device("cuda") if core == "triton" and CUDA else torch.device("cpu")
