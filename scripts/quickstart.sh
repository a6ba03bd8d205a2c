#!/usr/bin/env bash
# The main job on the bundled data: creates the environment on first use, then runs
# scripts/quickstart.py (digits -> shards -> ViT and DCViT under torchrun -> report).
# Arguments go to scripts/quickstart.py, e.g. `bash scripts/quickstart.sh --seed 1`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/env.sh"
cd "$root"
exec python scripts/quickstart.py "$@"
