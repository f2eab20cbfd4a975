"""The pipeline's placement hooks on 8 host devices (tests/multidevice/pipeline.py): the README's
mesh example, per-example aux in batch order, skipped micro-batches and micro-batch counts on
Auto meshes, ZeRO-3's gather pinned in the loop, skip_nonfinite on Explicit meshes."""

from __future__ import annotations

import pytest
from launcher import run_program

# float32 rounding of a 256-example mean over 64 + 128 + 16 wide layers: measured differences
# are ~1e-7 .. 1e-6 relative; the bugs these tests guard against are O(1e-2) and larger.
EXACT = 1e-5


@pytest.fixture(scope="module")
def out():
    return run_program("pipeline", devices=8, timeout=600)


def test_readme_mesh_example_equals_one_device_over_three_adam_steps(out):
    assert out["readme"]["rel"] <= EXACT
    assert out["readme"]["kept"]
    assert out["readme"]["num_microbatches"] == 4  # Explicit: k global micro-batches


def test_concat_aux_is_in_batch_order_on_auto_and_explicit_meshes(out):
    assert out["concat"]["concat_auto"] <= EXACT
    assert out["concat"]["concat_explicit"] <= EXACT


def test_auto_mesh_counts_microbatches_over_the_data_axes_only(out):
    assert out["concat"]["num_microbatches_auto"] == 4 * 4  # k x 4 data devices, not x 8


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_skip_nonfinite_leaves_out_one_microbatch_and_reduces_once(out, axis_type):
    r = out["skipped"][axis_type]
    assert r["skipped"] == 1  # summed over the devices
    assert r["loss_rel"] <= EXACT and r["grads_rel"] <= EXACT
    assert r["reductions"]["total"] == 1 and r["reductions"]["in loops"] == 0


@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_zero3_gathers_inside_the_loop_and_holds_less(out, axes):
    r = out["zero3"][axes]
    assert r["microbatch"]["all_gather_in_loops"] >= 1
    assert r["step"]["all_gather_in_loops"] == 0
    assert r["microbatch"]["temp"] < r["step"]["temp"]
    assert r["grads_rel"] <= 1e-5  # the same sums in another order
    if axes == "explicit":  # the parameter reaches the loss gathered (not split), whatever fsdp is
        assert r["microbatch"]["loss_sees_w1"] == r["step"]["loss_sees_w1"] == ["(None, None)"]
