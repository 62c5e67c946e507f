#!/usr/bin/env bash
# Sets up what is missing, builds, and trains the Fashion-MNIST example (configs/fashion_mnist.toml).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# Only what training needs: the test suite and the benches are scripts/test.sh's to build.
EMBER_BUILD_TARGET=runnable bash scripts/build.sh
exec ./build/engine/engine "$@" configs/fashion_mnist.toml
