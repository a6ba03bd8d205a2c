"""The one shard verifier: the rules every reader of a WebDataset shard relies on, checked
by the trainer at start-up (`check_shards`) and by ``scripts/make_wds_shards.py --verify``
(`scan_shard` with ``decode=True``, plus the split's metadata).

A shard passes when its tar reads to its end-of-archive marker, each key occurs once (its
members consecutive, no extension twice: webdataset groups a sample by consecutive members
and stops on a repeated one), each sample holds exactly one image and one ``.cls`` member,
and every ``.cls`` is a class index in ASCII digits (``0_3`` is refused); label ranges are checked against the class count by the
callers. The start-up check reads only tar headers and the small ``.cls`` members (no image
is decoded), so a shard costs a few hundred small reads. Its result per shard is cached
beside the shards in ``.dcvit-shard-check.json`` (hidden, so never taken for a split's
``<split>.json``: `dcvit.schema.split_names`), keyed by the shard's name, size and
modification time, so a restarted run checks only what changed; where the shard folder is
read-only the cache goes to the run directory instead (``shard-check.json``).
"""
import json
import logging
import os
import re
import tarfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from webdataset.tariterators import base_plus_ext

from dcvit.io import write_json
from dcvit.schema import IMAGE_EXTENSIONS, LABEL_EXTENSION

__all__ = ["ShardCheck", "check_shards", "scan_shard", "CACHE_NAME"]

CACHE_NAME = ".dcvit-shard-check.json"
FALLBACK_NAME = "shard-check.json"
_VERSION = 3                         # 3: a label is ASCII digits only
_DIGITS = re.compile(rb"\s*-?\d+\s*")    # a minus is refused by the range check
_logger = logging.getLogger(__name__)


@dataclass
class ShardCheck:
    """What the shards hold: samples (an image and a label under one key), the label range,
    and the first problem found (a message naming the shard and the fix), if any."""
    num_samples: int = 0
    min_label: int = -1              # -1 when there is no sample
    max_label: int = -1
    problem: Optional[str] = None
    lengths: Optional[List[int]] = None   # samples of each shard, in the order given


def _decodes(data: bytes) -> Optional[str]:
    """None if the image decodes as the loader decodes it (`train_imagenet.images.open_image`),
    else why not."""
    from ..images import ImageError, open_image
    try:
        open_image(data)
    except ImageError as e:
        return str(e)
    return None


def scan_shard(path: str, decode: bool = False) -> Dict[str, Any]:
    """What one tar holds: {'samples': complete samples, 'labels': {label: count}, 'keys':
    [key, ...], 'problems': [message, ...]}. The messages name the key (not the shard); the
    first problem of a shard that does not read to its end says where it stops. With
    `decode`, every image is also decoded with PIL."""
    labels: Counter = Counter()
    keys: List[str] = []
    problems: List[str] = []
    members: Dict[str, Dict[str, Any]] = {}             # key -> {ext: label bytes or None}
    repeated = set()

    def close(key: Optional[str]) -> None:               # a sample's members all seen
        if key is None or key in repeated:
            return
        exts = sorted(members[key])
        images = [e for e in exts if e in IMAGE_EXTENSIONS]
        if len(images) != 1 or LABEL_EXTENSION not in exts:
            problems.append(f"key {key!r} holds {exts}; expected one image "
                            f"({'/'.join(IMAGE_EXTENSIONS)}) and {LABEL_EXTENSION}")
            return
        text = members[key][LABEL_EXTENSION]
        if not _DIGITS.fullmatch(text):   # int() would also take '0_3', '+3', '٣'
            problems.append(f"sample {key!r} has the label {text[:20]!r}, not an integer "
                            f"(ASCII digits only)")
            return
        labels[int(text)] += 1

    current = None
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
                if key != current:
                    close(current)
                    current = key
                    if key in members and key not in repeated:
                        repeated.add(key)
                        problems.append(f"key {key!r} occurs twice (again at member "
                                        f"{member.name!r}); each sample needs its own key")
                    members.setdefault(key, {})
                    keys.append(key)
                elif ext in members[key] and key not in repeated:
                    repeated.add(key)
                    problems.append(f"key {key!r} occurs twice (member {member.name!r} "
                                    f"repeats); each sample needs its own key")
                if ext == LABEL_EXTENSION:
                    members[key][ext] = tar.extractfile(member).read()
                else:
                    members[key][ext] = None
                    if decode and ext in IMAGE_EXTENSIONS and key not in repeated:
                        failure = _decodes(tar.extractfile(member).read())
                        if failure:
                            problems.append(f"key {key!r}: {ext} does not decode ({failure})")
            close(current)
            end = tar.offset                             # where the end-of-archive marker starts
        with open(path, "rb") as f:                      # a cut at a member boundary reads as a
            f.seek(end)                                  # shorter tar: require the marker
            if f.read(512) != bytes(512):
                raise tarfile.ReadError(f"no end-of-archive marker after byte {end} of "
                                        f"{size}: the file is truncated")
    except (tarfile.TarError, OSError, EOFError) as e:
        where = f"after key {keys[-1]!r}" if keys else "at its start"
        problems.insert(0, f"unreadable {where} ({type(e).__name__}: {e})")
    return {"samples": sum(labels.values()), "labels": dict(labels), "keys": keys,
            "problems": problems}


def _summary(scan: Dict[str, Any]) -> Dict[str, Any]:
    """The cached part of a scan: sample count, label range and the first problem."""
    values = list(scan["labels"])
    return {"samples": scan["samples"], "min_label": min(values) if values else None,
            "max_label": max(values) if values else None,
            "error": scan["problems"][0] if scan["problems"] else None}


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
        for shard, scan in zip(todo, _scan_all(todo)):
            found = {**_summary(scan), "stat": _stat_key(shard)}
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
    return ShardCheck(total, -1 if low is None else low, -1 if high is None else high,
                      lengths=[results[s]["samples"] for s in shards])
