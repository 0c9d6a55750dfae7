#!/usr/bin/env bash
# The CUDA path in one prepared run (see bench/gpu.py): bash bench/gpu.sh [--cpu]
# On the GPU machine: the checkout's .venv if there is one, else the machine's python with this repo's pins. What
# that python lacks comes from bench/wheels/ (made here by bench/gpu_wheels.sh, carried with the run), installed
# offline first. All of the output goes to $OUT/gpu.log as it comes, so a run cut short still leaves its log.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export OUT=${OUT:-bench-gpu}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONUNBUFFERED=1  # the log keeps up with the run
WHEELS=bench/wheels
BUDGET=530  # seconds for the whole command: under 9 minutes, inside the device's 10 a command
mkdir -p "$OUT"

join() { local s; s=$(printf '%s, ' "$@"); s=${s%, }; echo "${s:-nothing}"; }

# Installs the wheels whose package $PY lacks or has older (typing-extensions), one at a time (one failing leaves
# the others), and says in one line what it installed and what it could not; a python that has them all (this
# checkout's .venv) installs nothing.
install_wheels() {
  if [ ! -d "$WHEELS" ]; then
    echo "wheels: no $WHEELS/ (bash bench/gpu_wheels.sh makes it); nothing installed"
    return 0
  fi
  local todo kind name rest old log="$OUT/wheels.log" installed=() missing=() compiled=() see=""
  # "wheel NAME FILE [OLD]" for each wheel whose package is absent or older (OLD), "absent NAME WHY" for what was
  # not built and is absent
  if ! todo=$("$PY" - "$WHEELS" <<'PYEOF'
import glob
import os
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    from packaging.version import Version
except ImportError:  # then only an absent package counts
    Version = None


def installed(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None


wheels = sys.argv[1]
for path in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
    name, want = os.path.basename(path).split("-")[:2]
    name = name.lower().replace("_", "-")  # the project's name
    have = installed(name)
    if have is None or (Version and Version(have) < Version(want)):
        print("wheel", name, path, have or "", sep="\t")
if os.path.exists(os.path.join(wheels, "NOT_BUILT")):
    for line in open(os.path.join(wheels, "NOT_BUILT")):
        name, _, why = line.rstrip("\n").partition("\t")
        if name and installed(name) is None:
            print("absent", name, why, sep="\t")
PYEOF
  ); then
    echo "wheels: $PY could not list its packages; nothing installed"
    return 0
  fi
  while IFS=$'\t' read -r kind name rest old; do
    case $kind in
      wheel)
        if [ "$SECONDS" -gt 120 ]; then  # each install takes seconds; minutes would be a pip in trouble
          missing+=("$name (no time left for it)")
        elif PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore timeout 60 "$PY" -m pip install -q \
          --no-index --no-deps --find-links "$WHEELS" "$rest" >>"$log" 2>&1; then
          installed+=("$name${old:+ (over $old)}")
          [[ $rest == *-none-any.whl ]] || compiled+=("$name")
        else
          missing+=("$name (pip failed: $(tail -n 1 "$log" | sed 's/^ERROR: //' | cut -c 1-150))") see=" (pip: $log)"
        fi
        ;;
      absent) missing+=("$name ($rest)") ;;
    esac
  done <<<"$todo"
  # a compiled wheel can install and still not load (a libstdc++ older than the one it was built with)
  for name in "${compiled[@]}"; do
    "$PY" -c "import ${name//-/_}" >>"$log" 2>&1 || missing+=("$name (installed, but import fails)") see=" (pip: $log)"
  done
  if [ ${#installed[@]} -eq 0 ] && [ ${#missing[@]} -eq 0 ]; then
    echo "wheels: nothing to install ($PY has every package in $WHEELS/)"
  else
    echo "wheels: installed ${installed[*]:-nothing}; not installed: $(join "${missing[@]}")$see"
  fi
}

run() {
  install_wheels || echo "wheels: the install step stopped early (see $OUT/wheels.log); going on"
  # the python part gets what the install left of the budget, at most the 8 minutes it is sized for (+10 s to die)
  local left=$((BUDGET - SECONDS - 10))
  [ "$left" -le 480 ] || left=480
  timeout -k 10 "$left" "$PY" bench/gpu.py --out "$OUT" "$@"
}
run "$@" 2>&1 | tee "$OUT/gpu.log"
