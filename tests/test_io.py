"""dcvit.io: atomic writes."""
import os
import stat

import pytest

from dcvit.io import atomic_write, write_json


def test_write_json_creates_parents_and_usual_permissions(tmp_path):
    path = write_json(tmp_path / "a" / "b.json", {"x": 1})
    assert path.read_text() == '{\n  "x": 1\n}\n'
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask


def test_failed_write_leaves_old_file_and_no_temporary(tmp_path):
    path = write_json(tmp_path / "r.json", {"old": True})

    def broken(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, broken)
    assert path.read_text().startswith('{\n  "old": true')
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_checkpoint_save_syncs_the_file_then_its_directory_after_the_rename(tmp_path, monkeypatch):
    """POSIX durability: the file's bytes are synced before the rename and the directory (the
    rename itself) after it, so a power loss cannot take the new name away."""
    import torch

    from train_imagenet.checkpoint import save_checkpoint
    real_fsync, synced = os.fsync, []

    def fsync(fd):
        st = os.fstat(fd)
        synced.append(("dir" if stat.S_ISDIR(st.st_mode) else "file",
                       sorted(p.name for p in tmp_path.iterdir())))
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    path = save_checkpoint({"model": {"w": torch.ones(4)}, "epoch": 1, "update": 3}, str(tmp_path))
    name = os.path.basename(path)
    kinds = [kind for kind, _ in synced]
    assert kinds == ["file", "dir"], synced
    assert name not in synced[0][1] and synced[1][1] == [name]     # before and after the rename
    synced.clear()
    write_json(tmp_path / "eval.json", {"top1": 1.0})
    assert [kind for kind, _ in synced][-1:] == ["dir"] and "eval.json" in synced[-1][1]
