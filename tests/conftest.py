"""Session setup shared by every test file.

Without a CUDA device the Triton kernels run in Triton's interpreter on CPU tensors; the
interpreter must be chosen before triton is first imported (importing dcvit imports it).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
