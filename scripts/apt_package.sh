# Sourced by scripts/install.sh and scripts/test.sh: ensure_apt_package COMMAND PACKAGE WHY
# installs Debian's PACKAGE with apt-get (as root, or with passwordless sudo) when COMMAND
# is not on PATH; a no-op when it is. Where it cannot install, it warns (naming WHY, what
# needs the package) and returns 0: only what needs the package then fails.
ensure_apt_package() {
  local command=$1 package=$2 why=$3 script
  script=$(basename "$0")
  command -v "$command" >/dev/null 2>&1 && return 0
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "$script: warning: $command is not installed and apt-get is not available: install $package with" \
         "this system's package manager ($why)" >&2
    return 0
  fi
  local as_root=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      as_root=(sudo -n)
    else
      echo "$script: warning: $command is not installed; as root, run: apt-get install -y $package ($why)" >&2
      return 0
    fi
  fi
  local apt=(${as_root[@]+"${as_root[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get -y -q)
  echo "$script: installing $package ($why) with apt-get" >&2
  if ! "${apt[@]}" install --no-install-recommends "$package" >/dev/null 2>&1; then
    "${apt[@]}" update >/dev/null 2>&1 || true  # a fresh image has no package lists yet
    if ! "${apt[@]}" install --no-install-recommends "$package" >/dev/null; then
      echo "$script: warning: apt-get install $package failed ($why)" >&2
    fi
  fi
}
