"""Every program in ``examples/`` runs with ``--smoke``, its own checks pass (exit code 0) and it
ends with a short summary; the MNIST programs read MNIST from TFDS' data_dir ($TFDS_DATA_DIR),
where it is prepared once, and do not prepare it again."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TAIL = 4000  # characters of stdout and stderr shown on failure
MAX_LINES = 12  # a summary, not pages of progress
PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm's, as tensorflow-datasets draws them
PREPARING = "Downloading and preparing dataset"  # what TFDS prints when it prepares MNIST


def test_examples_are_found():
    assert EXAMPLES, f"no programs in {ROOT / 'examples'}"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_with_smoke(path, request):
    # JAXACCUM_MNIST_DIR (set by conftest if missing) passes through. The MNIST programs get
    # TFDS_DATA_DIR (tensorflow-datasets' data_dir, the default of their --data-dir) where MNIST
    # is prepared (from the .gz files in a temporary folder, else TFDS' own cache): skipped,
    # saying why, where there is no MNIST (not in CI).
    env = dict(os.environ)
    uses_mnist = "jaxaccum.experiment" in path.read_text()
    if uses_mnist:
        env["TFDS_DATA_DIR"] = str(request.getfixturevalue("mnist_data_dir"))
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(path), "--smoke"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        pytest.fail(f"{path.name} --smoke ran past 300 s; stdout tail:\n{out[-TAIL:]}")
    elapsed = time.perf_counter() - start
    print(f"{path.name} --smoke: {elapsed:.1f} s")
    shown = (f"--- stdout (tail) ---\n{proc.stdout[-TAIL:]}\n--- stderr (tail) ---\n"
             f"{proc.stderr[-TAIL:]}")
    assert proc.returncode == 0, (
        f"{path.name} --smoke exited with {proc.returncode} after {elapsed:.1f} s\n{shown}")
    lines = proc.stdout.splitlines()
    assert lines and lines[-1].startswith("OK:"), f"{path.name} does not end with 'OK:'\n{shown}"
    assert len(lines) <= MAX_LINES, f"{path.name} printed {len(lines)} lines\n{shown}"
    assert not PROGRESS_BAR.search(proc.stderr), f"{path.name} drew progress bars\n{shown}"
    if uses_mnist:  # one that ignored $TFDS_DATA_DIR would prepare MNIST elsewhere
        assert PREPARING not in proc.stdout, (
            f"{path.name} prepared MNIST again instead of reading $TFDS_DATA_DIR="
            f"{env['TFDS_DATA_DIR']}\n{shown}")
