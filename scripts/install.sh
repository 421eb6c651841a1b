#!/usr/bin/env bash
# Create .venv in the repository and install miles-core and every plugin in editable mode.
# Idempotent: does nothing when the package files have not changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv
PLUGINS=(plugins/miles-sd3 plugins/miles-wan22 plugins/miles-ltx plugins/miles-qwen-image
         plugins/miles-cosmos3 plugins/miles-rewards)

# The ocr reward's default recogniser is the Tesseract binary (Debian tesseract-ocr, with
# its English data). Installed with apt-get when missing (as root, or with passwordless
# sudo); a no-op when tesseract is already on PATH. Without it, only the ocr reward (and
# its tests, which fail rather than skip) cannot run.
install_tesseract() {
  command -v tesseract >/dev/null 2>&1 && return 0
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: warning: tesseract is not installed and apt-get is not available: install Tesseract" \
         "with this system's package manager (macOS: brew install tesseract) for the ocr reward" >&2
    return 0
  fi
  local as_root=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      as_root=(sudo -n)
    else
      echo "install.sh: warning: tesseract is not installed; as root, run:" \
           "apt-get install -y tesseract-ocr (the ocr reward needs it)" >&2
      return 0
    fi
  fi
  local apt=(${as_root[@]+"${as_root[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get -y -q)
  echo "install.sh: installing tesseract-ocr (the ocr reward's recogniser) with apt-get" >&2
  if ! "${apt[@]}" install --no-install-recommends tesseract-ocr >/dev/null 2>&1; then
    # A fresh image has no package lists yet.
    "${apt[@]}" update >/dev/null 2>&1 || true
    if ! "${apt[@]}" install --no-install-recommends tesseract-ocr >/dev/null; then
      echo "install.sh: warning: apt-get install tesseract-ocr failed; the ocr reward and its tests need it" >&2
    fi
  fi
}
install_tesseract

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
# First the seven distributions themselves, then their extras: the test extras name
# miles-* distributions (the suites run the core on the SD3 family and miles-rewards),
# which pip finds installed by then instead of looking for them on an index.
plain=(-e .)
extras=(-e ".[test,wandb,video,ray]")
for plugin in "${PLUGINS[@]}"; do plain+=(-e "$plugin"); extras+=(-e "$plugin[test]"); done
"${pip[@]}" install --quiet -c constraints.txt "${plain[@]}"
"${pip[@]}" install --quiet -c constraints.txt "${extras[@]}"
echo "$digest" > "$stamp"
