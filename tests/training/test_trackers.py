"""The trackers' one guard: a tracker that fails is said once and left out, the others and the run go on; every
registered tracker has the protocol's methods."""

from __future__ import annotations

import importlib

from dalle_pytorch.training import trackers
from dalle_pytorch.training.trackers import Guarded, Tracker


class Flaky:
    label = "Flaky at http://tracker"

    def __init__(self):
        self.rows = []

    def set_config(self, config):
        pass

    def log_metrics(self, step, row):
        if step == 2:
            raise ConnectionError("refused\nsecond line")
        self.rows.append(step)

    def log_image(self, step, key, path):
        raise AssertionError("never called once broken")

    def log_artifact(self, path):
        raise AssertionError("never called once broken")

    def close(self, status):
        raise AssertionError("never called once broken")


def test_a_failing_tracker_is_said_once_and_left_out():
    said = []
    flaky = Flaky()
    guarded = Guarded(flaky, said.append)
    for step in range(1, 5):
        guarded.log_metrics(step, {"loss": 1.0})
    guarded.log_image(4, "samples", "x.png")
    guarded.close("FINISHED")
    assert flaky.rows == [1] and guarded.broken
    assert said == [
        "warning: Flaky at http://tracker failed on the metrics of step 2 (ConnectionError: refused); the run goes "
        "on without Flaky (metrics.jsonl, samples/ and the export are in the run directory)"
    ]


def test_every_registered_tracker_has_the_protocols_methods():
    methods = [m for m in dir(Tracker) if not m.startswith("_")]
    for where in trackers.REGISTRY.values():
        module, name = where.split(":")
        cls = getattr(importlib.import_module(f"dalle_pytorch.training.trackers.{module}"), name)
        assert callable(getattr(cls, "from_config", None)), where
        assert all(callable(getattr(cls, m, None)) for m in methods if m != "label"), where
