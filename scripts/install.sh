#!/usr/bin/env bash
# Create .venv in the repository and install miles-core and every plugin in editable mode.
# Idempotent: does nothing when the package files have not changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv
PLUGINS=(plugins/miles-sd3 plugins/miles-wan22 plugins/miles-ltx plugins/miles-qwen-image
         plugins/miles-cosmos3 plugins/miles-rewards)

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.miles-install-stamp"
digest=$(cat constraints.txt scripts/install.sh pyproject.toml plugins/*/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ]; then
  exit 0
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
# torch first, pinned: its CPU build lies on this machine's disk.
"${pip[@]}" install --quiet -c constraints.txt torch==2.13.0
editable=(-e ".[test,wandb]")
for plugin in "${PLUGINS[@]}"; do editable+=(-e "$plugin"); done
"${pip[@]}" install --quiet -c constraints.txt "${editable[@]}"
echo "$digest" > "$stamp"
