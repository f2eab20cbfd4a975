"""jaxaccum.multi_steps: one micro-batch per call, one optimizer step per window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    assert_trees_close,
    full_batch_trajectory,
    grad_and_update,
    max_rel_diff,
    mlp_params,
    mse_loss,
    optimizers,
    random_batch,
)

import jaxaccum

PARAMS = mlp_params(jax.random.key(0))
BATCHES = [random_batch(jax.random.key(10 + i), 64) for i in range(5)]


def microbatches(batch, k):
    return [
        jax.tree.map(lambda x, i=i: x[i * (64 // k) : (i + 1) * (64 // k)], batch) for i in range(k)
    ]


def run_micro(optimizer, k, params=PARAMS, batches=BATCHES, loss_fn=mse_loss):
    """Feeds one micro-batch per jitted call; returns the final params and state."""
    call = grad_and_update(loss_fn, optimizer)
    state = optimizer.init(params)
    for batch in batches:
        for micro in microbatches(batch, k):
            params, state = call(params, state, micro)
    return params, state


@pytest.mark.parametrize("k", [4, 16])
@pytest.mark.parametrize("name", list(optimizers()))
def test_trajectory_equals_full_batch(name, k):
    expected = full_batch_trajectory(mse_loss, optimizers()[name](), PARAMS, BATCHES)
    params, state = run_micro(jaxaccum.multi_steps(optimizers()[name](), k), k)
    assert_trees_close(params, expected, 1e-5)
    assert int(state.gradient_step) == len(BATCHES)
    assert int(state.micro_step) == 0


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw_schedule"])
def test_equals_optax_multisteps(name):
    ours, _ = run_micro(jaxaccum.multi_steps(optimizers()[name](), 8), 8)
    theirs, _ = run_micro(optax.MultiSteps(optimizers()[name](), 8).gradient_transformation(), 8)
    assert_trees_close(ours, theirs, 1e-6)


def test_inner_counter_advances_once_per_optimizer_step():
    optimizer = jaxaccum.multi_steps(optax.adam(1e-3), 4)
    _, state = run_micro(optimizer, 4, batches=BATCHES[:3])
    assert int(state.inner_state[0].count) == 3


def counting_transform(calls):
    """An identity transform that records each execution of its update on the host."""

    def update(updates, state, params=None):
        del params
        jax.debug.callback(lambda: calls.append(1))
        return updates, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def test_inner_update_runs_only_when_emitting():
    ours, theirs = [], []
    run_micro(jaxaccum.multi_steps(counting_transform(ours), 4), 4, batches=BATCHES[:2])
    run_micro(
        optax.MultiSteps(counting_transform(theirs), 4).gradient_transformation(),
        4,
        batches=BATCHES[:2],
    )
    jax.effects_barrier()
    assert len(ours) == 2  # 8 calls, 2 optimizer steps
    assert len(theirs) == 8  # optax.MultiSteps evaluates the inner update on every call


def test_zero_updates_until_emit_and_has_updated():
    optimizer = jaxaccum.multi_steps(optax.sgd(0.1), 3)
    update = jax.jit(optimizer.update)
    state = optimizer.init(PARAMS)
    grads = jax.grad(mse_loss)(PARAMS, BATCHES[0])
    flags, norms = [], []
    for _ in range(6):
        updates, state = update(grads, state, PARAMS)
        flags.append(bool(jaxaccum.has_updated(state)))
        norms.append(float(optax.tree.norm(updates)))
    assert flags == [False, False, True, False, False, True]
    assert norms[0] == norms[1] == norms[3] == 0.0
    np.testing.assert_allclose(norms[2], 0.1 * float(optax.tree.norm(grads)), rtol=1e-6)


def test_every_k_schedule():
    optimizer = jaxaccum.multi_steps(optax.sgd(0.1), lambda step: jnp.where(step < 1, 2, 3))
    update = jax.jit(optimizer.update)
    state = optimizer.init(PARAMS)
    grads = jax.grad(mse_loss)(PARAMS, BATCHES[0])
    flags = []
    for _ in range(8):
        _, state = update(grads, state, PARAMS)
        flags.append(bool(jaxaccum.has_updated(state)))
    assert flags == [False, True, False, False, True, False, False, True]


def test_weighted_uneven_windows():
    counts = [5, 0, 11, 16]
    mask = jnp.asarray(np.concatenate([np.arange(16) < c for c in counts]), jnp.float32)
    x, y = BATCHES[0]

    def masked(params, batch):
        x, y, m = batch
        per_example = jnp.mean(
            (jnp.tanh(x @ params["layer0"]["w"]) @ params["layer1"]["w"] - y) ** 2, -1
        )
        return jnp.sum(per_example * m) / jnp.maximum(jnp.sum(m), 1)

    optimizer = optax.adam(1e-2)
    expected = full_batch_trajectory(masked, optimizer, PARAMS, [(x, y, mask)])
    acc = jaxaccum.multi_steps(optax.adam(1e-2), 4)

    @jax.jit
    def call(params, state, micro):
        grads = jax.grad(masked)(params, micro)
        updates, state = acc.update(grads, state, params, weight=jnp.sum(micro[2]))
        return optax.apply_updates(params, updates), state

    params, state = PARAMS, acc.init(PARAMS)
    for micro in microbatches((x, y, mask), 4):
        params, state = call(params, state, micro)
    assert_trees_close(params, expected, 1e-5)
    unweighted, _ = run_micro(
        jaxaccum.multi_steps(optax.adam(1e-2), 4), 4, batches=[(x, y, mask)], loss_fn=masked
    )
    assert max_rel_diff(unweighted, expected) > 1e-3


def test_chainable_with_extra_args():
    """Inside optax.chain the weight keyword is forwarded; outer transforms see the emitted one."""
    inner = jaxaccum.multi_steps(optax.sgd(1.0), 2)
    chained = optax.chain(inner, optax.scale(0.5))
    state = chained.init(PARAMS)
    grads = jax.grad(mse_loss)(PARAMS, BATCHES[0])
    update = jax.jit(chained.update)
    _, state = update(grads, state, PARAMS, weight=1.0)
    updates, state = update(jax.tree.map(lambda g: 3 * g, grads), state, PARAMS, weight=3.0)
    # weighted mean of g (w=1) and 3g (w=3) is 2.5 g; sgd(1.0) then scale(0.5): -1.25 g
    assert_trees_close(updates, jax.tree.map(lambda g: -1.25 * g, grads), 1e-6)
    assert bool(jaxaccum.has_updated(state[0]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_accumulator_dtype(dtype):
    params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
    state = jaxaccum.multi_steps(optax.sgd(0.1), 2).init(params)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(state.acc_grads))
    state = jaxaccum.multi_steps(optax.sgd(0.1), 2, accumulator_dtype=None).init(params)
    assert all(a.dtype == dtype for a in jax.tree.leaves(state.acc_grads))
    assert state.micro_step.dtype == state.gradient_step.dtype == jnp.int32


@pytest.mark.parametrize("bad", [0, -1])
def test_every_k_below_one(bad):
    with pytest.raises(ValueError, match=rf"every_k must be >= 1; got every_k={bad}"):
        jaxaccum.multi_steps(optax.sgd(0.1), bad)


def test_every_k_wrong_type():
    with pytest.raises(TypeError, match=r"every_k must be a positive int; got '4'"):
        jaxaccum.multi_steps(optax.sgd(0.1), "4")


def test_weight_not_scalar():
    optimizer = jaxaccum.multi_steps(optax.sgd(0.1), 2)
    with pytest.raises(ValueError, match=r"weight must be a scalar.*shape \(2,\)"):
        optimizer.update(PARAMS, optimizer.init(PARAMS), PARAMS, weight=jnp.ones(2))


def test_inner_type_checked():
    with pytest.raises(TypeError, match=r"inner must be an optax.GradientTransformation; got str"):
        jaxaccum.multi_steps("sgd", 2)


# --- non-finite gradients, dtypes ------------------------------------------------------------


def feed(optimizer, grads_list, params=PARAMS):
    update = jax.jit(optimizer.update)
    state = optimizer.init(params)
    outs = []
    for g in grads_list:
        u, state = update(g, state, params)
        outs.append(u)
    return outs, state


def micro_grads(k=4):
    return [jax.grad(mse_loss)(PARAMS, m) for m in microbatches(BATCHES[0], k)]


def test_skip_nonfinite_renormalises():
    grads = micro_grads()
    bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads[1])
    outs, state = feed(
        jaxaccum.multi_steps(optax.sgd(1.0), 4, skip_nonfinite=True),
        [grads[0], bad, grads[2], grads[3]],
    )
    mean_of_rest = jax.tree.map(lambda a, b, c: -(a + b + c) / 3, grads[0], grads[2], grads[3])
    assert_trees_close(outs[-1], mean_of_rest, 1e-6)
    assert int(state.skipped) == 1 and int(state.gradient_step) == 1


def test_skip_nonfinite_whole_window_makes_no_step():
    bad = jax.tree.map(lambda g: g * jnp.inf, micro_grads()[0])
    outs, state = feed(jaxaccum.multi_steps(optax.adam(1e-2), 2, skip_nonfinite=True), [bad, bad])
    assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(outs[-1]))
    assert int(state.gradient_step) == 0 and int(state.inner_state[0].count) == 0
    assert int(state.skipped) == 2 and int(state.micro_step) == 0


def test_nan_propagates_without_skip():
    grads = micro_grads()
    bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads[1])
    outs, _ = feed(jaxaccum.multi_steps(optax.sgd(1.0), 2), [grads[0], bad])
    assert bool(jnp.isnan(outs[-1]["layer0"]["w"][0, 0]))


def test_integer_gradients_rejected():
    optimizer = jaxaccum.multi_steps(optax.sgd(1.0), 2)
    params = {"w": jnp.zeros(3, jnp.int32)}
    with pytest.raises(TypeError, match=r"leaf \['w'\] has dtype int32"):
        optimizer.update(params, optimizer.init({"w": jnp.zeros(3)}), params)


def test_bfloat16_gradients_float32_accumulator():
    keys = jax.random.split(jax.random.key(3), 64)
    grads = [jax.random.normal(k, (256,)).astype(jnp.bfloat16) * 1e-2 + 1.0 for k in keys]
    reference = np.sum([np.asarray(g, np.float64) for g in grads], axis=0)
    errors = {}
    for name, acc in (("float32", jnp.float32), ("bfloat16", None)):
        _, state = feed(
            jaxaccum.multi_steps(optax.sgd(1.0), 128, accumulator_dtype=acc),
            grads,
            params=jnp.zeros(256, jnp.bfloat16),
        )
        errors[name] = max_rel_diff(state.acc_grads, reference)
    assert errors["float32"] <= 1e-3
    assert errors["bfloat16"] > 10 * errors["float32"] and errors["bfloat16"] > 1e-3
    outs, _ = feed(
        jaxaccum.multi_steps(optax.sgd(1.0), 2), grads[:2], params=jnp.zeros(256, jnp.bfloat16)
    )
    assert outs[-1].dtype == jnp.bfloat16  # the emitted update is cast back


def test_none_leaves():
    params = {"w": PARAMS, "frozen": None}
    grads = {"w": micro_grads()[0], "frozen": None}
    outs, state = feed(jaxaccum.multi_steps(optax.adam(1e-2), 2), [grads, grads], params=params)
    assert outs[-1]["frozen"] is None and state.acc_grads["frozen"] is None
    assert float(optax.tree.norm(outs[-1]["w"])) > 0
