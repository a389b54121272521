#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install hone into it.
#
# Why a script: on a CPU-only machine a plain `pip install torch` pulls a multi-GB CUDA build.
# We install a CPU torch first when no NVIDIA driver is present; hone's own `torch>=2.11` range
# is then already satisfied and pip installs nothing more for it.
#   VENV=path          where the environment lives (default .venv)
#   EXTRAS=dev         optional dependency groups to install (e.g. dev for pytest)
#   HONE_TORCH_INDEX   a wheel index for CPU torch, e.g. https://download.pytorch.org/whl/cpu
#   HONE_TORCH_SPEC    the torch requirement for CPU machines (default torch==2.13.0, whose CPU
#                      wheel ships with our dev and CI machines)
#   HONE_TRITON_SPEC   e.g. triton==3.7.1 (`make test` sets it): on a machine without an
#                      NVIDIA GPU, install this triton for the kernel tests' interpreter
#                      (TRITON_INTERPRET=1). CPU wheels of torch bring no triton, and without it
#                      tests/kernels skip their kernel cases (3.7.1 with torch 2.13.0+cpu: all pass).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
has_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
  if has_nvidia_gpu; then
    echo "hone: NVIDIA GPU found, installing the default (CUDA) torch"
  else
    spec="${HONE_TORCH_SPEC:-torch==2.13.0}"
    echo "hone: no NVIDIA GPU, installing CPU torch ($spec)"
    if [ -n "${HONE_TORCH_INDEX:-}" ]; then
      pip_install --index-url "$HONE_TORCH_INDEX" "$spec"
    else
      pip_install "$spec"
    fi
  fi
fi
target="."
[ -n "${EXTRAS:-}" ] && target=".[${EXTRAS}]"
pip_install -e "$target"
# the kernel tests run hone's Triton kernels in Triton's interpreter on the CPU: a CPU torch
# brings no triton, so it is added on request (a CUDA torch brings its own, which stays)
if [ -n "${HONE_TRITON_SPEC:-}" ] && ! "$VENV/bin/python" -c 'import triton' >/dev/null 2>&1 && ! has_nvidia_gpu; then
  echo "hone: no NVIDIA GPU, installing $HONE_TRITON_SPEC for the kernel tests (Triton's interpreter)"
  pip_install "$HONE_TRITON_SPEC"
fi
"$VENV/bin/python" -c 'import torch, hone; print(f"hone {hone.__version__} ready (torch {torch.__version__}) in '"$VENV"'")'
