"""Every program in ``examples/`` runs with ``--smoke`` and its own checks pass (exit code 0)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TAIL = 4000  # characters of stdout and stderr shown on failure


def test_examples_are_found():
    assert EXAMPLES, f"no programs in {ROOT / 'examples'}"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_with_smoke(path):
    env = dict(os.environ)  # JAXACCUM_MNIST_DIR (set by conftest if missing) passes through
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(path), "--smoke"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        pytest.fail(f"{path.name} --smoke ran past 300 s; stdout tail:\n{out[-TAIL:]}")
    elapsed = time.perf_counter() - start
    print(f"{path.name} --smoke: {elapsed:.1f} s")
    assert proc.returncode == 0, (
        f"{path.name} --smoke exited with {proc.returncode} after {elapsed:.1f} s\n"
        f"--- stdout (tail) ---\n{proc.stdout[-TAIL:]}\n--- stderr (tail) ---\n"
        f"{proc.stderr[-TAIL:]}"
    )
