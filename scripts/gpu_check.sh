#!/usr/bin/env bash
# The CUDA path on one GPU within a time budget, most valuable figures first: the environment
# and the automatic core; the Triton kernels against the reference at DCViT-S/16 and B/16
# shapes; their times next to SDPA and the estimate; DCViT vs ViT eager at batch 256 bf16
# (training, inference, peak memory); the training loop's overhead; then, while the budget
# lasts, smoke training runs and compiled figures (scripts/gpu_check_plan.py has the steps
# and their planned seconds; a step that does not fit what is left is recorded as skipped).
#
#   bash scripts/gpu_check.sh                       # --budget 500: 6 of the 12 steps run, 465 s planned
#   bash scripts/gpu_check.sh --budget 1500         # every step
#   bash scripts/gpu_check.sh --wheels DIR          # a bare image: missing packages from DIR
#   bash scripts/gpu_check.sh --dry-run --budget 120   # the same plumbing on CPU, tiny sizes
#   bash scripts/gpu_check.sh --plan                # print the plan, run nothing
#
# Measured: `--dry-run --budget 120` took 117 s on a 2-core CPU machine (2026-12-01). No GPU
# run has been measured yet: the CUDA plan's seconds are the planner's cost model, and each
# step's measured seconds are written next to its plan, so the first GPU run calibrates it.
#
# Result, in --out (default gpu_check/): gpu_check.json (the summary, rewritten after every
# step, so a run cut short still leaves its figures) and gpu_check_logs.tar.gz (every step's
# log and JSON). Data, training runs and the private package folder go to --scratch (default:
# a new folder under $TMPDIR). PYTHON chooses the interpreter (default python3). Nothing is
# downloaded: --wheels DIR (made beforehand by scripts/gpu_wheels.sh) installs what fails to
# import into SCRATCH/site, which only this check's processes see.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)     # every path below is relative to it
PLAN="$ROOT/scripts/gpu_check_plan.py"
REPORT="$ROOT/scripts/gpu_check_report.py"

PY=${PYTHON:-python3}
OUT=gpu_check
SCRATCH=
BUDGET=500
WHEELS=
DRY=()
ONLY_PLAN=0
usage() { sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --budget) BUDGET=${2:-}; shift ;;
        --wheels) WHEELS=${2:-}; shift ;;
        --out) OUT=${2:-}; shift ;;
        --scratch) SCRATCH=${2:-}; shift ;;
        --dry-run) DRY=(--dry-run) ;;
        --plan) ONLY_PLAN=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (use --budget S, --wheels DIR, --out DIR, --scratch DIR, --dry-run, --plan)" >&2
           exit 2 ;;
    esac
    shift
done
case "$BUDGET" in
    ''|*[!0-9]*) echo "gpu_check.sh: --budget '$BUDGET' is not a whole number of seconds (e.g. --budget 500)" >&2; exit 2 ;;
esac
if ! command -v "$PY" > /dev/null; then
    echo "gpu_check.sh: no interpreter '$PY' (set PYTHON=/path/to/python3)" >&2; exit 2
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "$ONLY_PLAN" = 1 ]; then
    exec "$PY" "$PLAN" plan --budget "$BUDGET" "${DRY[@]}" --root "$ROOT"
fi
if [ -n "$WHEELS" ] && ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    echo "gpu_check.sh: --wheels '$WHEELS' holds no .whl files (make them with: bash scripts/gpu_wheels.sh DIR)" >&2; exit 2
fi
[ -n "$SCRATCH" ] || SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
mkdir -p "$OUT" "$SCRATCH" || exit 2
OUT=$(cd "$OUT" && pwd); SCRATCH=$(cd "$SCRATCH" && pwd)

# The packages the check imports that this interpreter lacks (or has older than pyproject's
# minimum): from the wheels, into a private folder put first on PYTHONPATH.
MISSING=$("$PY" "$PLAN" missing --root "$ROOT") || exit 2
INSTALLED=
if [ -n "$MISSING" ]; then
    if [ -z "$WHEELS" ]; then
        echo "gpu_check.sh: missing here: $MISSING; the steps that import them will fail (give --wheels DIR)" >&2
    else
        SITE="$SCRATCH/site"
        mkdir -p "$SITE"
        echo "gpu_check: installing $MISSING from $WHEELS into $SITE"
        # shellcheck disable=SC2086  (one name per word)
        if "$PY" -m pip --version > /dev/null 2>&1; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
                --find-links "$WHEELS" --target "$SITE" --upgrade $MISSING > "$SCRATCH/wheels.log" 2>&1
        else                      # no pip: a pure-Python wheel is a zip of the files to import
            for name in $MISSING; do
                whl=$(ls "$WHEELS"/"$(echo "$name" | tr '-' '_')"-*.whl 2>/dev/null | head -n 1)
                [ -n "$whl" ] && "$PY" -m zipfile -e "$whl" "$SITE" >> "$SCRATCH/wheels.log" 2>&1
            done
        fi || { echo "gpu_check.sh: installing from $WHEELS failed:" >&2; tail -n 5 "$SCRATCH/wheels.log" >&2; }
        export PYTHONPATH="$SITE:$PYTHONPATH"
        INSTALLED=$MISSING
        LEFT=$("$PY" "$PLAN" missing --root "$ROOT")
        [ -n "$LEFT" ] && echo "gpu_check.sh: still missing after the wheels: $LEFT" >&2
    fi
fi
export DCVIT_GPU_CHECK_WHEELS=${INSTALLED// /,}

echo "gpu_check: budget $BUDGET s; summary and logs in $OUT, scratch in $SCRATCH"
"$PY" "$PLAN" run --budget "$BUDGET" "${DRY[@]}" --root "$ROOT" --out "$OUT" --scratch "$SCRATCH"
"$PY" "$REPORT" "$SCRATCH" "$OUT"
