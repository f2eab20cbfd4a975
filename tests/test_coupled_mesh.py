"""A batch-coupled CLIP loss on 8 host devices (tests/multidevice/coupled.py): data mesh and
data x model mesh, Auto and Explicit axes, equal to one device; nothing reduced or gathered in
the micro-batch loops (the representations meet once per step, outside them)."""

from __future__ import annotations

from collections import Counter

import pytest
from launcher import run_program

# float32 rounding of a 128-example CLIP loss: measured ~1e-7 relative; a wrong number of
# negatives or a missing cotangent is an O(1e-2) difference (tests/test_coupled.py).
EXACT = 1e-5


@pytest.fixture(scope="module")
def out():
    return run_program("coupled", devices=8, timeout=600)


@pytest.mark.parametrize("case", ["data/auto", "data/explicit", "data_model/auto",
                                  "data_model/explicit"])
def test_coupled_loss_on_meshes_equals_one_device_and_keeps_loops_local(out, case):
    r = out[case]
    assert r["loss_rel"] <= EXACT and r["grads_rel"] <= EXACT
    assert r["reductions"]["in loops"] == 0
    assert r["gathers_in_loops"] == 0
    assert not any(loop for _, loop, _ in r["collectives"])  # no collective per micro-batch
    # each gradient leaf reduced exactly once per step, outside the loops (XLA combines the
    # reductions into tuples and splits them as it likes: leaves are found by their shapes)
    leaves = Counter(tuple(s) for s in r["param_shapes"] if s)
    reduced = Counter(tuple(s) for _, shapes in r["reduced"] for s in shapes
                      if tuple(s) in leaves)
    assert reduced == leaves, r["reduced"]
    # the representations gathered once per step: at most one copy of the (B, E) pair
    gathered = sum(size for op, _, size in r["collectives"] if op == "all-gather")
    assert 0 < gathered <= r["reps_bytes"], r["collectives"]


@pytest.mark.parametrize("mesh", ["", "two_axes_"])
def test_check_passes_jaxaccum_and_names_a_reduction_per_microbatch(out, mesh):
    """jaxaccum.check on an Auto (8,) mesh, and a (2, 4) mesh with both axes data axes:
    jaxaccum's step reduces once, after the loop; a jit of a scan over the sharded
    micro-batches reduces every micro-batch's gradient in it."""
    ours, naive = out["check"][mesh + "jaxaccum"], out["check"][mesh + "naive_scan"]
    assert ours["ok"] and ours["reductions"] >= 1 and ours["in_loops"] == 0
    assert not naive["ok"] and naive["in_loops"] >= 1
    assert "inside a loop, once per micro-batch" in naive["problems"][0]


def test_check_accepts_the_reductions_per_microbatch_that_zero3_asks_for(out):
    """fsdp="microbatch" reduce-scatters every micro-batch's gradient by design: check counts
    those reductions and does not call them a problem."""
    r = out["check"]["zero3"]
    assert r["in_loops"] >= 1 and r["ok"] and not r["problems"], r


@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_statistics_first_on_a_mesh_reduces_statistics_and_gradients_once(out, axes):
    """Global MoE load balancing on the (8,) data mesh: equal to one device; the statistics
    (9 floats) are reduced after the forward loop and the gradients after the accumulation
    loop, once each. On Explicit axes the loss's own means over the sharded micro-batch are
    reduced by the partitioner in the loop: scalars, never a gradient or the statistics."""
    r = out["statistics_first"][axes]
    assert r["loss_rel"] <= EXACT and r["grads_rel"] <= EXACT
    grads = [(loop, size) for op, loop, size in r["collectives"]
             if op in ("all-reduce", "reduce-scatter") and size >= r["param_bytes"]]
    assert grads == [(False, grads[0][1])] and grads[0][1] <= r["param_bytes"] + 64
    stats = [loop for op, loop, size in r["collectives"]
             if op == "all-reduce" and size == r["stats_bytes"]]
    assert False in stats  # the statistics meet once, after the forward loop
    assert all(size < 64 for _, loop, size in r["collectives"] if loop), r["collectives"]
