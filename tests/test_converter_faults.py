"""Faults of the converter (dcvit-shards) found by trying to break it as a user would: each
ends as a refusal (exit 2, naming the cause and the fix) before any shard is replaced, or is
handled with nothing lost. The cases, what the code did before and what it does now, are the
table of tests/converter_fault_cases.py, which reproduces them.

The tests run as root, who can read any file, so an unreadable source file is simulated by
making ``Path.read_bytes`` raise ``PermissionError`` for one file, and by a FIFO named like an
image (no regular file).
"""
import io
import json
import multiprocessing as mp
import os
import signal
import tarfile
from pathlib import Path

import pytest

from dcvit.schema import split_names
from train_helpers import digits, png_bytes
from train_imagenet.data import verify as shard_check
from train_imagenet.data import DataError, count_samples, resolve_source

from test_make_wds_shards import SCRIPT, _digests, _run
from train_imagenet.shards import plan, write


def _source(root: Path, per_class: int = 4, classes: int = 3, offset: int = 0) -> Path:
    """root/<digit>/<i>.png: the digits 0..classes-1, `per_class` each, from `offset` on."""
    x, y = digits()
    for c in range(classes):
        (root / str(c)).mkdir(parents=True)
        picks = [i for i in range(len(y)) if y[i] == c][offset:offset + per_class]
        for i in picks:
            (root / str(c) / f"{i}.png").write_bytes(png_bytes(x[i]))
    return root


def _labels(out: Path, split: str = "train") -> dict:
    """{key: label} of a split, read back with the verifier's own tar scan."""
    meta = json.loads((out / f"{split}.json").read_text())
    found = {}
    for shard in meta["shards"]:
        with tarfile.open(out / shard) as tar:
            for m in tar:
                if m.name.endswith(".cls"):
                    found[m.name[:-4]] = int(tar.extractfile(m).read())
    return found


def _error(capsys, *argv) -> str:
    assert _run(*argv) == 2
    return capsys.readouterr().err


# ----------------------------------------------------------------------------- links
@pytest.mark.parametrize("link, target", [("1/loop", ".."), ("1/zeros", "../0"),
                                          ("1/again", "."), ("3", "1")])
def test_link_that_reaches_a_folder_twice_is_refused(tmp_path, capsys, link, target):
    src = _source(tmp_path / "src")
    os.symlink(target, src / link)
    err = _error(capsys, "--src", src, "--out", tmp_path / "out")
    assert f"{src / link} -> " in err and "already read as" in err and "remove or fix" in err
    assert not list(tmp_path.glob("out/*.tar"))


def test_two_links_to_one_file_are_refused(tmp_path, capsys):
    src = _source(tmp_path / "src")
    first = sorted((src / "2").iterdir())[0]
    os.symlink(first, src / "0" / "copy.png")
    err = _error(capsys, "--src", src, "--out", tmp_path / "out")
    assert f"{src / '0' / 'copy.png'} -> {first}: already read as {first}" in err
    os.symlink(first, src / "1" / "copy.png")
    err = _error(capsys, "--src", src, "--out", tmp_path / "out")
    assert f"{src / '1' / 'copy.png'} -> {first}: already read as {src / '0' / 'copy.png'}" in err


def test_links_out_of_the_source_are_followed_once_with_the_folder_label(tmp_path):
    """A class folder linked from elsewhere and a folder of extra images linked into a class:
    every file once, labelled by the class folder it is listed in."""
    store = _source(tmp_path / "store", per_class=3, offset=10)
    src = _source(tmp_path / "src", per_class=2, classes=2)
    os.symlink(store / "2", src / "2")            # class 2 lives elsewhere
    os.symlink(store / "1", src / "1" / "more")   # extra ones, in a sub-folder of class 1
    assert _run("--src", src, "--out", tmp_path / "out", "--workers", 1) == 0
    labels = _labels(tmp_path / "out")
    assert len(labels) == 2 * 2 + 3 + 3
    assert sorted(k for k, v in labels.items() if v == 1) == sorted(
        [f"1__{p.stem}" for p in (src / "1").glob("*.png")] + [f"1__more__{p.stem}" for p in (store / "1").iterdir()])
    assert sorted(k for k, v in labels.items() if v == 2) == sorted(f"2__{p.stem}" for p in (store / "2").iterdir())


@pytest.mark.parametrize("where", ["1/gone.png", "gone"])
def test_dangling_link_is_refused_naming_it(tmp_path, capsys, where):
    src = _source(tmp_path / "src")
    os.symlink(tmp_path / "nowhere.png", src / where)
    err = _error(capsys, "--src", src, "--out", tmp_path / "out")
    assert f"{src / where} -> {tmp_path / 'nowhere.png'}: the link's target does not exist" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- unreadable files
def test_unreadable_file_stops_with_its_name_and_keeps_the_previous_split(tmp_path, capsys, monkeypatch):
    src = _source(tmp_path / "src")
    out = tmp_path / "out"
    assert _run("--src", src, "--out", out, "--shard-size", 5) == 0
    before = _digests(out), (out / "train.json").read_bytes()
    victim = sorted((src / "2").iterdir())[1]
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")) if self == victim else real(self))
    err = _error(capsys, "--src", src, "--out", out, "--shard-size", 3, "--workers", 1)
    assert f"cannot read {victim} (Permission denied); make it readable" in err
    assert (_digests(out), (out / "train.json").read_bytes()) == before
    assert not [p for p in out.iterdir() if ".tmp" in p.name]


def test_image_name_that_is_no_regular_file_is_refused_before_writing(tmp_path, capsys):
    src = _source(tmp_path / "src")
    os.mkfifo(src / "1" / "pipe.png")  # reading it would wait forever
    err = _error(capsys, "--src", src, "--out", tmp_path / "out")
    assert f"{src / '1' / 'pipe.png'} is not a regular file" in err


# ----------------------------------------------------------------------------- split and source
def test_val_folder_without_split_becomes_val_and_leaves_train(tmp_path, capsys):
    data = tmp_path / "digits"
    _source(data / "train")
    _source(data / "val", offset=4)
    out = tmp_path / "out"
    assert _run("--src", data / "train", "--out", out) == 0
    train = _digests(out), (out / "train.json").read_bytes()
    assert _run("--src", data / "val", "--out", out, "--classes", out / "classes.json") == 0
    assert "--split val (from the name of --src" in capsys.readouterr().err
    assert (_digests(out)["train-000000.tar"], (out / "train.json").read_bytes()) == (train[0]["train-000000.tar"], train[1])
    assert json.loads((out / "val.json").read_text())["num_samples"] == 12
    assert plan.infer_split("ILSVRC2012_img_val") == "val"
    assert plan.infer_split("validation") == "val" and plan.infer_split("images") is None
    both = tmp_path / "train_val"
    _source(both)
    assert "pass --split NAME" in _error(capsys, "--src", both, "--out", tmp_path / "o2")


def test_other_source_needs_overwrite_and_same_source_reruns(tmp_path, capsys):
    a, b = _source(tmp_path / "a"), _source(tmp_path / "b", per_class=2, offset=8)
    out = tmp_path / "out"
    assert _run("--src", a, "--out", out, "--split", "train") == 0
    kept = _digests(out), (out / "train.json").read_bytes()
    err = _error(capsys, "--src", b, "--out", out, "--split", "train")
    assert f"already holds a train split (12 samples) made from {a}" in err and "--overwrite" in err
    assert (_digests(out), (out / "train.json").read_bytes()) == kept
    assert _run("--src", a, "--out", out, "--split", "train") == 0       # the same conversion again
    assert (_digests(out), (out / "train.json").read_bytes()) == kept    # byte for byte
    assert _run("--src", b, "--out", out, "--split", "train", "--overwrite") == 0
    assert json.loads((out / "train.json").read_text())["num_samples"] == 6

    (out / "train.json").unlink()                                        # shards of unknown origin
    err = _error(capsys, "--src", a, "--out", out, "--split", "train")
    assert "without train.json" in err and "--overwrite" in err


# ----------------------------------------------------------------------------- one writer per folder
def _hold_lock(out: str, ready, release) -> None:
    from train_imagenet.run_lock import RunLock
    lock = RunLock(out).acquire()
    ready.set()
    release.wait(60)
    lock.release()


def test_second_conversion_into_a_folder_in_use_is_refused(tmp_path, capsys):
    src, out = _source(tmp_path / "src"), tmp_path / "out"
    assert _run("--src", src, "--out", out) == 0
    kept = _digests(out)
    ctx = mp.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(out), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        err = _error(capsys, "--src", src, "--out", out, "--overwrite")
        assert f"--out {out} is in use by another conversion (pid {holder.pid} on " in err
        assert _digests(out) == kept
    finally:
        release.set()
        holder.join(30)
    assert _run("--src", src, "--out", out) == 0  # the lock went with its holder


# ----------------------------------------------------------------------------- one verifier
def test_verify_after_the_trainers_start_up_check(tmp_path, capsys):
    src, out = _source(tmp_path / "src"), tmp_path / "out"
    assert _run("--src", src, "--out", out) == 0
    check = shard_check.check_shards(sorted(str(p) for p in out.glob("train-*.tar")), "data.train", 3)
    assert check.problem is None and (out / shard_check.CACHE_NAME).exists()
    assert split_names(str(out)) == ["train"]
    assert _run("--verify", out) == 0
    other = tmp_path / "other"
    (other / "x").mkdir(parents=True)
    (other / "x" / "0.png").write_bytes(png_bytes(digits(1)[0][0]))
    err = _error(capsys, "--src", other, "--out", out, "--split", "val")
    assert "used by split(s) ['train']" in err


def _rewrite(shard: Path, edit) -> None:
    """Rewrites `shard` with its (member, bytes) list passed through `edit`."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for m, data in edit(members):
            m.size = len(data)
            tar.addfile(m, io.BytesIO(data))


@pytest.mark.parametrize("edit, message", [
    (lambda ms: ms[:2] + ms, "occurs twice (member"),                        # adjacent: webdataset stops
    (lambda ms: ms + ms[:2], "occurs twice (again at member"),               # apart: a sample counted twice
    (lambda ms: [(m, d) for m, d in ms if not m.name.endswith(".cls")][:1] + ms[2:],
     "expected one image"),                                                  # no label
])
def test_the_start_up_check_and_verify_refuse_the_same_shard(tmp_path, capsys, edit, message):
    src, out = _source(tmp_path / "src"), tmp_path / "out"
    assert _run("--src", src, "--out", out, "--shard-size", 5, "--no-shuffle", "--split", "val") == 0
    _rewrite(out / "val-000001.tar", edit)
    with pytest.raises(DataError) as exc:
        count_samples(resolve_source(str(out), "data.val"), "data.val", 3)
    assert "val-000001.tar' is broken: key " in str(exc.value) and message in str(exc.value)
    assert _run("--verify", out) == 1
    err = capsys.readouterr().err
    assert "val-000001.tar: key " in err and message in err


# ----------------------------------------------------------------------------- Ctrl-C
@pytest.fixture
def sigint_handled():
    """SIGINT raises KeyboardInterrupt, as in a terminal's process. A shell starts background
    jobs (``pytest ... &``) with SIGINT ignored, and Python and its children keep it so: there
    the Ctrl-C tests would test nothing and fail."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_the_split_is_moved_in_waits_for_it(tmp_path, monkeypatch, sigint_handled):
    """SIGINT arriving while the new shards replace the old ones is held until the new split
    is complete: the command reports the interrupt, the folder holds one whole split."""
    src, out = _source(tmp_path / "src"), tmp_path / "out"
    assert _run("--src", src, "--out", out, "--shard-size", 2) == 0
    real = write.write_json

    def interrupted(path, data):
        if Path(path).name == "classes.json":
            os.kill(os.getpid(), signal.SIGINT)  # lands between the shard moves and train.json
        return real(path, data)

    monkeypatch.setattr(write, "write_json", interrupted)
    assert _run("--src", src, "--out", out, "--shard-size", 5) == 130
    monkeypatch.undo()
    assert json.loads((out / "train.json").read_text())["samples_per_shard"] == [5, 5, 2]
    assert _run("--verify", out) == 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_with_workers_then_rerun(tmp_path):
    """A real SIGINT to the converter's process group (as a terminal's Ctrl-C) while two
    workers write: exit 130, the previous split intact, and a rerun completes."""
    import subprocess
    import sys
    import textwrap
    src, out = _source(tmp_path / "src", per_class=10), tmp_path / "out"
    assert _run("--src", src, "--out", out, "--shard-size", 4) == 0
    kept = _digests(out), (out / "train.json").read_bytes()
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)   # as a terminal's process
        from train_imagenet.shards import cli, write as mws
        real, calls = mws.encode_image, [0]
        def interrupting(*a):
            calls[0] += 1
            if calls[0] == 3:
                os.killpg(0, signal.SIGINT)
                time.sleep(2)
            return real(*a)
        mws.encode_image = interrupting
        sys.exit(cli.main(["--src", {str(src)!r}, "--out", {str(out)!r}, "--shard-size", "3",
                           "--workers", "2", "--no-progress"]))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         start_new_session=True, env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])})
    assert run.returncode == 130, run.stderr
    assert "interrupted" in run.stderr and "Traceback" not in run.stderr
    assert (_digests(out), (out / "train.json").read_bytes()) == kept
    assert not [p for p in out.iterdir() if ".tmp" in p.name]
    assert _run("--src", src, "--out", out, "--shard-size", 3) == 0
    assert json.loads((out / "train.json").read_text())["num_samples"] == 30 and _run("--verify", out) == 0
