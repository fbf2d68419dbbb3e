#!/usr/bin/env bash
# The GPU check (tools/gpu_check.py): random-weight Llama-3-8B- and Qwen3-8B-shaped targets built
# in code, EAGLE-3 and DFlash trained with their baseline loss and with VAT in bf16, step time, tokens/s,
# peak memory, the VAT / baseline step-time ratio, and greedy decoding checked against HF generate
# (bf16: where outputs part and by how many bf16 spacings; float32: token for token).
# No network, nothing but this repository: the machine's own python3 (torch, transformers) runs it.
#   bash tools/gpu_check.sh [OUT_DIR]      -> OUT_DIR/gpu_check.json (default: .)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-.}}
mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available())"
timeout 470 "$PY" tools/gpu_check.py --out "$out/gpu_check.json" "${@:2}"
