#!/usr/bin/env bash
# The default test tier against the oldest supported dependencies: every lower bound that
# pyproject.toml declares (dependencies and the test/quickstart extras), installed exactly,
# in a virtual environment of its own. Extra arguments go to pytest.
#   DCVIT_MIN_VENV  where that environment lives (default: <repo>/.venv-min; several GB,
#                   as older torch releases come with their CUDA libraries from PyPI)
#   PYTHON          the interpreter that creates it (default: python3)
# The C++ kernels are built in that environment's own cache (DCVIT_KERNEL_CACHE, default
# <venv>/kernel-cache): a library built against another torch must not be loaded, nor
# overwrite the one the other environments load.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${DCVIT_MIN_VENV:-$root/.venv-min}"
if [ ! -x "$venv/bin/python" ]; then
    echo "[min] creating $venv"
    "${PYTHON:-python3}" -m venv "$venv"
fi
floors="$venv/floors.txt"
"$venv/bin/python" - "$root/pyproject.toml" >"$floors" <<'PY'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = project["dependencies"] + [r for extra in ("test", "quickstart", "report")
                                  for r in project["optional-dependencies"][extra]]
floors = {}
for req in reqs:
    m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([^,;\s]+)\s*", req)
    if not m:
        sys.exit(f"[min] {req!r}: every dependency needs a plain '>=' lower bound")
    floors[m.group(1).lower()] = m.group(2)
print("\n".join(f"{name}=={version}" for name, version in sorted(floors.items())))
PY
echo "[min] installing the lower bounds into $venv:" $(cat "$floors")
log="$venv/install.log"
if ! "$venv/bin/python" -m pip install --disable-pip-version-check -c "$floors" \
        -e "$root[test,quickstart]" >"$log" 2>&1; then
    tail -n 30 "$log"
    echo "[min] pip install failed; full log: $log" >&2
    exit 1
fi
"$venv/bin/python" -m pip check
"$venv/bin/python" - "$floors" <<'PY'
import sys
from importlib.metadata import version
from packaging.version import Version
for line in open(sys.argv[1]):
    name, want = line.strip().split("==")
    got = version(name)
    print(f"[min] {name:22s} {got}")
    assert Version(got.split("+")[0]) == Version(want), f"{name}: installed {got}, lower bound {want}"
PY
cd "$root"
export DCVIT_KERNEL_CACHE="${DCVIT_KERNEL_CACHE:-$venv/kernel-cache}"
exec "$venv/bin/python" -m pytest "$@"
