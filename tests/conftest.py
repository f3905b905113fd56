"""Test markers. ``distributed``: the test launches real ranks (the ``deepspeed`` launcher, gloo,
several processes); everything else is single-process and fast. ``make test`` runs both;
``make test-unit`` (``pytest -m "not distributed"``) the fast half alone."""


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: launches real ranks (deepspeed launcher, gloo, processes)")
