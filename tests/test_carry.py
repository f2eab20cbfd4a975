"""Carried state (threaded through the micro-batches) and per-leaf aux reductions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_close, mlp_apply, mlp_params, mse_loss, random_batch, refuses

import jaxaccum

PARAMS = mlp_params(jax.random.key(0))
BATCH = random_batch(jax.random.key(1), 64)
MOMENTUM = 0.9


def bn_loss(params, batch, stats):
    """An MLP with a BatchNorm-like running mean: train mode normalises by the micro-batch mean
    and updates the running statistics, as flax's BatchNorm does."""
    x, y = batch
    h = x @ params["layer0"]["w"] + params["layer0"]["b"]
    mean = jnp.mean(h, axis=0)
    h = jnp.tanh(h - mean)
    out = h @ params["layer1"]["w"] + params["layer1"]["b"]
    new = {
        "mean": MOMENTUM * stats["mean"] + (1 - MOMENTUM) * jax.lax.stop_gradient(mean),
        "count": stats["count"] + 1,
    }
    return jnp.mean((out - y) ** 2), new


STATS = {"mean": jnp.zeros(16), "count": jnp.zeros((), jnp.int32)}


def sequential(k, stats=STATS):
    """The reference: k micro-batches (strided) run one after the other by hand."""
    grads, losses = [], []
    for i in range(k):
        micro = jax.tree.map(lambda a, i=i: a[i::k], BATCH)
        (loss, stats), g = jax.value_and_grad(bn_loss, has_aux=True)(PARAMS, micro, stats)
        grads.append(g)
        losses.append(loss)
    mean = jax.tree.map(lambda *gs: sum(gs) / k, *grads)
    return sum(losses) / k, mean, stats


@pytest.mark.parametrize("k", [1, 4, 8])
def test_carried_state_equals_sequential_microbatches(k):
    fn = jaxaccum.value_and_grad(bn_loss, num_microbatches=k, carry_argnums=2)
    (loss, stats), grads = jax.jit(fn)(PARAMS, BATCH, STATS)
    ref_loss, ref_grads, ref_stats = sequential(k)
    assert int(stats["count"]) == k
    assert_trees_close(stats["mean"], ref_stats["mean"], 1e-6)
    assert_trees_close((loss, grads), (ref_loss, ref_grads), 1e-6)


def test_carried_state_with_skip_nonfinite_drops_the_bad_update():
    x, y = BATCH
    bad = (x.at[1].set(jnp.nan), y)  # strided micro-batch 1 of 4
    fn = jaxaccum.value_and_grad(bn_loss, num_microbatches=4, carry_argnums=2,
                                 skip_nonfinite=True)
    (_, stats), _ = jax.jit(fn)(PARAMS, bad, STATS)
    assert int(stats["count"]) == 3  # the skipped micro-batch did not count
    assert bool(jnp.all(jnp.isfinite(stats["mean"])))


def test_carried_state_in_train_step_is_donated_and_returned():
    opt = optax.sgd(0.1)
    step = jaxaccum.train_step(bn_loss, opt, num_microbatches=4, carry_argnums=2)
    params = jax.tree.map(jnp.array, PARAMS)
    stats = jax.tree.map(jnp.array, STATS)
    structure = jax.tree.structure(stats)
    params, _, loss, info = step(params, opt.init(params), BATCH, stats)
    new_stats = info.carry  # the carried value comes back as it came in: one value, one tree
    assert jax.tree.structure(new_stats) == structure, (jax.tree.structure(new_stats), structure)
    assert info.aux is None and int(new_stats["count"]) == 4
    assert all(s.is_deleted() for s in jax.tree.leaves(stats))
    assert_trees_close(new_stats["mean"], sequential(4)[2]["mean"], 1e-6)


def test_carried_structure_mismatch_names_argument_and_structures():
    def bad(params, batch, stats):
        loss, new = bn_loss(params, batch, stats)
        return loss, {"mean": new["mean"].astype(jnp.bfloat16), "count": new["count"]}

    fn = jaxaccum.value_and_grad(bad, num_microbatches=2, carry_argnums=2)
    with refuses(TypeError, match=r"carry_argnums: argument 2: leaf \['mean'\] came in as "
                       r"float32\[16\] and came back as bfloat16\[16\]"):
        fn(PARAMS, BATCH, STATS)

    def reshaped(params, batch, stats):  # the other side of the message: the shape
        loss, new = bn_loss(params, batch, stats)
        return loss, {"mean": new["mean"][:8], "count": new["count"]}

    fn = jaxaccum.value_and_grad(reshaped, num_microbatches=2, carry_argnums=2)
    with refuses(TypeError, match=r"leaf \['mean'\] came in as float32\[16\] and came back as "
                       r"float32\[8\]"):
        fn(PARAMS, BATCH, STATS)

    def dropped(params, batch, stats):
        loss, new = bn_loss(params, batch, stats)
        return loss, {"mean": new["mean"]}

    fn = jaxaccum.value_and_grad(dropped, num_microbatches=2, carry_argnums=2)
    with refuses(TypeError, match=r"carry_argnums: argument 2: fun must return the carried"):
        fn(PARAMS, BATCH, STATS)


def test_carry_overlapping_batch_or_argnums_is_rejected():
    with refuses(ValueError, match=r"carry_argnums=1 overlaps"):
        jaxaccum.value_and_grad(bn_loss, num_microbatches=2, carry_argnums=1)


# --- aux reductions -----------------------------------------------------------------------------


def aux_loss(params, batch):
    x, y, w = batch
    pred = mlp_apply(params, x)
    per = jnp.mean((pred - y) ** 2, axis=-1)
    aux = {
        "tokens": jnp.sum(w).astype(jnp.int32),
        "loss": jnp.sum(per * w) / jnp.maximum(jnp.sum(w), 1),
        "amax": jnp.max(jnp.abs(pred)),
        "amin": jnp.min(pred),
        "first": pred[0],
    }
    return (aux["loss"], jnp.sum(w)), aux


@pytest.mark.parametrize("k", [1, 4, 8])
def test_aux_reductions_match_the_stacked_values_reduced_by_hand(k):
    w = (jnp.arange(64) % 3 != 0).astype(jnp.float32)
    batch = (*BATCH, w)
    stacked_fn = jaxaccum.value_and_grad(aux_loss, num_microbatches=k, has_aux=True,
                                         weighted=True)
    (_, stacked), _ = jax.jit(stacked_fn)(PARAMS, batch)
    spec = {"tokens": "sum", "loss": "weighted_mean", "amax": "max", "amin": "min",
            "first": "last"}
    fn = jaxaccum.value_and_grad(aux_loss, num_microbatches=k, has_aux=spec, weighted=True)
    (_, reduced), _ = jax.jit(fn)(PARAMS, batch)
    weights = np.asarray(stacked["tokens"], np.float64)
    assert int(reduced["tokens"]) == int(np.sum(stacked["tokens"])) == 64 - 22
    np.testing.assert_allclose(
        reduced["loss"], np.sum(weights * stacked["loss"]) / np.sum(weights), rtol=1e-6)
    assert float(reduced["amax"]) == float(np.max(stacked["amax"]))
    assert float(reduced["amin"]) == float(np.min(stacked["amin"]))
    np.testing.assert_array_equal(reduced["first"], stacked["first"][-1])
    mean_fn = jaxaccum.value_and_grad(aux_loss, num_microbatches=k, has_aux="mean",
                                      weighted=True)
    (_, means), _ = jax.jit(mean_fn)(PARAMS, batch)
    np.testing.assert_allclose(means["amax"], np.mean(stacked["amax"]), rtol=1e-6)
    assert reduced["tokens"].dtype == jnp.int32 and reduced["first"].shape == (4,)


def test_unknown_aux_reduction_is_rejected():
    with refuses(ValueError, match=r"jaxaccum.value_and_grad: has_aux.*\['median'\]"):
        jaxaccum.value_and_grad(aux_loss, num_microbatches=2, has_aux="median")
    with refuses(ValueError, match=r"has_aux.*\['median'\]"):
        jaxaccum.value_and_grad(aux_loss, num_microbatches=2, has_aux={"tokens": "median"})


def test_two_carried_arguments_in_reversed_order_go_back_where_they_came_from():
    """carry_argnums=(3, 2): new_carry comes back in that order, (for 3, for 2)."""

    def loss(params, batch, a, b):
        value = mse_loss(params, batch) * a["scale"] + b["shift"]
        return value, ({"shift": b["shift"] + 1.0}, {"scale": a["scale"] * 2.0})

    fn = jaxaccum.value_and_grad(loss, num_microbatches=3, carry_argnums=(3, 2))
    a, b = {"scale": jnp.asarray(1.0)}, {"shift": jnp.asarray(0.0)}
    batch = jax.tree.map(lambda x: x[:48], BATCH)
    (value, (new_b, new_a)), _ = jax.jit(fn)(PARAMS, batch, a, b)
    assert float(new_a["scale"]) == 8.0 and float(new_b["shift"]) == 3.0
    micro = [jax.tree.map(lambda x, i=i: x[i::3], batch) for i in range(3)]
    expected = sum(mse_loss(PARAMS, m) * 2.0 ** i + i for i, m in enumerate(micro)) / 3
    assert float(value) == pytest.approx(float(expected), rel=1e-6)


def test_aux_weighted_mean_leaves_out_a_skipped_microbatch_and_max_min_start_at_infinity():
    def fn(params, batch):
        x, y = batch
        loss = mse_loss(params, batch)
        m = jnp.mean(x[:, 0])
        return loss, {"mean": m, "max": -1.0 - jnp.abs(m), "min": 1.0 + jnp.abs(m)}

    x, y = BATCH
    bad = (x.at[2].set(jnp.nan), y)  # strided micro-batch 2 of 4
    spec = {"mean": "weighted_mean", "max": "max", "min": "min"}
    (_, aux), _ = jax.jit(jaxaccum.value_and_grad(
        fn, num_microbatches=4, has_aux=spec, skip_nonfinite=True))(PARAMS, bad)
    kept = [jnp.mean(x[i::4, 0]) for i in (0, 1, 3)]
    assert float(aux["mean"]) == pytest.approx(float(sum(kept) / 3), rel=1e-6)
    (_, clean), _ = jax.jit(jaxaccum.value_and_grad(
        fn, num_microbatches=4, has_aux=spec))(PARAMS, BATCH)
    every = [jnp.mean(x[i::4, 0]) for i in range(4)]
    assert float(clean["max"]) == pytest.approx(float(max(-1.0 - abs(m) for m in every)))
    assert float(clean["min"]) == pytest.approx(float(min(1.0 + abs(m) for m in every)))
    assert float(clean["max"]) < -1.0 and float(clean["min"]) > 1.0


def test_two_carried_scalars_in_reversed_order_are_not_swapped():
    """carry_argnums=(3, 2) with two carried values of the same structure: a swap would not
    fail loudly (as it does with different structures), it would compute with the wrong one."""

    def loss(params, batch, scale, shift):
        x, y = batch
        value = jnp.mean((mlp_apply(params, x) - y) ** 2) * scale + shift
        return value, (shift + 1.0, scale * 2.0)  # new values for 3 (shift), then 2 (scale)

    fn = jaxaccum.value_and_grad(loss, num_microbatches=4, carry_argnums=(3, 2))
    (value, (shift, scale)), _ = jax.jit(fn)(PARAMS, BATCH, jnp.asarray(3.0), jnp.asarray(0.5))
    assert float(scale) == 48.0 and float(shift) == 4.5
    micro = [jax.tree.map(lambda a, i=i: a[i::4], BATCH) for i in range(4)]
    expected = sum(
        jnp.mean((mlp_apply(PARAMS, m[0]) - m[1]) ** 2) * 3.0 * 2.0**i + 0.5 + i
        for i, m in enumerate(micro)
    ) / 4
    assert float(value) == pytest.approx(float(expected), rel=1e-6)
