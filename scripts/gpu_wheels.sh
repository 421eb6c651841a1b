#!/usr/bin/env bash
# Fill gpu_wheels/ (ignored by git) with what scripts/gpu_lane.sh installs on a GPU machine
# that has Python 3.12 and a CUDA torch but no network (docs/benchmarks.md, "GPU lane"):
#   - our own nine packages (miles-core and the eight plugins), built as wheels from this tree;
#   - every other package they need at run time, at the versions this project is tested
#     with (.venv's, pinned by constraints.txt), as Python 3.12 x86-64 Linux wheels.
# (GPU_PYTHON_VERSION: another Python version than the GPU machine's 3.12.)
# Left out: torch and its own dependencies (the lane runs on the machine's torch; never
# downloaded here) and numpy (transformers, which such a machine has, already needs it;
# ~16 MB). Everything travels with the working tree, at most 64 MiB: the script prints the
# folder's size and fails above WHEELS_MAX_MIB (default 56, leaving room for the tree).
# Idempotent: third-party wheels already there are kept; ours are rebuilt every time, and
# gpu_wheels/SOURCE_DIGEST records the tree they were built from (the lane checks it).
#   bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEST=${GPU_WHEELS:-$ROOT/gpu_wheels}
MAX_MIB=${WHEELS_MAX_MIB:-56}
PYTHON_VERSION=${GPU_PYTHON_VERSION:-3.12}  # the GPU machine's
PY=.venv/bin/python
# shellcheck source=scripts/source_digest.sh
source scripts/source_digest.sh
[ -x "$PY" ] || { echo "gpu_wheels.sh: $PY is missing; run scripts/install.sh first" >&2; exit 1; }
mkdir -p "$DEST"

# name==version for the run-time closure of our packages, read from .venv's metadata,
# less the wheels already in the folder.
wanted=$("$PY" - "$DEST" "$PYTHON_VERSION" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

OURS = {"miles-core", "miles-sd3", "miles-wan22", "miles-ltx", "miles-qwen-image", "miles-cosmos3", "miles-flux", "miles-rewards", "miles-algorithms"}
TARGET = {"python_version": sys.argv[2], "python_full_version": f"{sys.argv[2]}.0", "platform_machine": "x86_64", "sys_platform": "linux",
          "platform_system": "Linux", "os_name": "posix", "implementation_name": "cpython", "extra": ""}


def closure(roots, stop=frozenset()):
    found = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found or name in stop:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            raise SystemExit(f"gpu_wheels.sh: {name} is needed but not installed in .venv") from None
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(TARGET):
                todo.append(req.name)
    return found


provided = set(closure(["torch"])) | {"numpy"}  # on the GPU machine already
have = {(name, str(version)) for name, version, *_ in map(parse_wheel_filename, (p.name for p in Path(sys.argv[1]).glob("*.whl")))}
for name, version in sorted(closure(OURS, provided).items()):
    if name not in OURS and (name, version) not in have:
        print(f"{name}=={version}")
PYEOF
)
missing=()
for req in $wanted; do missing+=("$req"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu_wheels.sh: downloading ${#missing[@]} wheels for Python $PYTHON_VERSION (x86-64 Linux): ${missing[*]}"
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYTHON_VERSION" --implementation cp --abi "cp${PYTHON_VERSION/./}" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 \
    -d "$DEST" "${missing[@]}"
fi

# Our packages, from a copy of the tree (the build writes build/ and *.egg-info next to its sources).
rm -f "$DEST"/miles_*.whl
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
cp -r pyproject.toml VERSION README.md LICENSE miles_core plugins "$build"/
find "$build" \( -name __pycache__ -o -name '*.egg-info' -o -name build \) -prune -exec rm -rf {} +
(cd "$build" && "$ROOT/$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  -w "$DEST" . plugins/miles-sd3 plugins/miles-wan22 plugins/miles-ltx plugins/miles-qwen-image \
  plugins/miles-cosmos3 plugins/miles-flux plugins/miles-rewards plugins/miles-algorithms)
source_digest > "$DEST/SOURCE_DIGEST"

count=$(ls "$DEST"/*.whl | wc -l)
kib=$(du -sk "$DEST" | cut -f1)
echo "gpu_wheels.sh: $count wheels in $DEST, $((kib / 1024)) MiB ($kib KiB)"
if [ "$kib" -gt $((MAX_MIB * 1024)) ]; then
  echo "gpu_wheels.sh: $DEST is above $MAX_MIB MiB; the working tree and it travel together within 64 MiB" >&2
  exit 1
fi
