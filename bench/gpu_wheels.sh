#!/usr/bin/env bash
# The wheels the GPU machine's python lacks, for bench/gpu.sh to install there offline: bash bench/gpu_wheels.sh
# That machine has CPython 3.12 with torch (CUDA), numpy, pyyaml, tokenizers, einops, tqdm, regex, msgpack, psutil,
# py-cpuinfo, ninja, packaging, typing-extensions, nvidia-ml-py, but no registry and none of the packages below.
# Everything goes into bench/wheels/ (git-ignored: carry it with the run), at the pins of requirements.txt and
# requirements.lock. Idempotent: a wheel already there is kept. Fails if the folder outgrows what a run may carry.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=bench/wheels
PIP=.venv/bin/pip
LIMIT_MIB=40  # a run carries 64 MiB of ignored folders in all; the rest is for whatever else travels
YTTM_VERSION=1.0.6  # as scripts/install.sh
export PIP_DISABLE_PIP_VERSION_CHECK=1
shopt -s nocaseglob nullglob  # wheel names keep their project's spelling (python_hostlist, Hjson, ...)
mkdir -p "$DIR"

step() { echo "==> [gpu_wheels] $*"; }
pinned() {  # the version requirements.lock pins for $1
  local v
  v=$(sed -n "s/^$1==\([^ ]*\).*/\1/p" requirements.lock)
  [ -n "$v" ] || { echo "[gpu_wheels] $1 is not pinned in requirements.lock (make lock)" >&2; exit 1; }
  echo "$v"
}
have() { local f=("$DIR/${1//-/_}-$2-"${3:-*}.whl); [ ${#f[@]} -gt 0 ]; }  # name version [tags]

# without pip's warnings about this machine's missing extra index folders (as scripts/install.sh)
quiet() {
  "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
  return "${PIPESTATUS[0]}"
}

# No wheel on PyPI, only an sdist: build a pure-python wheel. DeepSpeed as scripts/install.sh installs it, with
# DS_BUILD_OPS=0 (its ops are JIT-built when first used; a wheel with prebuilt ops would be tied to this python).
for name in deepspeed python-hostlist; do
  version=$(pinned "$name")
  if ! have "$name" "$version"; then
    step "$name $version (built from its sdist)"
    DS_BUILD_OPS=0 quiet "$PIP" wheel -q --no-deps -w "$DIR" "$name==$version"
  fi
  have "$name" "$version" "*-none-any" || {
    echo "[gpu_wheels] the $name wheel in $DIR is not pure python (py3-none-any): rm $DIR/${name//-/_}-* and" \
      "rerun; for deepspeed, check that DS_BUILD_OPS=0 reached its setup.py" >&2
    exit 1
  }
done

# The other packages the machine lacks (pydantic's own dependencies at their pins), for CPython 3.12 on x86_64
# Linux; the pure-python ones are py3-none-any and fit any python. typing-extensions too: the machine has one,
# perhaps older than the 4.16 pydantic 2.14 asks for, and bench/gpu.sh installs a wheel over an older version.
for name in hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions webdataset braceexpand \
  ftfy wcwidth torch-fidelity torchmetrics lightning-utilities; do
  version=$(pinned "$name")
  if ! have "$name" "$version"; then
    step "$name $version"
    quiet "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
      --platform manylinux2014_x86_64 -d "$DIR" "$name==$version"
  fi
done

# youtokentome has no cp312 wheel on PyPI: build it with a local CPython 3.12 (and its headers) if there is one.
# Built on this glibc, its extension must not ask for a glibc newer than 2.28, the one torch's CUDA wheels ask of
# the machine: linked to libstdc++ dynamically it asks glibc for 2.14 at most (statically, for this one's 2.36).
NOT_BUILT=()
find_py312() {
  local py
  for py in "$(.venv/bin/uv python find 3.12 2>/dev/null || true)" "$(command -v python3.12 || true)" \
    "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
    [ -x "$py" ] && "$py" -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null &&
      { echo "$py"; return 0; }
  done
  return 1
}
newest() { objdump -T "$1" | grep -oE "$2_[0-9.]+" | sort -uV | tail -n 1; }  # the newest symbol version asked
if ! have youtokentome "$YTTM_VERSION"; then
  if PY312=$(find_py312); then
    step "youtokentome $YTTM_VERSION (built with $PY312)"
    build=$(mktemp -d)
    "$PY312" -m venv "$build/venv"
    quiet "$build/venv/bin/pip" install -q "Cython<3.2" setuptools wheel  # as scripts/install.sh
    quiet "$build/venv/bin/pip" wheel -q --no-cache-dir --no-deps --no-build-isolation -w "$build/dist" \
      "youtokentome==$YTTM_VERSION"
    "$PY312" -m zipfile -e "$build"/dist/*.whl "$build/unpacked"
    so=$(echo "$build"/unpacked/*.so)
    glibc=$(newest "$so" GLIBC)
    if [ "$(printf '%s\n' "$glibc" GLIBC_2.28 | sort -V | tail -n 1)" = GLIBC_2.28 ]; then
      cp "$build"/dist/*.whl "$DIR/"
      echo "youtokentome's extension asks for $glibc and $(newest "$so" GLIBCXX) (libstdc++ of GCC 12 or later)"
    else
      NOT_BUILT+=("youtokentome	built here, but it asks for $glibc, newer than the glibc 2.28 torch asks for")
    fi
    rm -rf "$build"
  else
    NOT_BUILT+=("youtokentome	no cp312 wheel on PyPI and no python3.12 with headers to build one here")
  fi
fi
# Horovod is built from source against the machine's torch and NCCL (about 4 minutes on 2 cores for Gloo alone):
# not here, where neither is, and not within the run, whose minutes are for the checks.
NOT_BUILT+=("horovod	not built: no time within the run")
# torch-fidelity's FID needs scipy (its cp312 wheel is about 35 MiB, more than a run carries with the rest)
NOT_BUILT+=("scipy	not carried: 35 MiB; the evaluation's row needs it on the machine")
printf '%s\n' "${NOT_BUILT[@]}" >"$DIR/NOT_BUILT"  # what bench/gpu.sh reports as not installed

ls -l "$DIR"/*.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $NF}'
bytes=$(du -cb "$DIR"/* | tail -n 1 | cut -f 1)
echo "total: $(awk -v b="$bytes" 'BEGIN { printf "%.2f MiB", b / 1048576 }') in $DIR (limit $LIMIT_MIB MiB)"
sed 's/\t\(.*\)/ (\1)/; s/^/left out: /' "$DIR/NOT_BUILT"
if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "[gpu_wheels] $DIR is over $LIMIT_MIB MiB: too much to carry with the run (delete stale wheels there)" >&2
  exit 1
fi
