"""--dist_timeout's diagnosis: the ranks whose heartbeat counter stood still are named with their hosts; other
errors are left alone. A store in a dict stands in for the process group's (the cluster tier SIGSTOPs a real rank
on a second host: tests/cluster/test_across_hosts.py)."""

import datetime

import pytest

from dalle_pytorch.training.configs import TrainConfig
from distributed import watchdog


class DictStore:
    def __init__(self):
        self.data, self.down = {}, False

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def add(self, key, n):
        if self.down:
            raise RuntimeError("store unreachable")
        self.data[key] = self.data.get(key, 0) + n
        return self.data[key]

    def set_timeout(self, timeout: datetime.timedelta):
        pass


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(watchdog, "INTERVAL", 0.05)


def test_the_silent_rank_is_named_with_its_host(fast):
    store = DictStore()
    store.set("dalle/host/1", "hostb")
    store.set("dalle/host/2", "hostc")
    beats = watchdog.Heartbeat(0, 3, 60, store=store)
    rank2 = watchdog.Heartbeat(2, 3, 60, store=store)  # beating; rank 1 was stopped and never beats
    try:
        line = beats.explain(RuntimeError("[gloo] Timed out waiting 60000ms for recv operation to complete"))
    finally:
        beats.close(), rank2.close()
    assert line.startswith("rank 1 on hostb did not answer within --dist_timeout 60 s"), line
    assert "rank 2" not in line and "--resume auto" in line
    assert beats.explain(ValueError("--batch_size must be at least 1")) is None
    assert beats.explain(RuntimeError("CUDA out of memory")) is None


def test_every_rank_beating_means_one_is_stuck_elsewhere(fast):
    store = DictStore()
    others = [watchdog.Heartbeat(r, 2, 30, store=store) for r in (0, 1)]
    try:
        line = others[0].explain(RuntimeError("Connection closed by peer"))
    finally:
        [h.close() for h in others]
    assert "every rank still runs" in line


def test_a_store_that_does_not_answer_names_rank_0(fast):
    store = DictStore()
    beats = watchdog.Heartbeat(1, 2, 30, store=store)
    store.down = True
    assert "rank 0 (which holds the process group's store)" in beats.explain(RuntimeError("timed out"))
    beats.close()


@pytest.mark.parametrize("bad", [0, -5])
def test_dist_timeout_must_be_positive(bad):
    with pytest.raises(ValueError, match="--dist_timeout must be a positive number of seconds"):
        TrainConfig(dist_timeout=bad).validate()
