#!/usr/bin/env python
"""Reproduce the converter's fault cases against a checkout and print one table row per case.

    python tests/converter_fault_cases.py [REPO_ROOT]     (default: this checkout)

Each case runs ``scripts/make_wds_shards.py`` (the ``dcvit-shards`` command) of REPO_ROOT
(with ``PYTHONPATH=REPO_ROOT``) in a fresh temporary folder on a small digits ImageFolder (3
classes, 8 images a class and split; 40 a class for the two-conversions case, 20 for
Ctrl-C) and reports what a user would see: the exit status, the last line of stderr and
what is on disk afterwards. Interrupts and unreadable files are injected in a child process
(a real SIGINT to the converter's process group from inside a worker at its 25th image, as
a terminal sends it to every process of the command; ``PermissionError`` from reading one
file, since the tests run as root, who can read any file). The tests of each "after" are in
tests/test_converter_faults.py.

"Before" is the converter before these cases were fixed, "after" the code now:

| case | before | after |
|---|---|---|
| symlink loop `ln -s .. SRC/1/loop`, then `--verify` | exit 0: 984 samples written from 24 files (the images of classes 0 and 2 reached through `1/loop/…` labelled 1); `--verify` OK | exit 2 before writing: `SRC/1/loop -> SRC: already read as SRC`; the same for a link into another class folder, a class folder linked to another, two links to one file. Links to folders and files outside `--src` are followed, each file once, labelled by the class folder it is listed in |
| dangling symlink `SRC/1/gone.png` | exit 1, `FileNotFoundError` traceback | exit 2 before writing: `SRC/1/gone.png -> /nonexistent/x.png: the link's target does not exist` |
| `--src digits/val --out DIR` (no `--split`), DIR holding train | exit 0: the val images written as `train-*`, the train split replaced; no `val.json` | exit 0: `--split val (from the name of --src …)`, `val.json` written, train byte for byte unchanged (`train_val` as a name: exit 2, pass `--split`) |
| another source folder into an existing split; the same source again | exit 0, the split replaced silently | exit 2: `DIR already holds a train split (24 samples) made from …/train; --src …/more would replace it: pass --split NAME …, another --out, or --overwrite`; the same source again: exit 0 (byte-identical shards); with `--overwrite`: exit 0 |
| two conversions into one folder (the second starts while the first writes) | both exit 0, reporting 120 and 90 samples while `train.json` says 90; or (the second starting mid-write) the first exit 1, its temporary shard deleted by the second's clean-up, the second exit 0 | first exit 0, second exit 2 before any work: `--out DIR is in use by another conversion (pid N on HOST, started …)` |
| `--verify` of a folder after the trainer's start-up check | exit 1: `.dcvit-shard-check.json: missing or incomplete metadata`; a conversion of other classes lists the split(s) `['train', '.dcvit-shard-check']` | exit 0; the other-classes error lists `['train']` |
| a key twice in a shard (adjacent) | the start-up check passes; reading stops mid-epoch: `shard … cannot be read (ValueError: … duplicate file name …); it passed the start-up check, so it changed or its storage failed since`; `--verify` exit 1 | the start-up check (exit 2 in training) and `--verify` (exit 1), one verifier: `key '1__70' occurs twice (member '1__70.cls' repeats); each sample needs its own key`; also for a key that comes back later in the shard, and a sample without its `.cls` |
| Ctrl-C during a conversion with `--workers 2`, then a rerun | one try hung (workers defunct, the parent waiting; killed after 300 s); another exit 1 with a `KeyboardInterrupt` traceback. Both: `train.json` removed and the old and new shards mixed on disk (readable by the trainer as a split); `--verify` exit 1; the rerun completes | exit 130: `interrupted; the shards being written were removed …: re-run the command`; the previous split unchanged (`--verify` exit 0); the rerun completes. Ctrl-C while the finished shards are moved in takes effect after the move |
| a source file that cannot be read | exit 1, `PermissionError` traceback; the previous split's `train.json` removed | exit 2: `cannot read …/2/50.png (Permission denied); make it readable or move it out of --src, then re-run`; the previous split unchanged. An image name that is a FIFO or device: exit 2 before writing |
| a file name that is not UTF-8 and longer than 90 bytes (round three) | exit 1, `UnicodeEncodeError` traceback from `make_keys` | converted: the key is cut and ends with a hash of the name's own bytes (unique, ASCII, fits a ustar header); `tests/test_converter_sources.py::test_a_non_utf8_file_name_longer_than_90_bytes_converts` |
"""
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve()
SCRIPT = ROOT / "scripts" / "make_wds_shards.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def make_source(root: Path, per_class: int = 8, classes: int = 3) -> Path:
    """root/{train,val}/<digit>/<i>.png: scikit-learn digits, per_class per class and split."""
    from sklearn.datasets import load_digits
    d = load_digits()
    for split, offset in (("train", 0), ("val", per_class)):
        for c in range(classes):
            (root / split / str(c)).mkdir(parents=True)
            for i in np.flatnonzero(d.target == c)[offset:offset + per_class]:
                img = (d.images[i] * 255 / 16).astype(np.uint8)
                Image.fromarray(img).save(root / split / str(c) / f"{i}.png")
    return root


def run(*argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, argv), "--no-progress"],
                          capture_output=True, text=True, env=ENV, timeout=300, **kwargs)


def _patched_code(patch: str, *argv) -> str:
    """Python code that runs the converter's main(argv) with `patch` applied to its writer module
    (``mws``, `train_imagenet.shards.write`) first."""
    return textwrap.dedent(f"""
        import os, signal, sys, pathlib
        from train_imagenet.shards import cli, write as mws
    """) + textwrap.dedent(patch) + f"\nsys.exit(cli.main({[*map(str, argv), '--no-progress']!r}))\n"


def run_patched(patch: str, *argv) -> subprocess.CompletedProcess:
    """The converter's main(argv) in a child whose writer module has `patch` applied first."""
    code = _patched_code(patch, *argv)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=ENV, timeout=300)


def overwrite_flag() -> list:
    """["--overwrite"] where the converter has the flag (the original code has none)."""
    return ["--overwrite"] if "--overwrite" in run("--help").stdout else []


def last(p: subprocess.CompletedProcess) -> str:
    """The error line of stderr, else its last line."""
    lines = [ln.strip() for ln in p.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    return (errors or lines or [""])[-1][:200]


def meta(out: Path, split: str):
    path = out / f"{split}.json"
    return json.loads(path.read_text()) if path.exists() else None


def digests(out: Path, split: str) -> dict:
    """{file: sha256} of a split's shards and metadata."""
    import hashlib
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in [*out.glob(f"{split}-*.tar"), *out.glob(f"{split}.json")]}


def case_symlink_loop(tmp: Path) -> str:
    src = make_source(tmp / "d") / "train"
    os.symlink("..", src / "1" / "loop")
    p = run("--src", src, "--out", tmp / "o", "--verify")
    m = meta(tmp / "o", "train")
    return (f"exit {p.returncode}; {m['num_samples'] if m else 'no'} samples written from 24 files; "
            f"{last(p) if p.returncode else p.stdout.strip().splitlines()[-1]}")


def case_dangling_symlink(tmp: Path) -> str:
    src = make_source(tmp / "d") / "train"
    os.symlink("/nonexistent/x.png", src / "1" / "gone.png")
    p = run("--src", src, "--out", tmp / "o")
    return f"exit {p.returncode}; {last(p)}"


def case_val_without_split(tmp: Path) -> str:
    d = make_source(tmp / "d")
    out = tmp / "o"
    assert run("--src", d / "train", "--out", out).returncode == 0
    train = digests(out, "train")
    p = run("--src", d / "val", "--out", out)
    kept = digests(out, "train") == train
    return (f"exit {p.returncode}; train split {'unchanged' if kept else 'replaced by the val images'}; "
            f"val.json {'written' if meta(out, 'val') else 'absent'}; {last(p) or p.stdout.splitlines()[0]}")


def case_other_source_same_split(tmp: Path) -> str:
    d = make_source(tmp / "d")
    out = tmp / "o"
    assert run("--src", d / "train", "--out", out).returncode == 0
    os.rename(d / "val", d / "more")
    p = run("--src", d / "more", "--out", out, "--split", "train")
    again = run("--src", d / "train", "--out", out, "--split", "train", *overwrite_flag())
    same = run("--src", d / "train", "--out", out)
    return (f"exit {p.returncode}; {last(p) or 'train replaced by the other images'}; "
            f"same source again: exit {same.returncode}; --overwrite: exit {again.returncode}")


def case_two_conversions(tmp: Path) -> str:
    d = make_source(tmp / "d", per_class=40)
    out = tmp / "o"
    delay = "real = mws.encode_image\n" \
            "def slow(*a):\n    import time; time.sleep(0.25); return real(*a)\n" \
            "mws.encode_image = slow\n"
    code = lambda src: [sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from train_imagenet.shards import cli, write as mws
    """) + delay + f"sys.exit(cli.main(['--src', {str(src)!r}, '--out', {str(out)!r}, "
                  f"'--split', 'train', *{overwrite_flag()!r}, '--workers', '1', '--no-progress']))"]
    for extra in sorted((d / "val" / "0").iterdir())[10:]:   # the second source is smaller
        extra.unlink()
    first = subprocess.Popen(code(d / "train"), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(600):  # until the first is writing (30 s of it): its staging folder exists
        if list(out.glob(".train.tmp-*")) or first.poll() is not None:
            break
        time.sleep(0.2)
    second = subprocess.run(code(d / "val"), env=ENV, capture_output=True, text=True, timeout=300)
    out1, err1 = first.communicate(timeout=300)
    m = meta(out, "train")
    reported = [ln.split(":")[1].split("samples")[0].strip() for ln in (out1 + second.stdout).splitlines()
                if ln.startswith("train:")]
    on_disk = m["num_samples"] if m else None
    tars = sorted(p.name for p in out.glob("train-*.tar"))
    return (f"first exit {first.returncode}, second exit {second.returncode}; reported {reported}; "
            f"train.json says {on_disk}, {len(tars)} shards; {last(second)}")


def case_verify_after_start_check(tmp: Path) -> str:
    d = make_source(tmp / "d")
    out = tmp / "o"
    assert run("--src", d / "train", "--out", out).returncode == 0
    check = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import glob
        from train_imagenet.data.verify import check_shards
        print(check_shards(sorted(glob.glob({str(out)!r} + '/train-*.tar')), 'data.train', 3))
    """)], capture_output=True, text=True, env=ENV, timeout=300)
    assert check.returncode == 0, check.stderr
    p = run("--verify", out)
    src2 = d / "other"
    (src2 / "x").mkdir(parents=True)
    Image.new("L", (8, 8)).save(src2 / "x" / "0.png")
    q = run("--src", src2, "--out", out, "--split", "val")
    return f"--verify: exit {p.returncode}; {last(p)} / other classes: {last(q)}"


def case_duplicate_keys(tmp: Path) -> str:
    import tarfile
    d = make_source(tmp / "d")
    out = tmp / "o"
    assert run("--src", d / "train", "--out", out, "--shard-size", 100).returncode == 0
    shard = out / "train-000000.tar"
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for m, data in members[:2] + members:   # the first sample twice, adjacent
            import io
            tar.addfile(m, io.BytesIO(data))
    code = textwrap.dedent(f"""
        from train_imagenet.data.verify import check_shards
        from train_imagenet.data.shards import _samples, DataError
        print('start-up check:', check_shards([{str(shard)!r}], 'data.train', 3).problem)
        try:
            n = sum(1 for _ in _samples([{str(shard)!r}]))
            print('reading:', n, 'samples')
        except DataError as e:
            print('reading:', str(e)[:40], '...', str(e)[-75:])
    """)
    c = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    p = run("--verify", out)
    return " / ".join(c.stdout.strip().splitlines()) + f" / --verify: exit {p.returncode}"


def case_ctrl_c(tmp: Path) -> str:
    d = make_source(tmp / "d", per_class=20)
    out = tmp / "o"
    assert run("--src", d / "train", "--out", out, "--shard-size", 10).returncode == 0
    before = meta(out, "train")
    patch = """
        signal.signal(signal.SIGINT, signal.default_int_handler)   # as a terminal's process
        real, calls = mws.encode_image, [0]
        def interrupting(*a):
            calls[0] += 1
            if calls[0] == 25:
                os.killpg(0, signal.SIGINT)     # Ctrl-C: the whole foreground process group
                import time; time.sleep(5)
            return real(*a)
        mws.encode_image = interrupting
    """
    q = _in_own_group(patch, "--src", d / "train", "--out", out, "--shard-size", 7, "--seed", 1,
                      "--workers", 2)
    after = meta(out, "train")
    tars = len(list(out.glob("train-*.tar")))
    v = run("--verify", out)
    again = run("--src", d / "train", "--out", out, "--shard-size", 7, "--seed", 1)
    state = ("train.json unchanged" if after == before else
             "train.json gone" if after is None else "train.json changed")
    return (f"interrupted: exit {q.returncode}, {last(q)[:60]}; {state}, {tars} train shards "
            f"(6 before, 9 after the rerun); "
            f"--verify exit {v.returncode}; rerun exit {again.returncode}, "
            f"verify after rerun exit {run('--verify', out).returncode}")


def _in_own_group(patch: str, *argv) -> subprocess.CompletedProcess:
    """run_patched in a new session, so its killpg(0, SIGINT) reaches only the converter."""
    code = _patched_code(patch, *argv)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    try:
        out, err = child.communicate(timeout=120)
        return subprocess.CompletedProcess(child.args, child.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, 9)                 # the converter and its workers
        child.communicate()
        return subprocess.CompletedProcess(child.args, "none (hung: killed after 120 s)", "", "")


def case_unreadable_file(tmp: Path) -> str:
    d = make_source(tmp / "d")
    out = tmp / "o"
    assert run("--src", d / "train", "--out", out).returncode == 0
    before = meta(out, "train")
    victim = sorted((d / "train" / "2").iterdir())[3]
    patch = f"""
        import pathlib
        real_read = pathlib.Path.read_bytes
        def read_bytes(self):
            if self.name == {victim.name!r}:
                raise PermissionError(13, "Permission denied", str(self))
            return real_read(self)
        pathlib.Path.read_bytes = read_bytes
        real_open = open
        import builtins
        def guarded(file, *a, **k):
            if str(file).endswith("/" + {victim.name!r}):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *a, **k)
        builtins.open = guarded
    """
    p = run_patched(patch, "--src", d / "train", "--out", out, "--workers", 1)
    after = meta(out, "train")
    return (f"exit {p.returncode}; {last(p)}; previous train split "
            f"{'kept' if after == before else 'gone' if after is None else 'replaced'}")


CASES = [
    ("1 symlink loop `ln -s .. SRC/1/loop`, --verify", case_symlink_loop),
    ("1 dangling symlink", case_dangling_symlink),
    ("2 `--src digits/val` without --split into a folder with train", case_val_without_split),
    ("2 another source into an existing split; same source again", case_other_source_same_split),
    ("5 two conversions into one folder", case_two_conversions),
    ("6 --verify after the trainer's start-up check", case_verify_after_start_check),
    ("7 adjacent duplicate key in a shard", case_duplicate_keys),
    ("Ctrl-C mid-conversion (workers 2), then rerun", case_ctrl_c),
    ("unreadable source file (PermissionError injected)", case_unreadable_file),
]


def main() -> None:
    only = os.environ.get("CASES")
    print(f"| case | {ROOT} |\n|---|---|")
    for name, fn in CASES:
        if only and not any(tag in name for tag in only.split(",")):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                result = fn(Path(tmp))
            except Exception as e:  # a case that cannot even be set up is reported, not hidden
                result = f"case failed: {type(e).__name__}: {e}"
        print(f"| {name} | {result.replace('|', '/')} |", flush=True)


if __name__ == "__main__":
    main()
