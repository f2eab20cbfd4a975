"""Checkpoint and resume in the middle of an accumulation window; determinism across processes.

Each scenario runs in fresh Python processes, as a preempted job would.
"""

from __future__ import annotations

import numpy as np
from launcher import run_program


def run(mode: str, checkpoint: str = "") -> dict[str, np.ndarray]:
    """Runs ``tests/multidevice/reliability.py``; returns its parameters and gradient step."""
    out = run_program("reliability", mode, checkpoint, devices=1, timeout=300)
    arrays = {k: np.asarray(v, np.float32) for k, v in out["params"].items()}
    if "gradient_step" in out:
        arrays["gradient_step"] = np.asarray(out["gradient_step"])
    return arrays


def test_resume_mid_window_is_bitwise_equal(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = run("first", ckpt)
    resumed = run("resume", ckpt)
    straight = run("straight", ckpt)
    assert int(first["gradient_step"]) == 2  # stopped inside the third window
    assert int(resumed["gradient_step"]) == int(straight["gradient_step"]) == 5
    for name in ("w1", "w2"):
        np.testing.assert_array_equal(resumed[name], straight[name])
    assert not np.array_equal(first["w1"], straight["w1"])


def test_two_processes_are_bitwise_equal():
    for mode in ("straight", "train_step"):
        a, b = run(mode), run(mode)
        for name in ("w1", "w2"):
            np.testing.assert_array_equal(a[name], b[name])
