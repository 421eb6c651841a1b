#!/usr/bin/env bash
# Opt-in lane for one large GPU, offline (docs/benchmarks.md, "GPU lane"). Not part of
# scripts/test.sh. Installs from gpu_wheels/ (made by scripts/gpu_wheels.sh where package
# registries are reachable; nothing is downloaded here) into .gpu-venv/, a virtual
# environment over the machine's own Python and torch (--system-site-packages; torch is
# pinned to the version found), then runs the sections. Each section writes
# <section>.json and <section>.md under $OUT (else a new temporary folder) and should
# finish within 4 minutes.
#   scripts/gpu_lane.sh                  every section
#   scripts/gpu_lane.sh --only train     one section (see SECTIONS): train (bench/gpu_train.py),
#                                        ipc_sync (bench/gpu_ipc_sync.py), group_sync
#                                        (bench/gpu_group_sync.py; its nccl case needs 2 GPUs),
#                                        compile (bench/compile.py: --compile vs eager),
#                                        plan (bench/gpu_plan.py: the memory plan against
#                                        torch.cuda.max_memory_allocated)
#   scripts/gpu_lane.sh --dry-run        every section at the tiny size on the CPU, with
#                                        .venv's Python and nothing installed (seconds; the
#                                        sections side by side, output in section order)
#   scripts/gpu_lane.sh --install-only   build .gpu-venv/ and stop
# PYTHON: the machine's Python with torch (default python3); GPU_WHEELS, GPU_VENV: the
# folders (default gpu_wheels/, .gpu-venv/); SECTION_TIMEOUT_S: a section's cut-off (300).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SECTIONS=(train ipc_sync group_sync compile plan)

usage() { echo "usage: scripts/gpu_lane.sh [--only SECTION] [--dry-run | --install-only]; sections: ${SECTIONS[*]}" >&2; exit 2; }
only=""
dry_run=0
install_only=0
while [ $# -gt 0 ]; do
  case $1 in
    --only) [ $# -ge 2 ] || usage; only=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --install-only) install_only=1; shift ;;
    -h|--help) usage ;;
    *) echo "gpu_lane.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
if [ -n "$only" ]; then
  known=0
  for section in "${SECTIONS[@]}"; do [ "$section" = "$only" ] && known=1; done
  if [ "$known" = 0 ]; then
    echo "gpu_lane.sh: unknown section '$only'; the sections are: ${SECTIONS[*]}" >&2
    exit 2
  fi
  SECTIONS=("$only")
fi
if [ "$dry_run" = 1 ]; then
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""   # the CPU, whatever the machine has
  section_args=(--dry-run)
else
  WHEELS=${GPU_WHEELS:-$ROOT/gpu_wheels}
  VENV=${GPU_VENV:-$ROOT/.gpu-venv}
  # shellcheck source=scripts/source_digest.sh
  source scripts/source_digest.sh
  if [ ! -f "$WHEELS/SOURCE_DIGEST" ]; then
    echo "gpu_lane.sh: $WHEELS has no wheels; run scripts/gpu_wheels.sh where package registries are reachable" >&2
    exit 1
  fi
  if [ "$(cat "$WHEELS/SOURCE_DIGEST")" != "$(source_digest)" ]; then
    echo "gpu_lane.sh: the wheels in $WHEELS were built from another state of this tree; rerun scripts/gpu_wheels.sh" >&2
    exit 1
  fi
  machine_py=${PYTHON:-python3}
  if [ ! -x "$VENV/bin/python" ]; then
    # No pip (nor, before Python 3.12, setuptools) of its own: the machine's pip installs
    # into it (pip --python), and the machine's setuptools keeps satisfying torch.
    "$machine_py" -m venv --system-site-packages --without-pip "$VENV"
    # --system-site-packages reaches the base interpreter's packages; when the machine's
    # python3 is a virtual environment, its torch lives in that environment's site-packages.
    "$machine_py" -c 'import site; print("\n".join(site.getsitepackages()))' \
      > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine-site-packages.pth"
  fi
  PY=$VENV/bin/python
  pip=("$machine_py" -m pip --python "$PY")
  stamp=$VENV/.miles-lane-stamp
  wanted=$(cat "$WHEELS/SOURCE_DIGEST"; ls "$WHEELS")
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
    torch_version=$("$PY" -c 'import torch; print(torch.__version__)') || {
      echo "gpu_lane.sh: $machine_py has no torch; the lane runs on the machine's torch" >&2
      exit 1
    }
    # The machine's torch stays; every other package is the tested version brought along.
    constraints=$VENV/lane-constraints.txt
    echo "torch==$torch_version" > "$constraints"
    for wheel in "$WHEELS"/*.whl; do
      name=$(basename "$wheel" .whl)
      IFS=- read -r dist version _ <<< "$name"
      case $dist in miles_*) ;; *) echo "$dist==$version" >> "$constraints" ;; esac
    done
    export PIP_CONFIG_FILE=/dev/null  # no index or find-links from this machine's pip configuration
    install=("${pip[@]}" --disable-pip-version-check install --quiet --no-index --find-links "$WHEELS" -c "$constraints")
    "${install[@]}" miles-core miles-sd3 miles-wan22 miles-ltx miles-qwen-image miles-cosmos3 miles-flux miles-rewards miles-algorithms
    # Same version number, new code: our wheels are reinstalled whenever they were rebuilt.
    "${install[@]}" --no-deps --force-reinstall "$WHEELS"/miles_*.whl
    echo "$wanted" > "$stamp"
  fi
  [ "$install_only" = 1 ] && { echo "gpu_lane.sh: $VENV is ready"; exit 0; }
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || { echo "gpu_lane.sh: torch sees no GPU here (--dry-run runs the sections on the CPU)" >&2; exit 1; }
  "$PY" -c 'import torch; print("gpu_lane.sh: torch", torch.__version__, "on", torch.cuda.get_device_name(0), "x", torch.cuda.device_count())'
  section_args=()
fi

RESULTS=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-lane-XXXXXX")}
mkdir -p "$RESULTS"

section_command() {  # sets cmd
  case $1 in
    train) cmd=("$PY" bench/gpu_train.py --out "$RESULTS" ${section_args[@]+"${section_args[@]}"}) ;;
    ipc_sync) cmd=("$PY" bench/gpu_ipc_sync.py --out "$RESULTS" ${section_args[@]+"${section_args[@]}"}) ;;
    group_sync) cmd=("$PY" bench/gpu_group_sync.py --out "$RESULTS" ${section_args[@]+"${section_args[@]}"}) ;;
    compile) cmd=("$PY" bench/compile.py --out "$RESULTS" ${section_args[@]+"${section_args[@]}"}) ;;
    plan) cmd=("$PY" bench/gpu_plan.py --out "$RESULTS" ${section_args[@]+"${section_args[@]}"}) ;;
  esac
}

run_section() {  # $1: the section; fails when it does
  local section=$1 began=$SECONDS failed=0
  echo "== $section"
  # A section over its 4 minutes is cut at SECTION_TIMEOUT_S; what it wrote so far stays.
  section_command "$section"
  timeout "${SECTION_TIMEOUT_S:-300}" "${cmd[@]}" || { echo "gpu_lane.sh: section $section failed (exit $?)" >&2; failed=1; }
  echo "== $section took $((SECONDS - began)) s; results in $RESULTS"
  return $failed
}

# --diffusion-generator-device cuda: each output's generator on the model's GPU, seeded
# seed + i as on the CPU (miles_core.engine.sampler), drawing the initial and then an SDE
# step's noise. The draw must be finite, the same for a seed twice, and not the CPU's (a
# CUDA generator's stream differs). Not in the dry run (no GPU there).
generator_device_check() {
  "$PY" - <<'PY'
import torch
from miles_core.engine.sampler import generator_device, output_generators
from miles_core.family import per_output_noise
from miles_core.request import RolloutRequest

class Model:  # what generator_device reads of a family: the device the model runs on
    device = torch.device("cuda")

def draw(device_field: str) -> torch.Tensor:
    request = RolloutRequest(prompt="", seed=1234, num_outputs_per_prompt=2, generator_device=device_field)
    generators = output_generators(request.seed, request.num_outputs_per_prompt, generator_device(request, Model()))
    initial = per_output_noise((1, 16, 32, 32), generators)
    sde = per_output_noise((1, 16, 32, 32), generators)  # the next draw of each stream: a step's noise
    return torch.stack([initial, sde])

first, second, cpu = draw("cuda"), draw("cuda"), draw("cpu")
same, differs = torch.equal(first, second), not torch.equal(first.cpu(), cpu)
finite = bool(torch.isfinite(first).all())
print(f"generator_device cuda: drawn on {first.device}, mean {first.mean().item():.4f}, std {first.std().item():.4f}, "
      f"finite {finite}, same seed twice equal {same}, max |cuda - cpu| {(first.cpu() - cpu).abs().max().item():.3f} "
      f"(differs from the CPU draw: {differs})")
assert first.device.type == "cuda" and finite and same and differs
PY
}

status=0
if [ "$dry_run" = 0 ]; then
  echo "== generator_device cuda"
  generator_device_check || { echo "gpu_lane.sh: the generator_device cuda check failed" >&2; status=1; }
fi
if [ "$dry_run" = 1 ]; then
  # The dry run's sections are small and independent (each its own processes, ports
  # and temporary folder), so they run side by side; their output follows in section order.
  logs=$(mktemp -d "${TMPDIR:-/tmp}/gpu-lane-logs-XXXXXX")
  pids=()
  for section in "${SECTIONS[@]}"; do
    run_section "$section" > "$logs/$section.out" 2> "$logs/$section.err" &
    pids+=($!)
  done
  for i in "${!SECTIONS[@]}"; do
    wait "${pids[$i]}" || status=1
    cat "$logs/${SECTIONS[$i]}.out"
    cat "$logs/${SECTIONS[$i]}.err" >&2
  done
  rm -rf "$logs"
else
  for section in "${SECTIONS[@]}"; do
    run_section "$section" || status=1
  done
fi
exit $status
