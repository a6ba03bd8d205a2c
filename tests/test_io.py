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
