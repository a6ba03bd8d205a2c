#!/usr/bin/env bash
# Wheels of the pure-Python packages that scripts/gpu_check.sh imports and a bare torch image
# may lack, for a GPU machine with no network (copy DIR there, then gpu_check.sh --wheels DIR).
#
#   bash scripts/gpu_wheels.sh DIR          # on a machine whose pip reaches a package index
#
# The list and the versions come from scripts/gpu_check_plan.py (`requirements`): fvcore and
# what it needs (iopath, yacs, termcolor, portalocker, tabulate), webdataset and braceexpand,
# timm, torchmetrics and lightning-utilities; each at the version installed in this
# environment, else at pyproject.toml's minimum or newer. All are pure Python ("py3-none-any"),
# so the wheels install under any Python 3 and CPU; fvcore and iopath come only as source and
# are built here. PYTHON chooses the interpreter (default python3).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
if [ $# -ne 1 ] || [ "${1:0:1}" = "-" ]; then
    echo "usage: bash scripts/gpu_wheels.sh DIR (the folder to write the wheels to)" >&2
    exit 2
fi
DIR=$1
mkdir -p "$DIR"
mapfile -t REQS < <("$PY" "$ROOT/scripts/gpu_check_plan.py" requirements --root "$ROOT")
echo "gpu_wheels: ${REQS[*]}"
"$PY" -m pip wheel -q --no-deps --disable-pip-version-check -w "$DIR" "${REQS[@]}"
for whl in "$DIR"/*.whl; do
    case "$(basename "$whl")" in
        *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
        *) echo "gpu_wheels: $(basename "$whl") is not pure Python: it may not install on the GPU machine" >&2 ;;
    esac
done
ls -1 "$DIR"
echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels in $DIR ($(du -sh "$DIR" | cut -f1)); copy the folder to the GPU machine"
