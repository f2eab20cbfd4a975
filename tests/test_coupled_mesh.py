"""A batch-coupled CLIP loss on 8 host devices (tests/multidevice/coupled.py): data mesh and
data x model mesh, Auto and Explicit axes, equal to one device; nothing reduced or gathered in
the micro-batch loops (the representations meet once per step, outside them)."""

from __future__ import annotations

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


def test_check_passes_jaxaccum_and_names_a_reduction_per_microbatch(out):
    """jaxaccum.check on an Auto (8,) mesh: jaxaccum's step reduces once, after the loop; a jit
    of a scan over the sharded micro-batches reduces every micro-batch's gradient in it."""
    ours, naive = out["check"]["jaxaccum"], out["check"]["naive_scan"]
    assert ours["ok"] and ours["reductions"] >= 1 and ours["in_loops"] == 0
    assert not naive["ok"] and naive["in_loops"] >= 1
    assert "inside a loop, once per micro-batch" in naive["problems"][0]
