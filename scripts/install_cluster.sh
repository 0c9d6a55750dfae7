#!/usr/bin/env bash
# What the cluster tests (tests/cluster/) need beside .venv: Debian's SLURM, munge, OpenSSH and Open MPI, and
# mpi4py built against that Open MPI (it tells every rank under mpirun where rank 0 is); nginx for the tests that
# stream shards over HTTP (tests/http_shards.py starts its own on 127.0.0.1); chromium and its driver for the
# page test of serve.py (tests/inference/test_http_app.py). Needs root and apt;
# `make test` runs it when it is root. Idempotent: installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(slurm-wlm munge openssh-server openssh-client openmpi-bin libopenmpi-dev iproute2 util-linux nginx chromium chromium-driver)
MPI4PY_VERSION=4.1.2

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "==> [install-cluster] apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/tmp/dalle-install-cluster.log 2>&1 || {
    apt-get update -q >>/tmp/dalle-install-cluster.log 2>&1
    apt-get install -y -q --no-install-recommends "${missing[@]}" >>/tmp/dalle-install-cluster.log 2>&1 || {
      tail -n 30 /tmp/dalle-install-cluster.log >&2
      echo "[install-cluster] FAILED: apt-get install ${missing[*]} (log: /tmp/dalle-install-cluster.log)" >&2
      exit 1
    }
  }
  # Where init lets it, the nginx package starts a system nginx on port 80: the tests need none, so stop the one
  # this install started, by its pid file (never by name: other nginx may run here)
  if [[ " ${missing[*]} " == *" nginx "* && -s /run/nginx.pid ]]; then
    kill "$(cat /run/nginx.pid)" 2>/dev/null || true
  fi
fi
if ! .venv/bin/python -c "import mpi4py" 2>/dev/null; then
  echo "==> [install-cluster] mpi4py $MPI4PY_VERSION against Open MPI"
  .venv/bin/pip install -q "mpi4py==$MPI4PY_VERSION" 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
