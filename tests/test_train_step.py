"""jaxaccum.train_step: k micro-batches follow the full-batch trajectory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    assert_trees_close,
    assert_within_rounding,
    float64_trajectory,
    full_batch_trajectory,
    max_rel_diff,
    mlp_params,
    mse_loss,
    optimizers,
    random_batch,
    refuses,
)
from flax import nnx
from flax.training import train_state

import jaxaccum
import jaxaccum.linen
import jaxaccum.nnx

PARAMS = mlp_params(jax.random.key(0))
BATCHES = [random_batch(jax.random.key(10 + i), 64) for i in range(5)]


def copy(tree):
    return jax.tree.map(jnp.array, tree)


@pytest.mark.parametrize("k", [4, 16])
@pytest.mark.parametrize("name", list(optimizers()))
def test_trajectory_equals_full_batch(name, k):
    optimizer = optimizers()[name]()
    expected = full_batch_trajectory(mse_loss, optimizer, PARAMS, BATCHES)
    reference = float64_trajectory(mse_loss, optimizers()[name], PARAMS, BATCHES)
    step = jaxaccum.train_step(mse_loss, optimizer, num_microbatches=k)
    params = copy(PARAMS)
    state = optimizer.init(params)
    for batch in BATCHES:
        params, state, loss, info = step(params, state, batch)
    assert info.aux is None and int(info.num_microbatches) == k
    assert_within_rounding(params, expected, reference)
    moved = jax.tree.map(lambda a, b: a - b, expected, PARAMS)
    assert max(float(jnp.max(jnp.abs(m))) for m in jax.tree.leaves(moved)) > 1e-3


def test_loss_and_aux_returned():
    def loss_aux(params, batch):
        loss = mse_loss(params, batch)
        return loss, {"loss": loss}

    optimizer = optax.sgd(0.1)
    step = jaxaccum.train_step(loss_aux, optimizer, microbatch_size=16, has_aux=True)
    params = copy(PARAMS)
    expected_loss = mse_loss(PARAMS, BATCHES[0])
    _, _, loss, info = step(params, optimizer.init(params), BATCHES[0])
    aux = info.aux
    assert aux["loss"].shape == (4,)
    assert_trees_close(loss, expected_loss, 1e-6)
    assert_trees_close(jnp.mean(aux["loss"]), expected_loss, 1e-6)


def test_params_and_state_are_donated():
    optimizer = optax.adam(1e-3)
    step = jaxaccum.train_step(mse_loss, optimizer, num_microbatches=4)
    params = copy(PARAMS)
    state = optimizer.init(params)
    new_params, new_state, _, _ = step(params, state, BATCHES[0])
    assert all(p.is_deleted() for p in jax.tree.leaves(params))
    assert all(s.is_deleted() for s in jax.tree.leaves(state))
    assert not any(p.is_deleted() for p in jax.tree.leaves(new_params))
    kept = jaxaccum.train_step(mse_loss, optimizer, num_microbatches=4, donate=False)
    params = copy(PARAMS)
    kept(params, optimizer.init(params), BATCHES[0])
    assert not any(p.is_deleted() for p in jax.tree.leaves(params))


def test_weighted_train_step_equals_masked_full_batch():
    mask = (jnp.arange(64) % 7 < 3).astype(jnp.float32).at[16:32].set(0.0)
    batch = (*BATCHES[0], mask)

    def masked(params, batch):
        x, y, m = batch
        per_example = jnp.mean((x @ params["layer0"]["w"] @ params["layer1"]["w"] - y) ** 2, -1)
        return jnp.sum(per_example * m) / jnp.maximum(jnp.sum(m), 1), jnp.sum(m)

    optimizer = optax.adam(1e-2)
    mean_loss = lambda p, b: masked(p, b)[0]  # noqa: E731
    expected = full_batch_trajectory(mean_loss, optimizer, PARAMS, [batch])
    reference = float64_trajectory(mean_loss, lambda: optax.adam(1e-2), PARAMS, [batch])
    step = jaxaccum.train_step(masked, optimizer, num_microbatches=4, weighted=True)
    params = copy(PARAMS)
    params, _, _, _ = step(params, optimizer.init(params), batch)
    assert_within_rounding(params, expected, reference)


def test_optimizer_type_checked():
    with refuses(TypeError, match=r"optimizer must be an optax.GradientTransformation"):
        jaxaccum.train_step(mse_loss, "adam", num_microbatches=2)


def test_skip_nonfinite_step_uses_remaining_examples():
    x, y = BATCHES[0]
    bad = (x.at[21].set(jnp.inf), y)  # strided micro-batch 1 of 4: examples 1, 5, 9, ...
    keep = np.flatnonzero(np.arange(64) % 4 != 1)
    optimizer = optax.adam(1e-2)
    kept = [(x[keep], y[keep])]
    expected = full_batch_trajectory(mse_loss, optimizer, PARAMS, kept)
    reference = float64_trajectory(mse_loss, lambda: optax.adam(1e-2), PARAMS, kept)
    step = jaxaccum.train_step(mse_loss, optimizer, num_microbatches=4, skip_nonfinite=True)
    params = copy(PARAMS)
    params, state, _, info = step(params, optimizer.init(params), bad)
    assert int(info.skipped) == 1
    assert_within_rounding(params, expected, reference)


def test_skip_nonfinite_all_bad_leaves_params_and_state():
    x, y = BATCHES[0]
    optimizer = optax.adam(1e-2)
    step = jaxaccum.train_step(
        mse_loss, optimizer, num_microbatches=4, skip_nonfinite=True, donate=False
    )
    state = optimizer.init(PARAMS)
    params, new_state, _, info = step(PARAMS, state, (x * jnp.nan, y))
    assert int(info.skipped) == 4
    assert max_rel_diff(params, PARAMS) == 0.0
    assert int(new_state[0].count) == 0


def test_deterministic_in_process():
    optimizer = optax.adam(1e-2)
    results = []
    for _ in range(2):
        step = jaxaccum.train_step(mse_loss, optimizer, num_microbatches=8)
        params = copy(PARAMS)
        state = optimizer.init(params)
        for batch in BATCHES:
            params, state, _, _ = step(params, state, batch)
        results.append(params)
    assert max_rel_diff(results[0], results[1]) == 0.0


def test_flax_linen_model():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.tanh(nn.Dense(16)(x)))

    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 8)))

    def loss(p, batch):
        x, y = batch
        return jnp.mean((model.apply(p, x) - y) ** 2)

    optimizer = optax.adam(1e-2)
    expected = full_batch_trajectory(loss, optimizer, params, BATCHES[:3])
    step = jaxaccum.train_step(loss, optimizer, num_microbatches=8, donate=False)
    state = optimizer.init(params)
    for batch in BATCHES[:3]:
        params, state, _, _ = step(params, state, batch)
    assert_trees_close(params, expected, 1e-5)


def masked_mse(params, batch):
    """(mean over valid examples, their number); 0/0 = NaN for an empty micro-batch."""
    x, y, m = batch
    per_example = jnp.mean((jaxaccum_mlp(params, x) - y) ** 2, -1)
    return jnp.sum(per_example * m) / jnp.sum(m), jnp.sum(m)


def jaxaccum_mlp(params, x):
    from conftest import mlp_apply

    return mlp_apply(params, x)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_zero_total_weight_takes_no_optimizer_step(skip_nonfinite, donate):
    """All weights 0: neither params nor Adam's count and moments move (as in multi_steps)."""
    optimizer = optax.adam(1e-2)
    step = jaxaccum.train_step(
        masked_mse, optimizer, num_microbatches=4, weighted=True, donate=donate,
        skip_nonfinite=skip_nonfinite,
    )
    params = copy(PARAMS)
    state = optimizer.init(params)
    params, state, _, _ = step(params, state, (*BATCHES[0], jnp.ones(64)))  # one real step
    before = jax.tree.map(np.asarray, (params, state))
    new_params, new_state, loss, _ = step(params, state, (*BATCHES[1], jnp.zeros(64)))
    assert float(loss) == 0.0
    assert max_rel_diff(new_params, before[0]) == 0.0
    assert max_rel_diff(new_state, before[1]) == 0.0
    assert int(new_state[0].count) == 1


@pytest.mark.parametrize("donate", [True, False])
def test_zero_weight_skip_costs_no_memory(donate):
    """The rule that skips a zero-weight step adds no parameter-sized temp buffer: a cond when
    params and state are donated (a select would hold old and new), a select when they are not
    (a cond's results would need buffers of their own). Compared with the unweighted step,
    which has no skip at all."""
    sizes = (64, 256, 256, 8)  # parameters (~0.4 MB) outweigh a micro-batch's activations
    params = mlp_params(jax.random.key(3), sizes)
    batch = random_batch(jax.random.key(4), 64, sizes)
    optimizer = optax.adam(1e-3)

    def weighted(p, b):
        return mse_loss(p, b), jnp.float32(b[0].shape[0])

    temps = {}
    for name, fn, w in (("weighted", weighted, True), ("unweighted", mse_loss, False)):
        step = jaxaccum.train_step(fn, optimizer, num_microbatches=8, weighted=w, donate=donate)
        compiled = step.lower(params, optimizer.init(params), batch).compile()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert temps["weighted"] <= temps["unweighted"] + param_bytes // 100, (temps, param_bytes)


@pytest.mark.parametrize("k", [8, 64])
def test_a_donated_step_holds_one_gradient_sized_buffer_more_than_its_gradient(k):
    """No gradient-sized buffer between the loop and the update: the step's temp is the
    accumulated gradient's (``value_and_grad``, whose result is an output, not temp) plus the
    accumulator itself, weighted (the zero-weight rule's cond) or not. The division by the
    total weight is fused into the optimizer's update."""
    sizes = (64, 256, 256, 8)
    params = mlp_params(jax.random.key(3), sizes)
    batch = random_batch(jax.random.key(4), 64, sizes)
    optimizer = optax.adam(1e-3)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    gradient = jax.jit(jaxaccum.value_and_grad(mse_loss, num_microbatches=k)).lower(
        params, batch).compile().memory_analysis().temp_size_in_bytes

    def weighted(p, b):
        return mse_loss(p, b), jnp.float32(b[0].shape[0])

    for fn, w in ((mse_loss, False), (weighted, True)):
        step = jaxaccum.train_step(fn, optimizer, num_microbatches=k, weighted=w)
        temp = step.lower(params, optimizer.init(params), batch).compile().memory_analysis()
        assert temp.temp_size_in_bytes <= gradient + param_bytes * 101 // 100, (
            w, temp.temp_size_in_bytes, gradient, param_bytes)
        # the linen step (a TrainState, donated whole) holds the same
        state = train_state.TrainState.create(apply_fn=None, params=params, tx=optimizer)
        linen = jaxaccum.linen.train_step(fn, num_microbatches=k, weighted=w)
        temp = jax.jit(linen, donate_argnums=0).lower(state, batch).compile().memory_analysis()
        assert temp.temp_size_in_bytes <= gradient + param_bytes * 101 // 100, (
            "linen", w, temp.temp_size_in_bytes, gradient, param_bytes)
        # the NNX step (model and optimizer donated) too, within a little bookkeeping of its
        # split and merge (a gradient-sized buffer more would be 100 %)
        model = _NnxMlp(sizes)
        nnx_opt = nnx.Optimizer(model, optimizer, wrt=nnx.Param)
        nnx_step = jaxaccum.nnx.train_step(_nnx_loss(w), num_microbatches=k, weighted=w,
                                           donate=True)
        graphdef, state = nnx.split((model, nnx_opt))

        def whole(state, batch, graphdef=graphdef, nnx_step=nnx_step):
            model, nnx_opt = nnx.merge(graphdef, state)
            nnx_step(model, nnx_opt, batch)
            return nnx.state((model, nnx_opt))

        temp = jax.jit(whole, donate_argnums=0).lower(state, batch).compile().memory_analysis()
        assert temp.temp_size_in_bytes <= gradient + param_bytes * 103 // 100, (
            "nnx", w, temp.temp_size_in_bytes, gradient, param_bytes)


class _NnxMlp(nnx.Module):
    def __init__(self, sizes):
        rngs = nnx.Rngs(0)
        self.layers = nnx.List([nnx.Linear(m, n, rngs=rngs)
                                for m, n in zip(sizes[:-1], sizes[1:], strict=True)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def _nnx_loss(weighted):
    def loss(model, batch):
        x, y = batch
        value = jnp.mean((model(x) - y) ** 2)
        return (value, jnp.float32(x.shape[0])) if weighted else value

    return loss


def test_python_float_leaf_in_params():
    """jax.value_and_grad accepts a Python float leaf; so do value_and_grad and train_step."""

    def loss(p, batch):
        return p["scale"] * mse_loss(p["mlp"], batch)

    params = {"mlp": PARAMS, "scale": 2.0}
    expected = jax.value_and_grad(loss)(params, BATCHES[0])
    got = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=4))(params, BATCHES[0])
    assert_trees_close(got, expected, 1e-6)
    optimizer = optax.sgd(0.1)
    step = jaxaccum.train_step(loss, optimizer, num_microbatches=4, donate=False)
    new, _, _, _ = step(params, optimizer.init(params), BATCHES[0])
    assert abs(float(new["scale"]) - (2.0 - 0.1 * float(expected[1]["scale"]))) < 1e-6
