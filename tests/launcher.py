"""The one way tests start the programs of ``tests/multidevice`` in fresh Python processes.

``run_program("sharded", devices=8)`` runs ``python -m tests.multidevice.sharded`` with 8 host
CPU devices (``XLA_FLAGS`` must be set before JAX starts) and returns the JSON object its last
stdout line holds. With ``processes=n`` it starts n such processes, which join through
``jax.distributed`` on a free port of 127.0.0.1 (see ``tests/multidevice/common.py``), and
returns process 0's object.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


class ProgramError(AssertionError):
    """A program exited with an error, timed out, or printed no JSON."""


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
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env=program_env(devices, env, (i, processes, coordinator) if processes > 1 else None),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    deadline = time.monotonic() + timeout
    outputs: list[tuple[str, str]] = []
    try:
        for i, proc in enumerate(procs):
            try:
                outputs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired as e:
                for p in procs:
                    p.kill()
                _, err = proc.communicate()
                raise ProgramError(
                    f"{' '.join(command)} (process {i} of {processes}) timed out after "
                    f"{timeout:g} s; stderr:\n{_tail(err)}"
                ) from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for i, (proc, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        if proc.returncode != 0:
            raise ProgramError(
                f"{' '.join(command)} (process {i} of {processes}) exited with "
                f"{proc.returncode}; stderr:\n{_tail(err)}"
            )
    out, err = outputs[0]
    lines = out.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise ProgramError(
            f"{' '.join(command)} printed no JSON object last; stdout:\n{_tail(out, 1000)}\n"
            f"stderr:\n{_tail(err)}"
        ) from e
    if not isinstance(result, dict):
        raise ProgramError(f"{' '.join(command)} printed {type(result).__name__}, not an object")
    return result
