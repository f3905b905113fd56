"""Test markers. ``distributed``: the test launches real ranks (the ``deepspeed`` launcher, gloo,
several processes); everything else is single-process and fast. ``make test`` runs both;
``make test-unit`` (``pytest -m "not distributed"``) the fast half alone.

Also the planner tests' shared fixtures: the vendored PipeDream profiles and a plan of VGG-16."""
import pytest

from planner_fixtures import PROFILES, V100_CLUSTER


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: launches real ranks (deepspeed launcher, gloo, processes)")


@pytest.fixture(scope="module")
def vgg():
    from hippie_ds.planner import read_pipedream
    return read_pipedream(PROFILES / "vgg16.txt")


@pytest.fixture(scope="module")
def gnmt():
    from hippie_ds.planner import read_pipedream
    return read_pipedream(PROFILES / "gnmt.txt")


@pytest.fixture(scope="module")
def vgg_plan(vgg):
    from hippie_ds.planner import make_plan, parse_cluster
    return make_plan(vgg, parse_cluster(V100_CLUSTER), 2048)
