#!/usr/bin/env bash
# Create .venv-rewards: diffalign with the open_clip rewards (HPSv2 / HPSv2.1), which need
# torchvision. torch 2.14.1 + torchvision 0.29.1 is the pair these machines carry for Python 3.11
# (a CUDA build, about 6 GB, that runs on the CPU); on a GPU machine install your own pair first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-rewards/bin/python ]; then
  "$PY" -m venv .venv-rewards
fi
. .venv-rewards/bin/activate
python -m pip install --quiet --upgrade pip
if ! python -c "import torch, torchvision" 2>/dev/null; then
  python -m pip install --quiet "torch==${TORCH_VERSION:-2.14.1}" "torchvision==${TORCHVISION_VERSION:-0.29.1}"
fi
python -m pip install --quiet -e ".[dev,rewards]"
python -c "import open_clip, torch, torchvision; print(f'open_clip {open_clip.__version__} ready (torch {torch.__version__}, torchvision {torchvision.__version__})')"
