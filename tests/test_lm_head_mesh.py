"""``jaxaccum.linear_cross_entropy`` in a jaxaccum step on a (4, 2) data x model mesh of 8 host
devices, the head's vocabulary sharded over "model" (tests/multidevice/lm_head.py): on Auto axes
the loss and gradients equal one device's; on Explicit axes it is refused with a message that
says what to use instead, never a crash deep in a trace."""

from __future__ import annotations

import pytest
from launcher import run_program

# float32 sums in another order (a chunk's tokens split over 4 devices): measured ~1e-7; a
# token counted twice or a chunk of the vocabulary lost is O(1e-2)
EXACT = 1e-5


@pytest.fixture(scope="module")
def out():
    return run_program("lm_head", devices=8, timeout=600)


def test_auto_mesh_equals_one_device(out):
    assert out["auto"]["rel"] <= EXACT, out["auto"]


def test_explicit_mesh_is_refused_with_the_fix(out):
    assert "Explicit mesh axes are not supported yet" in out["explicit"]["refused"]
    assert "AxisType.Auto" in out["explicit"]["refused"]


def test_vocabulary_split_over_the_model_axis_equals_one_device_and_gathers_nothing(out):
    """``axis_name="model"`` inside ``jax.shard_map``: each device its slice of the head, the
    log-sum-exps combined over the axis; the compiled step all-gathers nothing."""
    r = out["split/auto"]
    assert r["rel"] <= EXACT, r
    assert r["all_gather_bytes"] == 0, r


def test_one_data_device_and_the_vocabulary_over_eight(out):
    """A (1, 8) mesh: the data axis splits nothing, so the step takes no shard_map of its own
    (XLA cannot partition the loss's own shard_map collectives inside one over an axis of
    size 1); the split vocabulary still equals one device."""
    assert out["split-1x8/auto"]["rel"] <= EXACT, out["split-1x8/auto"]
