#!/usr/bin/env bash
# Installs everything the project needs into .venv/ (see DEVELOPERS.md for why each step looks as it does).
# Idempotent: each step checks whether its result is already there. Run through `make install`.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
VENV=.venv
CACHE=${DALLE_CACHE:-$HOME/.cache/dalle-pytorch}
HOROVOD_VERSION=0.28.1
YTTM_VERSION=1.0.6
TAMING_VERSION=0.0.6
DALL_E_VERSION=0.1
IMG2DATASET_VERSION=1.47
export PIP_DISABLE_PIP_VERSION_CHECK=1

step() { echo "==> [install] $*"; }
fail() {
  echo "[install] FAILED at step: $CURRENT_STEP" >&2
  echo "[install] what to try: $HINT" >&2
  exit 1
}
trap fail ERR

CURRENT_STEP="create $VENV"; HINT="check that $PY exists (set PYTHON=/path/to/python3.11), then rm -rf $VENV and rerun make install"
if [ ! -x "$VENV/bin/python" ]; then
  step "$CURRENT_STEP"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip wheel setuptools 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
VPY="$VENV/bin/python"
# pip, without the warnings about this machine's missing extra index folders
PIP=pip_quiet
pip_quiet() {
  "$VENV/bin/pip" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
  return "${PIPESTATUS[0]}"
}

have() { "$VPY" - "$@" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    try:
        if want and version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PYEOF
}

CURRENT_STEP="torch + torchvision"; HINT="torch==2.14.1 and torchvision==0.29.1 must install together (see requirements.txt); check 'pip download torch==2.14.1' works"
if ! have torch==2.14.1 torchvision==0.29.1; then
  step "$CURRENT_STEP (large download the first time)"
  "$PIP" install -q torch==2.14.1 torchvision==0.29.1
fi

CURRENT_STEP="youtokentome (needs Cython at build time)"; HINT="install gcc and the Python headers, then rerun make install"
if ! have youtokentome==$YTTM_VERSION; then
  step "$CURRENT_STEP"
  "$PIP" install -q "Cython<3.2" setuptools wheel
  "$PIP" install -q --no-build-isolation youtokentome==$YTTM_VERSION
fi

# requirements.lock: every package at the version CI runs, made from requirements.txt by `make lock` (uv)
CURRENT_STEP="requirements.lock"; HINT="read the pip error above; a pin in requirements.lock may be unavailable from your index (make lock remakes it from requirements.txt)"
if ! "$VPY" -c "import deepspeed, webdataset, einops, tokenizers, tqdm, safetensors, pytest, PIL" 2>/dev/null \
   || [ requirements.lock -nt "$VENV/.requirements-installed" ]; then
  step "$CURRENT_STEP (deepspeed with DS_BUILD_OPS=0: ops are JIT-built when first used)"
  export DS_BUILD_OPS=0
  "$PIP" install -q -r requirements.lock
  touch "$VENV/.requirements-installed"
fi

# Without their dependencies: taming's pull an old pytorch-lightning and omegaconf, DALL-E's mypy and blobfile;
# the tests import only the model code (see tests/pretrained_refs.py). The project itself never imports them,
# and the tests compare with a fixture without them, so a failure here is a warning, not the end of the install.
if ! have taming-transformers-rom1504==$TAMING_VERSION DALL-E==$DALL_E_VERSION; then
  step "reference tokenizers for tests/models/test_pretrained.py (taming-transformers, DALL-E; optional)"
  if ! "$PIP" install -q --no-deps taming-transformers-rom1504==$TAMING_VERSION DALL-E==$DALL_E_VERSION; then
    echo "[install] warning: taming-transformers-rom1504 and DALL-E did not install (read the pip error above);" \
      "tests/models/test_pretrained.py skips its live comparisons and still compares with the fixture" >&2
  fi
fi

# --tokenizer chinese reads bert-base-chinese's vocab.txt from cn-clip's package data (never imported: its own
# dependencies, lmdb among them, have no wheel for this Python), so it installs without them.
if ! have cn-clip==1.6.0; then
  step "cn-clip 1.6.0 without its dependencies (the vocabulary of --tokenizer chinese)"
  "$PIP" install -q --no-deps cn-clip==1.6.0 ||
    echo "[install] warning: cn-clip did not install; --tokenizer chinese then needs --bpe_path vocab.txt" >&2
fi

# lucidrains' dalle-pytorch 1.6.6, for tests/compat/test_reference.py only: into a folder of its own, not .venv, since its
# package is also called dalle_pytorch; the test runs it in a separate process (tests/reference_run.py).
REFERENCE_DIR="$CACHE/reference/dalle-pytorch-1.6.6"
if [ ! -f "$REFERENCE_DIR/.installed" ]; then
  step "reference dalle-pytorch 1.6.6 for tests/compat/test_reference.py (optional, into $REFERENCE_DIR)"
  if "$PIP" install -q --no-deps --target "$REFERENCE_DIR" dalle-pytorch==1.6.6 axial_positional_embedding==0.2.1 \
    rotary-embedding-torch==0.1.5; then
    touch "$REFERENCE_DIR/.installed"
  else
    echo "[install] warning: dalle-pytorch 1.6.6 did not install; tests/compat/test_reference.py compares with its fixture" >&2
  fi
fi

# img2dataset 1.47, for tests/data/test_img2dataset.py and test_s3_streams.py only: a real client writes the shards
# that the trainers read (with s3fs: into the tests' S3 server).
# A venv of its own, not .venv: its dependencies (pandas, pyarrow, opencv, albumentations, wandb) would move our pins.
IMG2DATASET_DIR="$CACHE/img2dataset-$IMG2DATASET_VERSION"
if [ ! -f "$IMG2DATASET_DIR/.installed" ]; then
  step "img2dataset $IMG2DATASET_VERSION for tests/data/test_img2dataset.py (optional, a venv in $IMG2DATASET_DIR)"
  rm -rf "$IMG2DATASET_DIR"
  if "$PY" -m venv "$IMG2DATASET_DIR" \
    && "$IMG2DATASET_DIR/bin/pip" install -q img2dataset==$IMG2DATASET_VERSION s3fs==2026.9.0 2>&1 | { grep -v "^WARNING: Location" || true; } \
    && NO_ALBUMENTATIONS_UPDATE=1 "$IMG2DATASET_DIR/bin/img2dataset" --help >/dev/null 2>&1; then
    touch "$IMG2DATASET_DIR/.installed"
  else
    echo "[install] warning: img2dataset $IMG2DATASET_VERSION did not install (read the pip error above);" \
      "tests/data/test_img2dataset.py skips" >&2
  fi
elif ! "$IMG2DATASET_DIR/bin/python" -c "import s3fs" 2>/dev/null; then  # made before it wrote to S3
  "$IMG2DATASET_DIR/bin/pip" install -q s3fs==2026.9.0 2>&1 | { grep -v "^WARNING: Location" || true; } ||
    echo "[install] warning: s3fs did not install into $IMG2DATASET_DIR: its S3 test skips" >&2
fi

CURRENT_STEP="horovod $HOROVOD_VERSION (built from source with Gloo, CPU-only)"
HINT="needs cmake, g++ and make; the build log is in $CACHE/horovod-build.log; delete $CACHE/wheels to force a rebuild"
if ! have horovod==$HOROVOD_VERSION; then
  mkdir -p "$CACHE/wheels"
  wheel=$(ls "$CACHE"/wheels/horovod-$HOROVOD_VERSION-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    step "$CURRENT_STEP: building the wheel (about 4 minutes on 2 cores, cached in $CACHE/wheels afterwards)"
    src=$(mktemp -d)
    "$PIP" download -q --no-deps --no-binary :all: horovod==$HOROVOD_VERSION -d "$src"
    tar -xzf "$src"/horovod-$HOROVOD_VERSION.tar.gz -C "$src"
    # horovod 0.28.1 asks for C++14; its core builds as C++17 and the torch extension needs C++20 for the
    # headers of torch 2.14 ("C++20 or later compatible compiler is required to use PyTorch").
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$src/horovod-$HOROVOD_VERSION/CMakeLists.txt"
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 20/' "$src/horovod-$HOROVOD_VERSION/horovod/torch/CMakeLists.txt"
    # The torch wheel is a CUDA build, which makes horovod build a CUDAExtension that links cudart; this
    # machine has nvcc but no CUDA runtime and no GPU, so tell horovod's CMake that torch is CPU-only.
    sed -i 's/print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None)) else False)/print(False)/' \
      "$src/horovod-$HOROVOD_VERSION/cmake/Modules/FindPytorch.cmake"
    grep -q 'print(False)' "$src/horovod-$HOROVOD_VERSION/cmake/Modules/FindPytorch.cmake"
    # CPU-only Gloo build: a CUDA compiler may exist without a GPU, and CUDA ops would then fail at runtime.
    if ! env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
        HOROVOD_WITHOUT_MXNET=1 HOROVOD_GPU_OPERATIONS= HOROVOD_CPU_OPERATIONS=GLOO CMAKE_POLICY_VERSION_MINIMUM=3.5 \
        MAKEFLAGS="-j$(nproc)" \
        "$VENV/bin/pip" wheel --no-deps --no-build-isolation -w "$src/dist" "$src/horovod-$HOROVOD_VERSION" \
        >"$CACHE/horovod-build.log" 2>&1; then
      tail -n 40 "$CACHE/horovod-build.log" >&2
      false
    fi
    cp "$src"/dist/horovod-*.whl "$CACHE/wheels/"
    rm -rf "$src"
    wheel=$(ls "$CACHE"/wheels/horovod-$HOROVOD_VERSION-*.whl | head -n 1)
  fi
  step "installing $(basename "$wheel")"
  "$PIP" install -q --no-deps "$wheel"
  "$PIP" install -q cloudpickle psutil pyyaml packaging cffi
fi

CURRENT_STEP="build DeepSpeed's CPU ops (a minute or two the first time)"
HINT="delete $VENV/torch_extensions and rerun make install"
if [ ! -f "$VENV/.ops-warm" ] || [ ! -d "$VENV/torch_extensions" ]; then
  step "$CURRENT_STEP"
  "$VPY" scripts/warm_ops.py
  touch "$VENV/.ops-warm"
fi

CURRENT_STEP="check the install"; HINT="rm -rf $VENV and rerun make install; if horovod fails, delete $CACHE/wheels too"
"$VPY" - <<'PYEOF'
import torch, torchvision, deepspeed, youtokentome, webdataset, einops  # noqa: F401
import horovod.torch as hvd
assert hvd.gloo_built(), "horovod was built without Gloo"
print(f"[install] ok: torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"deepspeed {deepspeed.__version__}, horovod {hvd.__version__ if hasattr(hvd, '__version__') else 'ok'}")
PYEOF
touch "$VENV/.installed"
