"""The start-up check of local WebDataset shards: each tar reads to its end and every label
is an integer in ``[0, num_classes)``.

Only tar headers and the small ``.cls`` members are read (no image is decoded), so a shard
costs a few hundred small reads. The result of each shard is cached beside the shards in
``.dcvit-shard-check.json``, keyed by the shard's name, size and modification time, so a
restarted run checks only what changed; where the shard folder is read-only the cache goes
to the run directory instead (``shard-check.json``).
"""
import json
import logging
import os
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from webdataset.tariterators import base_plus_ext

from dcvit.io import write_json
from dcvit.schema import IMAGE_EXTENSIONS, LABEL_EXTENSION

__all__ = ["ShardCheck", "check_shards", "scan_shard", "CACHE_NAME"]

CACHE_NAME = ".dcvit-shard-check.json"
FALLBACK_NAME = "shard-check.json"
_VERSION = 1
_logger = logging.getLogger(__name__)


@dataclass
class ShardCheck:
    """What the shards hold: samples (an image and a label under one key), the label range,
    and the first problem found (a message naming the shard and the fix), if any."""
    num_samples: int = 0
    min_label: int = -1              # -1 when there is no sample
    max_label: int = -1
    problem: Optional[str] = None


def scan_shard(path: str) -> Dict[str, Any]:
    """{'samples', 'min_label', 'max_label', 'error'} of one tar; `error` names the first
    problem (unreadable tar, a label that is no integer) or is None."""
    out: Dict[str, Any] = {"samples": 0, "min_label": None, "max_label": None, "error": None}
    images, labels = set(), {}
    last = None
    try:
        size = os.path.getsize(path)
        with tarfile.open(path) as tar:
            for member in tar:
                if member.offset_data + member.size > size:  # tarfile stops quietly there
                    raise tarfile.ReadError(f"member {member.name!r} ends at byte "
                                            f"{member.offset_data + member.size} of a {size}-byte "
                                            f"file: the file is truncated")
                if not member.isfile():
                    continue
                key, ext = base_plus_ext(member.name)   # WebDataset's key/extension split
                if key is None:
                    continue
                ext = ext.lower()
                last = key
                if ext == LABEL_EXTENSION:
                    labels[key] = tar.extractfile(member).read()
                elif ext in IMAGE_EXTENSIONS:
                    images.add(key)
            end = tar.offset                             # where the end-of-archive marker starts
        with open(path, "rb") as f:                      # a cut at a member boundary reads as a
            f.seek(end)                                  # shorter tar: require the marker
            if f.read(512) != bytes(512):
                raise tarfile.ReadError(f"no end-of-archive marker after byte {end} of "
                                        f"{size}: the file is truncated")
    except (tarfile.TarError, OSError, EOFError) as e:
        where = f"after key {last!r}" if last else "at its start"
        out["error"] = f"unreadable {where} ({type(e).__name__}: {e})"
        return out
    values = []
    for key in sorted(images & set(labels)):
        text = labels[key]
        try:
            values.append(int(text.decode("ascii").strip()))
        except (UnicodeDecodeError, ValueError):
            out["error"] = f"sample {key!r} has the label {text[:20]!r}, not an integer"
            return out
    out["samples"] = len(values)
    if values:
        out["min_label"], out["max_label"] = min(values), max(values)
    return out


def _stat_key(path: str) -> List[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def _read_cache(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(cache, dict) or cache.get("version") != _VERSION:
        return {}
    entries = cache.get("shards")
    return entries if isinstance(entries, dict) else {}


def _write_cache(path: str, entries: Dict[str, Any]) -> bool:
    try:
        write_json(path, {"version": _VERSION, "shards": entries})
    except OSError:
        return False
    return True


def _scan_all(paths: List[str]) -> List[Dict[str, Any]]:
    if len(paths) <= 1:
        return [scan_shard(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(16, len(paths))) as pool:  # I/O bound
        return list(pool.map(scan_shard, paths))


def check_shards(shards: List[str], key: str, num_classes: int,
                 fallback_dir: Optional[str] = None) -> ShardCheck:
    """Checks every shard (cached results where a shard is unchanged); `problem` names the
    first bad shard, its sample and the fix."""
    groups: Dict[str, List[str]] = {}
    for shard in shards:
        groups.setdefault(os.path.dirname(os.path.abspath(shard)), []).append(shard)
    fallback = os.path.join(fallback_dir, FALLBACK_NAME) if fallback_dir else None
    outside = _read_cache(fallback) if fallback else {}       # keyed by absolute path
    results: Dict[str, Dict[str, Any]] = {}
    for folder, members in groups.items():
        local = os.path.join(folder, CACHE_NAME)
        inside = _read_cache(local)                            # keyed by file name
        todo = []
        for shard in members:
            for entry in (inside.get(os.path.basename(shard)), outside.get(os.path.abspath(shard))):
                if isinstance(entry, dict) and entry.get("stat") == _stat_key(shard):
                    results[shard] = entry
                    break
            else:
                todo.append(shard)
        if not todo:
            continue
        for shard, found in zip(todo, _scan_all(todo)):
            found["stat"] = _stat_key(shard)
            results[shard] = inside[os.path.basename(shard)] = found
        if not (os.access(folder, os.W_OK) and _write_cache(local, inside)) and fallback:
            outside.update({os.path.abspath(s): results[s] for s in todo})
            _write_cache(fallback, outside)
    total, low, high, where = 0, None, None, ""
    for shard in shards:
        r = results[shard]
        if r.get("error"):
            return ShardCheck(problem=f"{key}: shard {shard!r} is broken: {r['error']}; re-write "
                                      f"it with scripts/make_wds_shards.py (or leave it out of {key})")
        total += r["samples"]
        if not r["samples"]:
            continue
        if r["min_label"] < 0:
            return ShardCheck(problem=f"{key}: shard {shard!r} holds the label {r['min_label']}; "
                                      f"labels are class indices 0..data.num_classes-1: fix its "
                                      f".cls members")
        low = r["min_label"] if low is None else min(low, r["min_label"])
        if high is None or r["max_label"] > high:
            high, where = r["max_label"], shard
    if high is not None and high >= num_classes:
        return ShardCheck(total, low, high, f"{key} has {high + 1} classes (labels 0..{high}, e.g. "
                          f"in shard {where!r}) but data.num_classes={num_classes}; set "
                          f"data.num_classes={high + 1}")
    return ShardCheck(total, -1 if low is None else low, -1 if high is None else high)
