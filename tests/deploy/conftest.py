"""Tests of the deployment files: the Dockerfile and its build context, and the compose files.

The compose files are checked by a real compose implementation, Debian's `docker-compose`
(1.29); without it those tests are skipped, and the reason is printed at the start and in the
summary. `make test` installs it first wherever apt-get can.
"""

import shutil

import pytest

COMPOSE_MISSING = (
    "docker-compose is not installed, so the compose files are not checked: `make test` installs "
    "Debian's package where apt-get can (as root); or `apt-get install docker-compose`"
)


def pytest_report_header() -> str | None:
    """Said first when tests/deploy is among the paths given (`pytest tests/deploy`)."""
    if shutil.which("docker-compose") is None:
        return f"tests/deploy/test_compose.py will be SKIPPED: {COMPOSE_MISSING}"
    return None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Said last in every run that collected these tests, so a skip is never silent."""
    if shutil.which("docker-compose") is None:
        terminalreporter.write_sep("=", "compose file tests SKIPPED", yellow=True, bold=True)
        terminalreporter.write_line(COMPOSE_MISSING)
