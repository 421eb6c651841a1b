# Sourced by scripts/gpu_wheels.sh and scripts/gpu_lane.sh: one SHA-256 over the files the
# wheels of our own packages are built from, so the lane can tell wheels built from
# another state of the tree (it refuses them rather than measure code that is not there).
source_digest() {
  find pyproject.toml VERSION README.md miles_core plugins/*/pyproject.toml plugins/*/src \
       -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path '*.egg-info/*' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}
