#!/usr/bin/env bash
# Runs the test suite in the project's environment (created on first use).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` for the slow tier.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/env.sh"
cd "$root"
exec python -m pytest "$@"
