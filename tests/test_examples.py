"""Every program in ``examples/`` runs with ``--smoke``, its own checks pass (exit code 0) and it
ends with a short summary; the MNIST programs prepare MNIST once in TFDS' data_dir and reuse it."""

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


@pytest.fixture(scope="module")
def tfds_data_dir(tmp_path_factory):
    """One TFDS data_dir for the module: the first MNIST program prepares MNIST there, the
    others reuse it, and nothing is written to the user's ~/tensorflow_datasets."""
    return tmp_path_factory.mktemp("tfds")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_with_smoke(path, tfds_data_dir, request):
    # JAXACCUM_MNIST_DIR (set by conftest if missing) passes through; TFDS_DATA_DIR is the
    # data_dir of tensorflow-datasets, the default of the MNIST programs' --data-dir.
    env = dict(os.environ, TFDS_DATA_DIR=str(tfds_data_dir))
    uses_mnist = "jaxaccum.experiment" in path.read_text()
    if uses_mnist:  # the MNIST files: skipped, saying why, where there are none (not in CI)
        request.getfixturevalue("mnist_files")
    prepared = (tfds_data_dir / "jaxaccum_mnist").is_dir()
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
    if uses_mnist:
        assert (tfds_data_dir / "jaxaccum_mnist").is_dir(), (
            f"{path.name} did not prepare MNIST in $TFDS_DATA_DIR={tfds_data_dir}\n{shown}")
        if prepared:
            assert PREPARING not in proc.stdout, (
                f"{path.name} prepared MNIST again instead of reusing {tfds_data_dir}\n{shown}")
