#!/usr/bin/env bash
# Create .venv and install diffalign with its test tools and the demo app (CPU is enough).
# torch is installed first and pinned: a plain `torch` requirement on a machine without it pulls
# a multi-GB CUDA build; 2.13.0 is the CPU wheel these machines carry. On a GPU machine install
# the torch build you want first: this script keeps an existing torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
# DeepSpeed (ZeRO-1/2, also on CPU over gloo) is built against the torch above: no build isolation
# (which would pull a CUDA torch into the build environment) and no compiled CUDA ops.
if ! python -c "import deepspeed" 2>/dev/null; then
  python -m pip install --quiet "setuptools>=70.1"  # builds wheels without the 'wheel' package
  DS_BUILD_OPS=0 python -m pip install --quiet --no-build-isolation "deepspeed>=0.16,<0.20"
fi
# quant: torchao, bitsandbytes and optimum-quanto CPU wheels, so that the low-precision policy copies
# (int8 / int4 / fp8 weight-only emulation) are tested for real; ocr: tesserocr (a 6 MB wheel with
# libtesseract inside) for the ocr reward, whose English model comes from Debian's tesseract-ocr-eng
python -m pip install --quiet -e ".[dev,demo,quant,data,ocr]"
# TensorBoard (light, CPU only) so that the tracker tests run; wandb, mlflow and trackio are in
# the `tracking` extra, and their tests skip where they are not installed
python -m pip install --quiet "tensorboard>=2.14"
python -c "import diffalign, torch; print(f'diffalign {diffalign.__version__} ready (torch {torch.__version__})')"
