"""The one way tests start the programs of ``tests/multidevice`` in fresh Python processes.

``run_program("sharded", devices=8)`` runs ``python -m tests.multidevice.sharded`` with 8 host
CPU devices (``XLA_FLAGS`` must be set before JAX starts) and returns the JSON object its last
stdout line holds. With ``processes=n`` it starts n such processes, which join through
``jax.distributed`` on a free port of 127.0.0.1 (see ``tests/multidevice/common.py``), and
returns process 0's object.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import IO, Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


class ProgramError(RuntimeError):
    """A program exited with an error, timed out, or printed no JSON."""


class ProgramAssertionError(ProgramError, AssertionError):
    """A program failed on an assertion: a test's own check, not a crash."""


def failed_on(stderr: str) -> str:
    """The exception a Python program died of: the first unindented line after its last
    traceback header ("" if none)."""
    _, _, rest = stderr.rpartition("Traceback (most recent call last):")
    return next((line for line in rest.splitlines()[1:] if line and not line[0].isspace()), "")


LIBRARY = str(ROOT / "jaxaccum") + os.sep


def raised_in_library(error: BaseException | str) -> bool:
    """Whether an exception (or the last traceback of a program's stderr) was raised by the
    library's own code, its innermost frame in ``jaxaccum/``: an ``assert`` or
    ``AssertionError`` there is a crash of the library, not a test's check."""
    if isinstance(error, str):
        _, _, rest = error.rpartition("Traceback (most recent call last):")
        files = re.findall(r'^\s*File "([^"]+)"', rest, flags=re.MULTILINE)
        where = files[-1] if files else ""
    else:
        tb, where = error.__traceback__, ""
        while tb is not None:
            where, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return bool(where) and os.path.abspath(where).startswith(LIBRARY)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def program_env(
    devices: int, env: Mapping[str, str] | None = None, process: tuple[int, int, str] | None = None
) -> dict[str, str]:
    """The environment of one program process: ``devices`` host devices, the repository root
    first on PYTHONPATH, ``env`` on top; ``process`` is (index, count, coordinator address)."""
    out = dict(os.environ)
    flags = [f for f in out.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG)]
    out["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_FLAG}={devices}"])
    out["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, out.get("PYTHONPATH", "").split(os.pathsep))]
    )
    if process is not None:
        index, count, coordinator = process
        out["JAXACCUM_TEST_PROCESS_ID"] = str(index)
        out["JAXACCUM_TEST_NUM_PROCESSES"] = str(count)
        out["JAXACCUM_TEST_COORDINATOR"] = coordinator
    out.update(env or {})
    return out


def _tail(text: str, chars: int = 4000) -> str:
    return text[-chars:] if text else "(empty)"


def run_program(
    name: str,
    *args: str,
    devices: int = 8,
    processes: int = 1,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> dict[str, Any]:
    """Runs ``python -m tests.multidevice.<name> *args`` in ``processes`` processes with
    ``devices`` host devices each and returns the JSON object on process 0's last stdout line.

    Raises :class:`ProgramError` with the failing process's stderr tail if any process exits
    with an error or outlives ``timeout`` seconds (all are then killed).
    """
    command = [sys.executable, "-m", f"tests.multidevice.{name}", *map(str, args)]
    shown = " ".join(command[1:])
    coordinator = f"127.0.0.1:{free_port()}"
    with contextlib.ExitStack() as stack:
        # files, not pipes: a process is never blocked on a full pipe while another is awaited
        logs = [
            (
                stack.enter_context(tempfile.TemporaryFile("w+")),
                stack.enter_context(tempfile.TemporaryFile("w+")),
            )
            for _ in range(processes)
        ]
        procs = [
            subprocess.Popen(
                command,
                cwd=ROOT,
                env=program_env(
                    devices, env, (i, processes, coordinator) if processes > 1 else None
                ),
                stdout=out,
                stderr=err,
                text=True,
            )
            for i, (out, err) in enumerate(logs)
        ]
        try:
            failed, timed_out = _wait(procs, time.monotonic() + timeout)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        outputs = [(_read(out), _read(err)) for out, err in logs]
    if failed is not None:
        where = f"{shown} (process {failed} of {processes})" if processes > 1 else shown
        what = (
            f"timed out after {timeout:g} s"
            if timed_out
            else f"exited with {procs[failed].returncode}"
        )
        error = failed_on(outputs[failed][1])
        asserted = error.startswith("AssertionError") and not raised_in_library(outputs[failed][1])
        kind = ProgramAssertionError if asserted else ProgramError
        if error.startswith(("ValueError: jaxaccum", "TypeError: jaxaccum")):
            # jaxaccum refused what the program gives it as valid: as conftest.py's hook says
            kind, error = ProgramAssertionError, f"jaxaccum refused valid input: {error}"
        raise kind(f"{where} {what} ({error[:200]}); stderr:\n{_tail(outputs[failed][1])}")
    out, err = outputs[0]
    lines = out.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise ProgramError(
            f"{shown} printed no JSON object last; stdout:\n{_tail(out, 1000)}\n"
            f"stderr:\n{_tail(err)}"
        ) from e
    if not isinstance(result, dict):
        raise ProgramError(f"{shown} printed {type(result).__name__}, not an object")
    return result


def _wait(procs: list[subprocess.Popen[str]], deadline: float) -> tuple[int | None, bool]:
    """Waits until every process has exited, one has failed, or the deadline; returns (the
    index of the failed or first unfinished process, or None; whether the deadline passed)."""
    while True:
        codes = [proc.poll() for proc in procs]
        for i, code in enumerate(codes):
            if code is not None and code != 0:
                return i, False
        if all(code == 0 for code in codes):
            return None, False
        if time.monotonic() > deadline:
            return codes.index(None), True
        time.sleep(0.05)


def _read(file: IO[str]) -> str:
    file.seek(0)
    return file.read()
