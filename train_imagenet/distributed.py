"""torch.distributed from torchrun's environment: gloo on CPU, NCCL on GPU; one process without it.

Every collective waits at most ``dist_timeout`` seconds for the other ranks (the process
group's timeout). What the ranks are waiting for is kept in `waiting_for` (set by the
callers: the start-up checks, a loss check or gradient all-reduce of an update, an
evaluation, a save), so a collective that times out (a rank stopped, hung or lost) ends the
run with one line naming the rank and that (`timeout_message`), not a hang. A peer whose
process or node is gone (gloo: "Connection reset by peer") ends it with one line naming the
lost rank, found from the table of every rank's host and process id gathered at start-up
(`lost_peer_message`).
"""
import datetime
import os
import re
import socket
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "init_distributed", "log_main", "barrier", "broadcast_object", "all_gather_object",
           "all_reduce_mean", "any_rank", "shutdown", "waiting_for", "timeout_message",
           "lost_peer_message"]

# for the one-line messages: this rank, what it waits for, every rank's (host, pid); and the
# group of the host-side flags (`any_rank`): the default group on gloo, a gloo group beside NCCL
_group: Dict[str, Any] = {"rank": 0, "what": "the start-up", "peers": [], "host_group": None}
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "Connection refused", "ECONNRESET", "EPIPE")


def waiting_for(what: str) -> None:
    """Names what the next collectives of this rank wait for (for `timeout_message`)."""
    _group["what"] = what


def timeout_message(e: BaseException, timeout_s: float) -> Optional[str]:
    """One line for a collective that timed out (gloo: "Timed out waiting ...", NCCL: a
    DistBackendError), naming this rank and what it waited for; None for other errors."""
    text = str(e)
    timed_out = isinstance(e, getattr(dist, "DistBackendError", ())) and "timeout" in text.lower()
    if not (timed_out or (isinstance(e, RuntimeError) and "Timed out waiting" in text)):
        return None
    return (f"rank {_group['rank']} waited more than dist_timeout={timeout_s:g} s for "
            f"the other ranks in {_group['what']}: a rank stopped, hung or was lost. Restart the "
            f"run (resume=auto continues from its last checkpoint); raise dist_timeout if that "
            f"step legitimately takes longer")


def _gone(pid: int) -> bool:
    """Whether process `pid` of this host has ended (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _lost_ranks(text: str) -> Tuple[List[int], str]:
    """The ranks whose process has ended (those on this host, by process id) or, for ranks on
    other hosts, those of the host the error names; and how they were found, in words."""
    peers: List[Tuple[str, int]] = _group["peers"]
    here = socket.gethostname()
    lost = [r for r, (host, pid) in enumerate(peers) if host == here and r != _group["rank"]
            and _gone(pid)]
    if lost:
        return lost, "process ended"
    match = re.search(r"\[([^\]]+)\]:\d+|(\d+\.\d+\.\d+\.\d+):\d+", text)
    addr = (match.group(1) or match.group(2)) if match else None
    by_host: Dict[str, List[int]] = {}
    for r, (host, _) in enumerate(peers):
        if host != here:
            by_host.setdefault(host, []).append(r)
    for host, ranks in by_host.items():
        try:
            if addr and addr in {a[4][0] for a in socket.getaddrinfo(host, None)}:
                return ranks, f"host {host}"
        except OSError:
            continue
    others = [r for hosts in by_host.values() for r in hosts]
    return others, "on another host" if others else "unknown"


def lost_peer_message(e: BaseException) -> Optional[str]:
    """One line for a collective that failed because a peer's process or node is gone (gloo's
    "Connection reset by peer" and the like): this rank, the lost rank(s) and what this rank
    was doing; None for other errors."""
    text = str(e)
    if not (_group["peers"] and isinstance(e, RuntimeError) and any(k in text for k in _PEER_GONE)):
        return None
    lost, how = _lost_ranks(text)
    peers = _group["peers"]
    names = ", ".join(f"rank {r} (pid {peers[r][1]} on {peers[r][0]})" for r in lost[:8]) + \
        (f" and {len(lost) - 8} more" if len(lost) > 8 else "")
    who = names if lost else "a peer rank"
    return (f"rank {_group['rank']} lost {who} in {_group['what']} ({how}): its process or node "
            f"stopped")


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


def init_distributed(device: str = "auto", timeout_s: float = 3600) -> DistInfo:
    """Reads RANK/WORLD_SIZE/LOCAL_RANK (set by torchrun); initialises the process group,
    whose collectives wait at most `timeout_s` seconds."""
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
        timeout = datetime.timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group("nccl" if want_cuda else "gloo",
                                store=dist.PrefixStore(f"train_imagenet/attempt_{attempt}", store),
                                rank=rank, world_size=world, device_id=dev if want_cuda else None,
                                timeout=timeout)
        if want_cuda:   # `any_rank`'s flags stay on the host
            _group["host_group"] = dist.new_group(backend="gloo", timeout=timeout)
        peers: List[Any] = [None] * world
        dist.all_gather_object(peers, (socket.gethostname(), os.getpid()),
                               group=_group["host_group"])
        _group["peers"] = peers
    _group["rank"] = rank
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


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank: one all-reduce of one integer on the host (gloo, so
    it never waits for a GPU), none when this process is alone."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group["host_group"])
    return bool(t.item())


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
