"""``--repeat N``: every selected test N times, each a test of its own (``test_x[...-0]`` ... ``[...-N-1]``), for
hunting flakes. Not part of the suite: load it with ``-p tests.repeat``, e.g.

    bash scripts/test.sh -n 0 -p tests.repeat --repeat 20 tests/unit/test_tool_sandbox.py -k setsid

Copies of a node id on the command line are folded into one by pytest, and a test item cannot run twice, so each
repetition is a parametrization: fixtures are set up for each, module-scoped ones once per module as usual.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--repeat", type=int, default=1, help="run each selected test this many times (tests/repeat.py)")


@pytest.fixture
def _repetition(request: pytest.FixtureRequest) -> int:
    return request.param


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    n = metafunc.config.getoption("--repeat")
    if n > 1:
        metafunc.fixturenames.append("_repetition")
        metafunc.parametrize("_repetition", range(n), indirect=True)
