#!/usr/bin/env python
"""Run the timm-scripts commands of docs/deploying.md as they stand, and check what they wrote.

    python scripts/check_timm_scripts.py --timm-scripts TIMM [--keep DIR]

TIMM is a folder with timm's ``train.py``, ``validate.py``, ``benchmark.py`` and
``inference.py`` (a checkout of huggingface/pytorch-image-models at the installed timm's tag;
they are not in timm's wheel or sdist). The ```bash block after the line
``<!-- timm-scripts: run by scripts/check_timm_scripts.py -->`` in docs/deploying.md runs with
``bash -euo pipefail`` in an empty folder (``--keep DIR`` to keep it; ``scripts/`` there is a
link to this repository's), with ``TIMM`` set and this repository on ``PYTHONPATH``. Then:

* train.py wrote ``runs/timm/digits/model_best.pth.tar`` and its ``summary.csv``;
* validate.py's top-1 equals the top-1 train.py logged for that checkpoint (the same weights,
  validation images and preprocessing);
* benchmark.py wrote a row for ``dcvit_tiny`` with a throughput;
* inference.py wrote one row per validation image with 3 class indices, and, from the
  ``dcvit.save_pretrained`` folder, 3 digit names per row;
* ``python -m train_imagenet.predict`` on that folder gives the same top-3 names per image.

Exit status 0 when every command and check passes, 1 otherwise (the failing step is named).
"""
import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "deploying.md"
MARKER = "<!-- timm-scripts: run by scripts/check_timm_scripts.py -->"
SCRIPTS = ("train.py", "validate.py", "benchmark.py", "inference.py")


def doc_commands(doc: Path = DOC) -> str:
    """The ```bash block that follows the marker line in ``doc``."""
    lines = doc.read_text().splitlines()
    try:
        start = lines.index(MARKER)
    except ValueError:
        raise SystemExit(f"{doc}: no line {MARKER!r}") from None
    fence = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    if lines[fence].strip() != "```bash":
        raise SystemExit(f"{doc}:{fence + 1}: expected a ```bash block after the marker")
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    return "\n".join(lines[fence + 1:end]) + "\n"


def _check(ok: bool, what: str) -> None:
    print(f"[{'ok' if ok else 'FAILED'}] {what}")
    if not ok:
        raise SystemExit(1)


def check_outputs(work: Path) -> None:
    runs = work / "runs"
    run = runs / "timm" / "digits"
    _check((run / "model_best.pth.tar").is_file(), "train.py wrote model_best.pth.tar")
    with open(run / "summary.csv") as f:
        logged = [float(r["eval_top1"]) for r in csv.DictReader(f)]
    validated = json.loads((runs / "timm" / "validate.json").read_text())
    _check(abs(validated["top1"] - max(logged)) < 1e-3,            # validate.py rounds to 4 decimals
           f"validate.py top-1 {validated['top1']} = train.py's best eval_top1 {max(logged)}")
    with open(runs / "timm" / "benchmark.csv") as f:
        bench = list(csv.DictReader(f))
    _check(len(bench) == 1 and bench[0]["model"] == "dcvit_tiny" and float(bench[0]["infer_samples_per_sec"]) > 0,
           "benchmark.py wrote dcvit_tiny's throughput")
    n_val = sum(1 for _ in (runs / "digits-folder" / "val").rglob("*.png"))
    with open(runs / "timm" / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    _check(len(rows) == n_val and all(len(re.findall(r"\d+", r["index"])) == 3 for r in rows),
           f"inference.py: {len(rows)} rows (val images: {n_val}), top-3 class indices each")
    with open(runs / "timm" / "predictions-named.csv") as f:
        named = list(csv.DictReader(f))
    digits = {str(d) for d in range(10)}
    labels = [r["label"].strip("[]").replace("'", "").split() for r in named]
    _check(len(named) == n_val and all(len(ls) == 3 and set(ls) <= digits for ls in labels),
           "inference.py from the save_pretrained folder: 3 digit names per row")
    with open(runs / "timm" / "predict.csv") as f:
        ours = {Path(r["image"]).name: [r[f"name_{i}"] for i in (1, 2, 3)] for r in csv.DictReader(f)}
    timms = {r["filename"]: ls for r, ls in zip(named, labels)}
    _check(ours == timms, f"train_imagenet.predict: the same top-3 names as inference.py for all {len(ours)} images")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timm-scripts", type=Path, required=True,
                        help="folder with timm's train.py, validate.py, benchmark.py, inference.py")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary one)")
    args = parser.parse_args(argv)
    missing = [s for s in SCRIPTS if not (args.timm_scripts / s).is_file()]
    if missing:
        parser.error(f"--timm-scripts {args.timm_scripts}: no {', '.join(missing)}; clone "
                     f"https://github.com/huggingface/pytorch-image-models at the installed timm's tag")
    commands = doc_commands()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if not (work / "scripts").exists():
            (work / "scripts").symlink_to(ROOT / "scripts")
        env = {**os.environ, "TIMM": str(args.timm_scripts.resolve()),
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        print(f"running the {MARKER.split(':')[0][5:]} block of {DOC.relative_to(ROOT)} in {work}", flush=True)
        proc = subprocess.run(["bash", "-euxo", "pipefail", "-c", commands], cwd=work, env=env)
        _check(proc.returncode == 0, f"every command of the block exits 0 (last status {proc.returncode})")
        check_outputs(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
