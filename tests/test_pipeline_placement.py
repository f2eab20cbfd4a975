"""The placements on 8 host devices. tests/multidevice/pipeline.py: the README's mesh example,
per-example aux in batch order, skipped micro-batches and micro-batch counts on Auto meshes,
ZeRO-3's gather pinned in the loop, skip_nonfinite on Explicit meshes. And
tests/multidevice/mesh_promises.py: carried state refused on Auto axes, ZeRO-3's gather in the
loop, the micro-batch count of a data x model mesh, an Explicit skip decided by one device's
partial gradient, an Explicit FSDP reduce-scatter."""

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

# --- promises of the placements on 8 host devices (tests/multidevice/mesh_promises.py) -------



@pytest.fixture(scope="module")
def mesh_results():
    return run_program("mesh_promises", devices=8, timeout=900)


def test_auto_mesh_refuses_carried_state(mesh_results):
    error = mesh_results["auto_carry_error"]
    assert error is not None and error.startswith("ValueError: jaxaccum.value_and_grad: "
                                                  "carry_argnums=(2,)")
    assert "use a mesh with Explicit axes" in error


def test_zero3_gathers_every_microbatch_inside_the_loop(mesh_results):
    r = mesh_results["zero3"]
    assert r["microbatch"]["counts"]["all-gather in loops"] >= 2, r  # w and v, per micro-batch
    assert r["step"]["counts"]["all-gather in loops"] == 0, r  # gathered once per step
    assert r["microbatch"]["temp"] < r["step"]["temp"], r
    assert r["microbatch"]["grads_rel"] <= 1e-5 and r["step"]["grads_rel"] <= 1e-5


def test_reported_microbatches_count_only_the_data_axes(mesh_results):
    r = mesh_results["data_model"]
    assert r["num_microbatches"] == 2 * 4  # k per device x 4 data devices (model axis: 2)
    assert r["grads_rel"] <= 1e-5


def test_explicit_mesh_skips_a_microbatch_whose_gradient_alone_is_nonfinite(mesh_results):
    """The loss is finite, one device's partial gradient is NaN: every device must agree to
    skip (the flag is reduced over the devices), and only that micro-batch is left out."""
    r = mesh_results["explicit_skip_gradient"]
    assert r["skipped"] == 1 and r["weight"] == 1.0 and r["loss_finite"]
    assert r["grads_rel"] <= 1e-5


def test_explicit_fsdp_gradient_is_reduce_scattered(mesh_results):
    r = mesh_results["explicit_fsdp"]
    assert r["counts"]["reduce-scatter"] >= 2, r["counts"]  # w and v
    assert r["grads_rel"] <= 1e-5
