"""miles-core's pytest plugin (entry point ``pytest11``): the ``exercises`` marker.

``@pytest.mark.exercises("--clip-grad", "--lr")`` declares that a test checks the
behaviour of those command-line flags. ``tests/test_flag_audit.py`` reads the markers
statically from every test suite and fails for a flag of the parser that no test
exercises and that is not in the documented hardware-only list, so a flag can never be
accepted and silently ignored. Plugin suites use the same marker for their own flags.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "exercises(*flags): the test checks the behaviour of these command-line flags "
        "(the flag audit, tests/test_flag_audit.py, reads these markers)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for marker in item.iter_markers("exercises"):
            bad = [f for f in marker.args if not (isinstance(f, str) and f.startswith("--"))]
            if bad or not marker.args:
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.exercises takes one or more '--flag' strings, got {marker.args!r}")
