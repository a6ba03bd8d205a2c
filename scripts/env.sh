#!/usr/bin/env bash
# Source this file: it creates the project's virtual environment on first use (and again
# whenever pyproject.toml changes), installs the project into it, and puts it on PATH.
#   DCVIT_VENV   where the environment lives (default: <repo>/.venv)
#   PYTHON       the interpreter that creates it (default: python3)
#   DCVIT_PINS   versions installed with it (default: torch==2.14.1 torchvision==0.29.1)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${DCVIT_VENV:-$root/.venv}"
stamp="$venv/.dcvit-stamp"
# The torch build this project's machines test with (its wheels lie on their local disk); the
# package itself takes any torch >= 2.4 (docs/deploying.md#compatibility). DCVIT_PINS="" lifts it.
pins="${DCVIT_PINS-torch==2.14.1 torchvision==0.29.1}"
want=$( (cat "$root/pyproject.toml"; echo "$root"; echo "$pins") | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
    echo "[env] creating $venv"
    "${PYTHON:-python3}" -m venv "$venv" || return 1 2>/dev/null || exit 1
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[env] installing dcvit and its dependencies into $venv (the first time takes a few minutes)"
    log="$venv/install.log"
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check -e "$root[test,quickstart]" $pins >"$log" 2>&1; then
        tail -n 30 "$log"
        echo "[env] pip install failed; full log: $log" >&2
        return 1 2>/dev/null || exit 1
    fi
    echo "$want" >"$stamp"
fi
export PATH="$venv/bin:$PATH"
export VIRTUAL_ENV="$venv"
