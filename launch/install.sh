#!/usr/bin/env bash
# One-step set-up on a fresh Debian machine (as root, or inside a venv): the game, Xvfb, and the package.
# Idempotent: steps whose result is already present are skipped, so CI and the README can call it every time.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"

apt_packages=()
command -v minetest >/dev/null 2>&1 || [ -x /usr/games/minetest ] || apt_packages+=(minetest)
command -v Xvfb >/dev/null 2>&1 || apt_packages+=(xvfb)
[ -x /usr/bin/chromium ] || apt_packages+=(chromium)  # the eval report tests drive it through playwright
"$PY" -m pip --version >/dev/null 2>&1 || apt_packages+=(python3-pip python3-venv)
if [ ${#apt_packages[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "install.sh: apt-get install ${apt_packages[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${apt_packages[@]}" >/dev/null
  else
    echo "install.sh: not root, so not installing: ${apt_packages[*]}." >&2
    echo "  Run: sudo apt-get install ${apt_packages[*]}   (the game tests skip without minetest)" >&2
  fi
fi

pip_flags=(--quiet --disable-pip-version-check)
# Debian's system Python refuses pip outside a venv (PEP 668); as root on a throwaway machine we go ahead.
if [ -z "${VIRTUAL_ENV:-}" ] && "$PY" -c 'import sys, sysconfig, os; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["stdlib"], "EXTERNALLY-MANAGED")) else 1)'; then
  pip_flags+=(--break-system-packages)
fi
# torch first and pinned: an unpinned torch (or one pulled in by a dependency) is a multi-GB CUDA build.
"$PY" -m pip install "${pip_flags[@]}" "torch==2.13.0"
"$PY" -m pip install "${pip_flags[@]}" -e "$here[test]"
# MineStudio's full dependency set pins numpy<2 (through gym3) and breaks jax; we need only its pure-Python
# vpt_lib (the action-space oracle) and the MinecraftSim wrapper code, so no dependencies. Pinned: the
# action-space, converter and suite tests were checked against this version's code and task files.
MINESTUDIO_VERSION=1.1.6
"$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('minestudio') != '$MINESTUDIO_VERSION')" \
  >/dev/null 2>&1 || "$PY" -m pip install "${pip_flags[@]}" --no-deps "minestudio==$MINESTUDIO_VERSION"
