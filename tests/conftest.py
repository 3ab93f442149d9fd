"""Shared pytest setup: a per-test timeout, the repo root importable, daemon fixtures."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# `tests.support` must import from test modules (collected with --import-mode=importlib)
# and from the ranks that torch's "spawn" starts, which inherit sys.path.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

DEFAULT_TEST_TIMEOUT = 120  # seconds; pyproject's global 300 is the outer bound


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TEST_TIMEOUT))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    module = sys.modules.get("tests.support.daemon_process")
    if module is not None:
        module.kill_all_daemons()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def daemon_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """Start tierckptd processes for one test; every one is killed and removed afterwards.

    When the test failed, each daemon's log tail is printed (shown in the report).
    """
    from tests.support.daemon_process import DaemonProcess

    started: list[DaemonProcess] = []

    def make(
        config_overrides: dict[str, dict[str, Any]] | None = None, **kwargs: Any
    ) -> DaemonProcess:
        kwargs.setdefault("name", f"n{len(started)}")
        proc = DaemonProcess(config_overrides, start=False, **kwargs)
        started.append(proc)
        proc.start()
        return proc

    yield make
    call_report = getattr(request.node, "rep_call", None)
    for proc in started:
        if call_report is not None and call_report.failed:
            print(f"{proc!r}\n{proc.log_tail()}")
        proc.cleanup()


@pytest.fixture
def daemon(daemon_factory: Callable[..., Any]) -> Any:
    """One running tierckptd with the test defaults (2 GiB budget, keep every checkpoint)."""
    return daemon_factory()


@pytest.fixture(autouse=True)
def _no_ambient_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests name their daemon explicitly; an ambient TIERCKPT_DAEMON must not leak in."""
    monkeypatch.delenv("TIERCKPT_DAEMON", raising=False)
