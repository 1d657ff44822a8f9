#!/usr/bin/env bash
# Builds the Horovod environment (.venv-hvd): Python 3.11, tensorflow-cpu
# 2.15.1, keras 3.15.1 and horovod 0.28.1 compiled with Gloo (no MPI).
# Horovod 0.28.1 does not build against TensorFlow 2.21, hence a second
# environment. Needs cmake and a C++ compiler: installed with apt-get when
# missing (root). Idempotent: a finished build leaves a stamp file.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${HVD_VENV:-.venv-hvd}"
STAMP="$VENV/.installed"
if [ -f "$STAMP" ] && [ "$STAMP" -nt requirements-hvd.txt ]; then
    exit 0
fi
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
    echo "horovod-env: installing cmake and g++ with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q && apt-get install -y -q cmake g++ make
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# Horovod's build imports TensorFlow, so TensorFlow goes first.
"$VENV/bin/pip" install -q "tensorflow-cpu==2.15.1" "numpy<2" wheel setuptools packaging psutil pyyaml cloudpickle
HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    "$VENV/bin/pip" install -q --no-build-isolation --no-cache-dir "horovod==0.28.1"
"$VENV/bin/pip" install -q -r requirements-hvd.txt
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import horovod.tensorflow as hvd, keras, tensorflow as tf; print('horovod-env:', tf.__version__, keras.__version__)"
touch "$STAMP"
