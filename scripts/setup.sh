#!/usr/bin/env bash
# Installs what Ember needs and is missing, then prints nothing but progress.
#   - Debian packages (compiler tools, Boost 1.81, TOML++, spdlog, GoogleTest, Fashion-MNIST).
#   - LibTorch 2.11.0, taken from PyPI's torch==2.11.0 wheel, installed once per machine into a
#     cache outside the clone ($EMBER_CACHE, default ~/.cache/ember) so fresh clones reuse it.
# Skips LibTorch when one is already given through Torch_DIR or CMAKE_PREFIX_PATH.
# Prints the CMake prefix of the LibTorch to use on its last line (scripts/build.sh reads it).
set -euo pipefail

log() { echo "[setup] $*" >&2; }

debs=(build-essential cmake ninja-build ccache pkg-config python3-venv zlib1g-dev
      libboost1.81-dev libboost-program-options1.81-dev
      libtomlplusplus-dev libspdlog-dev libfmt-dev libgtest-dev
      libcairo2-dev dataset-fashion-mnist libopenmpi-dev openmpi-bin
      libprotobuf-dev protobuf-compiler)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# python3-venv is only needed when the interpreter cannot make a venv on its own (pyenv's can;
# Debian's python3 lacks ensurepip without the package).
if [ ${#missing[@]} -gt 0 ] && [[ " ${missing[*]} " == *" python3-venv "* ]] && python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  missing=("${missing[@]/python3-venv}")
  read -r -a missing <<<"${missing[*]}"
fi
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

torch_version=2.11.0
find_given_torch() {
  local d
  if [ -n "${Torch_DIR:-}" ] && [ -f "$Torch_DIR/TorchConfig.cmake" ]; then echo "$(cd "$Torch_DIR/../.." && pwd)"; return 0; fi
  IFS=';:' read -r -a dirs <<<"${CMAKE_PREFIX_PATH:-}"
  for d in "${dirs[@]}"; do
    [ -n "$d" ] && [ -f "$d/Torch/TorchConfig.cmake" ] && { echo "$d"; return 0; }
  done
  return 1
}
if prefix=$(find_given_torch); then
  log "using the LibTorch given in the environment: $prefix"
  echo "$prefix"; exit 0
fi

cache=${EMBER_CACHE:-$HOME/.cache/ember}
venv="$cache/torch-$torch_version"
if [ ! -f "$venv/.complete" ]; then
  log "installing torch==$torch_version from PyPI into $venv (once per machine)"
  rm -rf "$venv"; mkdir -p "$cache"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --no-input --disable-pip-version-check "torch==$torch_version"
  touch "$venv/.complete"
fi
# The tensorboard logger's tests read its event files back with TensorBoard's own reader.
tensorboard_version=2.21.0
if ! "$venv/bin/python" -c 'import tensorboard' >/dev/null 2>&1; then
  log "installing tensorboard==$tensorboard_version into $venv (tests of the tensorboard logger)"
  "$venv/bin/pip" install -q --no-input --disable-pip-version-check "tensorboard==$tensorboard_version" >&2
fi
"$venv/bin/python" -W ignore -c 'import torch.utils; print(torch.utils.cmake_prefix_path)'
