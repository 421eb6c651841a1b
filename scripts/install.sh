#!/usr/bin/env bash
# Create .venv in the repository and install miles-core and every plugin in editable mode.
# Idempotent: does nothing when the package files have not changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv
PLUGINS=(plugins/miles-sd3 plugins/miles-wan22 plugins/miles-ltx plugins/miles-qwen-image
         plugins/miles-cosmos3 plugins/miles-flux plugins/miles-rewards plugins/miles-algorithms)

# The ocr reward's default recogniser is the Tesseract binary (Debian tesseract-ocr, with
# its English data), installed with apt-get when missing (macOS: brew install tesseract).
# Without it, only the ocr reward (and its tests, which fail rather than skip) cannot run.
source scripts/apt_package.sh
ensure_apt_package tesseract tesseract-ocr "the ocr reward's recogniser"

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
# First the nine distributions themselves, then their extras: the test extras name
# miles-* distributions (the suites run the core on the SD3 family, miles-rewards and
# miles-algorithms), which pip finds installed by then instead of looking for them on an
# index.
plain=(-e .)
extras=(-e ".[test,wandb,video,ray,tensorboard]")
for plugin in "${PLUGINS[@]}"; do plain+=(-e "$plugin"); extras+=(-e "$plugin[test]"); done
"${pip[@]}" install --quiet -c constraints.txt "${plain[@]}"
"${pip[@]}" install --quiet -c constraints.txt "${extras[@]}"
echo "$digest" > "$stamp"
