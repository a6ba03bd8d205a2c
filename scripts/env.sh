#!/usr/bin/env bash
# Source this file: it creates the project's virtual environment on first use (and again
# whenever pyproject.toml changes), installs the project into it, and puts it on PATH.
#   DCVIT_VENV   where the environment lives (default: <repo>/.venv)
#   PYTHON       the interpreter that creates it (default: python3)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${DCVIT_VENV:-$root/.venv}"
stamp="$venv/.dcvit-stamp"
want=$( (cat "$root/pyproject.toml"; echo "$root") | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
    echo "[env] creating $venv"
    "${PYTHON:-python3}" -m venv "$venv" || return 1 2>/dev/null || exit 1
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[env] installing dcvit and its dependencies into $venv (the first time takes a few minutes)"
    log="$venv/install.log"
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check -e "$root[test,quickstart]" >"$log" 2>&1; then
        tail -n 30 "$log"
        echo "[env] pip install failed; full log: $log" >&2
        return 1 2>/dev/null || exit 1
    fi
    echo "$want" >"$stamp"
fi
export PATH="$venv/bin:$PATH"
export VIRTUAL_ENV="$venv"
