"""torch.distributed from torchrun's environment: gloo on CPU, NCCL on GPU; one process without it."""
import os
import sys
from dataclasses import dataclass
from typing import Any, List

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "init_distributed", "log_main", "barrier", "broadcast_object", "all_gather_object",
           "all_reduce_mean", "shutdown"]


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto") -> DistInfo:
    """Reads RANK/WORLD_SIZE/LOCAL_RANK (set by torchrun); initialises the process group."""
    want_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but no CUDA device is visible; use device=cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if want_cuda:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        # torchrun can hand restarted workers the store of the failed attempt, where the dead
        # peers' addresses are still registered ("Connection refused" in Gloo's connectFullMesh);
        # keys under a per-attempt prefix are only ever those of live peers
        store, _, _ = next(dist.rendezvous("env://"))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group("nccl" if want_cuda else "gloo",
                                store=dist.PrefixStore(f"train_imagenet/attempt_{attempt}", store),
                                rank=rank, world_size=world, device_id=dev if want_cuda else None)
    return DistInfo(rank, world, local, dev)


def log_main(info: DistInfo, msg: str) -> None:
    """A progress message on rank 0's stderr."""
    if info.is_main:
        print(f"[train_imagenet] {msg}", file=sys.stderr, flush=True)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> List[Any]:
    if not dist.is_initialized():
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if not dist.is_initialized():
        return t
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
