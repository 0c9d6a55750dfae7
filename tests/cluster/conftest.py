"""The cluster tier: two hosts built on this machine (tests/cluster_hosts.py), up once for the session and
torn down after it. Every test here is marked `cluster`; without root or the cluster's packages they skip with
the reason (`make test` says so in one line and installs the packages when it is root)."""

import os

import pytest
from cluster_hosts import Cluster, missing

HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.path).startswith(HERE):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    why = missing()
    if why:
        pytest.skip(why)
    c = Cluster(str(tmp_path_factory.mktemp("cluster"))).up()
    yield c
    c.down()
