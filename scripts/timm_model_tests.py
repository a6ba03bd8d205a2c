#!/usr/bin/env python
"""Run timm's own model tests (its ``tests/test_models.py``) on every model dcvit registers.

    python scripts/timm_model_tests.py [--timm-source PATH] [pytest args ...]

PATH is a checkout of huggingface/pytorch-image-models or timm's source distribution
(``timm-X.Y.Z.tar.gz``) of the installed timm version. Without ``--timm-source`` the sdist of
the installed version is downloaded first with ``pip download`` (the only network use); the
tests themselves run offline. timm's file is run as it is, with two lists extended so that
dcvit's models take part as timm's own ViTs do: ``NON_STD_FILTERS`` (ViT-like models skip the
CNN feature-map API checks) and ``FEAT_INTER_FILTERS`` (the ``forward_intermediates`` and
``features_only`` tests). Only the tests of dcvit's models are collected (the conftest beside
this script selects them); the exit status is pytest's.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _installed_timm_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import timm; print(timm.__version__)"],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def _download_sdist(version: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--no-binary", ":all:", f"timm=={version}", "-d", str(into)], check=True)
    found = sorted(into.glob(f"timm-{version}.tar.gz"))
    if not found:
        raise SystemExit(f"pip download did not produce timm-{version}.tar.gz in {into}")
    return found[0]


def _source_tree(source: Path, into: Path) -> Path:
    """The folder holding ``tests/test_models.py`` and ``timm/version.py``."""
    if source.is_dir():
        return source
    if source.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(source) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.endswith(("tests/test_models.py", "timm/version.py"))]
            tar.extractall(into, members=members)
        roots = sorted(p.parent.parent for p in into.rglob("tests/test_models.py"))
        if roots:
            return roots[0]
    raise SystemExit(f"--timm-source {source}: not a timm checkout or a timm-X.Y.Z.tar.gz sdist "
                     "(it must contain tests/test_models.py)")


def _source_version(tree: Path) -> str:
    text = (tree / "timm" / "version.py").read_text()
    match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", text)
    return match.group(1) if match else "unknown"


def _extend_list(text: str, name: str, entries: list) -> str:
    anchor = f"{name} = ["
    if text.count(anchor) != 1:
        raise SystemExit(f"timm's test_models.py has no single '{anchor}' line to extend; "
                         "this timm version's test file has another layout")
    return text.replace(anchor, anchor + " " + " ".join(f"{e!r}," for e in entries), 1)


def _registry_modules() -> list:
    """The timm registry's module names of dcvit's models (the last part of each module path)."""
    code = ("import sys; sys.path[:0] = sys.argv[1:]; import timm_model_tests_conftest as c; "
            "from timm.models._registry import _model_to_module as m; "
            "print(' '.join(sorted({m[n] for n in c.dcvit_models()})))")
    out = subprocess.run([sys.executable, "-c", code, str(HERE), str(HERE.parent)], check=True,
                         capture_output=True, text=True)
    return out.stdout.split()


def prepare(tree: Path, workdir: Path) -> Path:
    """Copy timm's test_models.py (lists extended) and the selecting conftest into workdir."""
    text = (tree / "tests" / "test_models.py").read_text()
    text = _extend_list(text, "NON_STD_FILTERS", ["dcvit*"])
    text = _extend_list(text, "FEAT_INTER_FILTERS", _registry_modules())
    (workdir / "test_models.py").write_text(text)
    shutil.copy(HERE / "timm_model_tests_conftest.py", workdir / "conftest.py")
    return workdir / "test_models.py"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [--timm-source PATH] [pytest args ...]")
    parser.add_argument("--timm-source", type=Path, default=None,
                        help="a timm checkout or sdist of the installed version (default: pip download it)")
    args, pytest_args = parser.parse_known_args(argv)
    version = _installed_timm_version()
    with tempfile.TemporaryDirectory(prefix="dcvit-timm-tests-") as tmp:
        tmp = Path(tmp)
        source = args.timm_source or _download_sdist(version, tmp / "sdist")
        tree = _source_tree(source.resolve(), tmp / "src")
        found = _source_version(tree)
        if found != version:
            print(f"[timm-tests] warning: the test file is from timm {found}, the installed timm is "
                  f"{version}; pass the source of the installed version", file=sys.stderr)
        work = tmp / "run"
        work.mkdir()
        test_file = prepare(tree, work)
        # timm's own knob for its per-test time limits (120-360 s by default): on a loaded
        # machine the large models take longer, and time is not what these tests check.
        env = dict(os.environ, TIMEOUT=os.environ.get("TIMEOUT", "3600"), PYTHONPATH=os.pathsep.join(
            [str(HERE.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        cmd = [sys.executable, "-m", "pytest", str(test_file), "-p", "no:cacheprovider",
               "--rootdir", str(work), "-c", os.devnull, *pytest_args]
        print(f"[timm-tests] timm {version}: {' '.join(cmd)}", flush=True)
        return subprocess.call(cmd, cwd=work, env=env)


if __name__ == "__main__":
    sys.exit(main())
