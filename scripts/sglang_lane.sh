#!/usr/bin/env bash
# Opt-in lane: a real sglang-diffusion server on CPU (docs/engine.md, "The sglang engine").
# Not part of scripts/test.sh. Builds .sglang-venv/ (idempotent; ~1 GB from PyPI the first
# time) as docs/engine.md, "Setting up the sglang environment", describes, writes the tiny SD3 pipeline, and runs
# tests/lane_sglang/ with MILES_SGLANG_PYTHON pointing at that venv's Python.
#   scripts/sglang_lane.sh            build (if needed) and run the lane
#   scripts/sglang_lane.sh --build    build the venv only
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${SGLANG_VENV:-$ROOT/.sglang-venv}
PY=$VENV/bin/python
STAMP=$VENV/.miles-lane-ready
CONSTRAINTS=$VENV/constraints.txt

if [ ! -f "$STAMP" ]; then
  [ -x "$PY" ] || python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q torch==2.13.0            # the CPU build (local disk on this machine)
  echo "torch==2.13.0" > "$CONSTRAINTS"            # nothing may swap torch for a CUDA build
  "$PY" -m pip install -q --no-deps sglang==0.5.23
  "$PY" -m pip install -q -c "$CONSTRAINTS" diffusers==0.37.0 transformers==5.19.0 fastapi uvicorn \
    msgspec msgpack pyzmq pybase64 triton==3.9.0 apache-tvm-ffi==0.1.11 dill compressed-tensors \
    gguf cache_dit python-dateutil openai partial-json-parser orjson setproctitle psutil \
    requests aiohttp loguru einops imageio imageio-ffmpeg sentencepiece ipython zstandard torchvision addict \
    python-multipart
  # torchvision's PyPI builds are CUDA-linked: let the rest of it import beside CPU torch.
  SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cat > "$SITE/miles_torchvision_cpu_shim.py" <<'PYEOF'
import sys, types
for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(_name, types.ModuleType(_name))
PYEOF
  echo "import miles_torchvision_cpu_shim" > "$SITE/miles_torchvision_cpu_shim.pth"
  timeout 300 "$PY" -c "import sglang.multimodal_gen.runtime.entrypoints.cli.main, sglang.multimodal_gen.runtime.entrypoints.http_server"
  touch "$STAMP"
fi
[ "${1:-}" = "--build" ] && exit 0

TINY=${SGLANG_LANE_TINY:-$ROOT/.sglang-venv/tiny-sd3}
# sglang picks the pipeline from the directory's model_index.json; its SD3 config needs the
# 8x VAE downsampling the tiny factory keeps.
[ -f "$TINY/model_index.json" ] || .venv/bin/miles-core make-tiny sd3 "$TINY"
MILES_SGLANG_PYTHON=$PY MILES_SGLANG_TINY=$TINY .venv/bin/python -m pytest -q tests/lane_sglang "$@"
