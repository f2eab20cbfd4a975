"""``jaxaccum.linear_cross_entropy`` in a jaxaccum step on a (4, 2) data x model mesh of 8 host
devices, the head's vocabulary sharded over "model" (tests/multidevice/lm_head.py): on Auto and on
Explicit axes the loss and gradients equal one device's, the weight never gathered; what cannot
run is refused with a message that says what to do instead, never a crash deep in a trace."""

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
    assert out["plain/auto"]["rel"] <= EXACT, out["plain/auto"]


def test_explicit_mesh_splits_the_vocabulary_and_equals_one_device(out):
    """On Explicit axes ``axis_name`` called directly runs the loss in a ``shard_map`` over the
    whole mesh, each array split as its type says: equal to one device on (4, 2) and (1, 8), a
    ``(D, V)`` kernel with a bias too, gathering nothing. Without ``axis_name`` a weight whose
    type says it is split is refused with the fix, never gathered silently."""
    for key in ("wrap/explicit", "wrap-1x8/explicit", "wrap-kernel/explicit"):
        assert "error" not in out[key], (key, out[key])
        assert out[key]["rel"] <= EXACT, (key, out[key])
        assert out[key]["all_gather_bytes"] == 0, (key, out[key])
    assert "pass axis_name=" in out["plain/explicit"]["error"], out["plain/explicit"]


def test_vocabulary_split_over_the_model_axis_equals_one_device_and_gathers_nothing(out):
    """``axis_name="model"`` inside ``jax.shard_map``: each device its slice of the head, the
    log-sum-exps combined over the axis; the compiled step all-gathers nothing."""
    r = out["split/auto"]
    assert "error" not in r, r
    assert r["rel"] <= EXACT, r
    assert r["all_gather_bytes"] == 0, r


def test_one_data_device_and_the_vocabulary_over_eight(out):
    """A (1, 8) mesh: the data axis splits nothing, so the step takes no shard_map of its own
    (XLA cannot partition the loss's own shard_map collectives inside one over an axis of
    size 1); the split vocabulary still equals one device."""
    assert out["split-1x8/auto"].get("rel", 1.0) <= EXACT, out["split-1x8/auto"]


def test_axis_name_outside_shard_map_splits_the_vocabulary_itself(out):
    """``axis_name="model"`` called in the step with no ``shard_map`` of the caller's: the loss
    splits the vocabulary over the mesh's axis itself; equal to one device on (4, 2) and on
    (1, 8), also for a ``(D, V)`` kernel (``vocab_axis=1``) with a bias, and nothing is
    all-gathered."""
    for key in ("wrap/auto", "wrap-1x8/auto", "wrap-kernel/auto"):
        assert "error" not in out[key], (key, out[key])
        assert out[key]["rel"] <= EXACT, (key, out[key])
        assert out[key]["all_gather_bytes"] == 0, (key, out[key])


def test_each_device_holds_no_gradient_of_its_weight_slice(out):
    """Compiled at V = 16,384, D = 256 (a float32 slice of 8 MiB per device on (4, 2)). Every
    step holds one slice-sized buffer: the accumulator's sum over the data axis, once per step.
    Split by the loss itself, each device adds its slice's gradient into its slice of the
    accumulator, so nothing else of that size is left; inside a ``shard_map`` of the caller's the
    weight is a new value, and its gradient takes a second slice-sized buffer. Each device's
    temp is then about 1/2 (1/tensor) of that with the whole vocabulary on every device."""
    m = out["memory"]
    assert m["wrap_4x2"] < 1.5 * m["slice_bytes"] <= m["split_4x2"], m
    assert m["wrap_4x2"] <= 0.6 * m["plain_4x1"], m
    # Explicit axes: no sink there (a parameter reaches the loss cast to its reduced type, not
    # as the accumulator was registered with), so the slice's gradient and the accumulator's
    # slice: less than the whole weight (two slices) on any device
    assert m["wrap_4x2_explicit"] < 2 * m["slice_bytes"], m


def test_a_scale_before_the_head_and_an_embedding(out):
    """A LayerNorm-like scale between the batch-sharded activations and the head (on Explicit
    axes it meets them elementwise: jaxaccum reshards it or falls back to a cast JAX takes), and
    an embedding: equal to one device. On Explicit axes ``table[tokens]`` is JAX's own refusal,
    with its fix (``.at[tokens].get(out_sharding=...)``), which then runs; never an error from
    inside JAX's handling of a reduced type."""
    for key in ("scale/auto", "scale/explicit", "embed-index/auto", "embed-at/explicit"):
        assert "error" not in out[key], (key, out[key])
        assert out[key]["rel"] <= EXACT, (key, out[key])
    assert "Use `.at[...].get(out_sharding=)`" in out["embed-index/explicit"]["error"], out


def test_the_data_axis_named_by_mistake_is_refused(out):
    """``axis_name="data"``: each device of that axis holds other tokens, so splitting the
    vocabulary over it would give a wrong loss; refused on Auto and Explicit axes alike."""
    for key in ("data-axis/auto", "data-axis/explicit"):
        assert "not a data axis" in out[key].get("error", ""), (key, out[key])
