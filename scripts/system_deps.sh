#!/usr/bin/env bash
# System packages the envs need, installed with apt where missing (run by `make install` / `make test`):
#   bwrap (bubblewrap): the terminal-task sandbox     java (a JRE): ScienceWorld's simulator
#   git: the git terminal tasks                       gcc: building jericho (TextWorld) from source
# Fails with a clear message where they cannot be installed (no apt, not root and no sudo).
set -euo pipefail
need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
command -v java >/dev/null 2>&1 || need+=(default-jre-headless)
command -v git >/dev/null 2>&1 || need+=(git)
command -v gcc >/dev/null 2>&1 || need+=(gcc)  # jericho (TextWorld's interpreter) builds from source
[ ${#need[@]} -eq 0 ] && exit 0
echo "system_deps: installing ${need[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "system_deps: ERROR: need ${need[*]} but not root and no passwordless sudo; install them (Debian/Ubuntu: apt-get install ${need[*]}) and rerun" >&2
    exit 1
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system_deps: ERROR: need ${need[*]} and apt-get is not available; install them with your package manager and rerun" >&2
  exit 1
fi
$SUDO apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null || {
  echo "system_deps: ERROR: apt-get could not install ${need[*]}" >&2; exit 1; }
for c in bwrap java git gcc; do command -v "$c" >/dev/null || { echo "system_deps: ERROR: $c still missing" >&2; exit 1; }; done
