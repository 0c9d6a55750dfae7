# Two commands on a fresh machine:  make demo   and   make test
VENV := .venv
PY := $(VENV)/bin/python
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: install demo test test-fast test-launchers test-all lint format clean

install: $(VENV)/.installed

# Reruns only when the pins or the installer change; the installer itself skips what is already there.
$(VENV)/.installed: requirements.txt scripts/install.sh
	bash scripts/install.sh

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
	$(PY) -m pytest -q -m "not e2e and not launcher and not launchers and not slow"

# The default suite, what CI runs: everything but what is marked slow, the real launchers on 2 local ranks included.
test: install lint
	$(PY) -m pytest -q -m "not slow"

# Only the slowest launcher checks (resume across launchers and ZeRO stages, Horovod elastic), about 4 minutes.
test-launchers: install
	$(PY) -m pytest -q -m launchers

# Everything, including the slow end-to-end checks.
test-all: install lint
	$(PY) -m pytest -q

clean:
	rm -rf runs outputs demo .pytest_cache .ruff_cache
