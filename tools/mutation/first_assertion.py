"""A pytest plugin for ``verdict.py``: every failing test is written to
``$JAXACCUM_MUTATION_FAILURES`` (one JSON line: the test, the phase, the exception, whether it
is an assertion), and the session stops at the first failure on an assertion, not at the
first failure: a mutant that crashes one test and fails an assertion in a later one is killed
by that assertion, as a full run would show (up to 5 tests failed on other exceptions: then the
session stops, the mutant crashed).

An assertion is an ``AssertionError`` raised outside the library (one that the library's own
code raises is a crash; a multi-device program that failed on one included:
``tests/launcher.py`` raises ``ProgramAssertionError`` then), pytest's ``Failed`` (a
``pytest.raises`` that did not raise) or a doctest whose output differs; a doctest that raised
is judged by what it raised. The refusal of valid input (``conftest.py`` fails it as an
assertion saying so) is an assertion, recorded as a refusal; the session goes on past it as
past a crash (a later test may assert on a result: the mutant is then killed).
"""

from __future__ import annotations

import doctest
import json
import os
from typing import Any

import pytest

# (verdict.py runs pytest in the checkout's root: its tests/ is importable)
from tests.launcher import raised_in_library

REFUSED = "jaxaccum refused valid input"
# a mutant that crashes this many tests is judged by them (time on 2 cores);
# JAXACCUM_MUTATION_MAX_CRASHES=0 runs the whole selection (no limit)
MAX_CRASHES = int(os.environ.get("JAXACCUM_MUTATION_MAX_CRASHES", "5")) or 10**9
CRASHES: list[str] = []


def _leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside an exception group (hypothesis raises one for several bugs)."""
    group = getattr(error, "exceptions", None)  # an ExceptionGroup (Python 3.11+)
    if isinstance(group, (list, tuple)):
        return [leaf for e in group for leaf in _leaves(e)]
    if isinstance(error, doctest.UnexpectedException):
        return [error.exc_info[1]]
    failures = getattr(error, "failures", None)  # pytest's MultipleDoctestFailures
    if isinstance(failures, (list, tuple)):
        return [leaf for f in failures for leaf in _leaves(f)]
    return [error]


def _asserted(error: BaseException) -> bool:
    return isinstance(error, (AssertionError, pytest.fail.Exception, doctest.DocTestFailure)) \
        and not raised_in_library(error)


def _write(record: dict[str, Any]) -> None:
    path = os.environ.get("JAXACCUM_MUTATION_FAILURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module that does not import (the mutated library raising at import time)."""
    if report.failed:
        text = str(report.longrepr)
        kind = "SyntaxError" if "SyntaxError" in text else "CollectError"
        _write({"test": report.nodeid, "phase": "collect", "exception": kind,
                "asserted": False, "refused": False, "message": text[-300:]})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or not report.failed:
        return
    leaves = _leaves(call.excinfo.value)
    asserted = [e for e in leaves if _asserted(e)]
    error = (asserted or leaves)[0]
    message = str(error) if not isinstance(error, doctest.DocTestFailure) else (
        f"doctest output differs: expected {error.example.want!r}, got {error.got!r}")
    refused = bool(asserted) and all(REFUSED in str(e) for e in asserted)
    record = {"test": item.nodeid, "phase": call.when, "exception": type(error).__name__,
              "asserted": bool(asserted), "refused": refused, "message": message[:300]}
    _write(record)
    if asserted and not refused:
        item.session.shouldstop = f"an assertion failed in {item.nodeid}"
        return
    CRASHES.append(item.nodeid)
    if len(CRASHES) >= MAX_CRASHES:
        item.session.shouldstop = f"{MAX_CRASHES} tests failed on other exceptions"
