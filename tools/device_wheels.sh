#!/usr/bin/env bash
# Download, on a machine with package access, the pure-Python wheels an offline GPU machine with
# torch alone needs to run `lctrain train` (the CLI's Hydra stack): hydra-core, omegaconf and
# antlr4-python3-runtime, which PyPI has as a source archive only and is built into a wheel
# here. About 0.4 MB. tools/gpu_check.py itself needs none of them. docs/gpu.md has the command
# that installs them on the GPU machine and runs the check.
#
#   bash tools/device_wheels.sh DIR      # DIR: where the wheels go (e.g. .whl, git-ignored)
set -euo pipefail
dir=${1:?usage: tools/device_wheels.sh DIR}
mkdir -p "$dir"
pip=(python3 -m pip --disable-pip-version-check -q)
"${pip[@]}" download --no-deps --only-binary=:all: -d "$dir" hydra-core==1.3.2 omegaconf==2.3.0
"${pip[@]}" wheel --no-deps -w "$dir" antlr4-python3-runtime==4.9.3
ls -l "$dir"
