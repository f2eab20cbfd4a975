"""A traced number of micro-batches on 8 host devices (tests/multidevice/runtime_count.py)."""

from __future__ import annotations

import pytest
from launcher import run_program

# float32 rounding of this 128-example loss: ~1e-7 relative (one device against 8 reorders the
# sums); leaving out or adding a micro-batch changes the gradient by > 1e-2.
EXACT = 1e-5


@pytest.fixture(scope="module")
def out():
    return run_program("runtime_count", devices=8, timeout=600)


@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_every_count_on_a_data_mesh_equals_one_device_in_one_program(out, axes):
    r = out[axes]
    assert len(r["diffs"]) == 4 and max(r["diffs"]) <= EXACT
    assert r["programs"] == 1
    assert r["all_gathers"] == 0  # the micro-batch axis stays split where it lies
    assert r["reductions"]["in loops"] == 0 and r["reductions"]["total"] >= 1


def test_noise_scale_measures_each_devices_own_microbatch_gradient(out):
    """On the Auto mesh the small batch is a device's share of a micro-batch (4 of 32): the
    estimate equals one device's over the 32 shares, to float32 rounding."""
    r = out["noise"]
    assert r["small"] == 4.0 and r["big"] == 128.0
    assert r["trace"] == pytest.approx(r["trace_want"], rel=1e-5)
    assert r["gradient_sq"] == pytest.approx(r["gradient_sq_want"], rel=1e-5)
