# Two commands on a fresh machine:  make demo   and   make test
VENV := .venv
PY := $(VENV)/bin/python
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: install install-cluster lock demo test test-fast test-launchers test-cluster test-all lint format clean

install: $(VENV)/.installed

# Reruns only when the pins or the installer change; the installer itself skips what is already there.
$(VENV)/.installed: requirements.lock scripts/install.sh
	bash scripts/install.sh

# The cluster tests' system packages (SLURM, munge, OpenSSH, Open MPI) and mpi4py: root and apt.
install-cluster: install
	bash scripts/install_cluster.sh

# requirements.lock from requirements.txt's pins: every package CI installs, at one version (uv's resolver)
lock: install
	$(VENV)/bin/uv pip compile requirements.txt --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
		-o requirements.lock -q --custom-compile-command "make lock"

demo: install
	$(PY) scripts/demo.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# A developer's loop: models, data, schedules, the loop with a fake task, 2-rank checks by fork + Gloo (under a minute).
test-fast: install
	$(PY) -m pytest -q -m "not e2e and not launcher and not launchers and not slow and not cluster"

# The default suite, what CI runs: everything but what is marked slow, the real launchers on 2 local ranks
# included, and as root the cluster tier (2 hosts in network namespaces, a real SLURM, mpirun).
ROOT_USER := $(shell [ "$$(id -u)" = 0 ] && echo yes)
ifeq ($(ROOT_USER),yes)
test: install lint install-cluster
	$(PY) -m pytest -q -m "not slow"
else
test: install lint
	@echo "make test: not root, so the cluster tests (tests/cluster: network namespaces, SLURM, mpirun) are left out"
	$(PY) -m pytest -q -m "not slow and not cluster"
endif

# Only the cluster tier (root): 2 hosts on this machine, every launcher across them, the sbatch examples.
test-cluster: install-cluster
	$(PY) -m pytest -q -m cluster

# Only the slowest launcher checks (resume across launchers and ZeRO stages, Horovod elastic), about 4 minutes.
test-launchers: install
	$(PY) -m pytest -q -m launchers

# Everything, including the slow end-to-end checks.
test-all: install lint install-cluster
	$(PY) -m pytest -q

clean:
	rm -rf runs outputs demo .pytest_cache .ruff_cache
