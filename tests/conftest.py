"""Session setup and fixtures shared by every test file.

Without a CUDA device the Triton kernels run in Triton's interpreter on CPU tensors: the
interpreter is chosen before triton is first imported, and the Triton core is registered
for CPU tensors here (`dcvit.bench.gpu_kernels.triton_on_cpu`; the library registers it for
CUDA only). With CUDA the tests run the
Triton core on CUDA tensors (`attention_cores.device_for`).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from dcvit.bench.gpu_kernels import triton_on_cpu
    triton_on_cpu()


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_threads():
    """Training runs set torch's thread count (`threads=1`); each test module ends with the
    count it started with, whatever its tests and module fixtures set."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def digits_shards(tmp_path_factory):
    """`digits_shards(n_train, n_val, train_per_shard, val_per_shard)`: train/val WebDataset
    shards of the digits in one directory, written once per session for each size and only
    read by the tests (see train_helpers.write_digits_split)."""
    from train_helpers import write_digits_split
    made = {}

    def get(n_train=96, n_val=53, train_per_shard=24, val_per_shard=20):
        key = (n_train, n_val, train_per_shard, val_per_shard)
        if key not in made:
            root = tmp_path_factory.mktemp("digits_{}_{}_{}_{}".format(*key))
            made[key] = write_digits_split(str(root), *key)
        return made[key]
    return get
