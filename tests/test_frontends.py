"""What users of each front end run into: the Flax MNIST tutorial's metrics, linen dropout,
NNX keywords and clones, Equinox modules, objects given to the wrong entry point, options."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_close, mlp_params, mse_loss, random_batch, refuses
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import jaxaccum
import jaxaccum.linen
import jaxaccum.nnx

# --- the Flax NNX MNIST tutorial, accumulated -----------------------------------------------


class TutorialCNN(nnx.Module):
    """The tutorial's CNN: two convolutions, average pooling, two dense layers."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.linear1 = nnx.Linear(7 * 7 * 16, 64, rngs=rngs)
        self.linear2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        pool = lambda h: nnx.avg_pool(h, window_shape=(2, 2), strides=(2, 2))  # noqa: E731
        x = pool(nnx.relu(self.conv1(x)))
        x = pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def tutorial_loss(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, logits


def tutorial_batches(mnist, n, size=32):
    x = mnist.train_images[: n * size].reshape(n, size, 28, 28, 1).astype(np.float32)
    y = mnist.train_labels[: n * size].reshape(n, size)
    return [{"image": jnp.asarray(a), "label": jnp.asarray(b)} for a, b in zip(x, y, strict=True)]


def test_nnx_tutorial_metrics_with_concat_aux_equal_sequential_microbatches(mnist):
    """The tutorial's train step with nnx.value_and_grad swapped for jaxaccum's and
    has_aux="concat": metrics.update(logits=...) runs unchanged and reports what k
    sequential micro-batch calls report."""
    k = 4

    def run(accumulate: bool):
        model = TutorialCNN(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(5e-3, 0.9), wrt=nnx.Param)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                                  loss=nnx.metrics.Average("loss"))

        @nnx.jit
        def train_step(model, optimizer, metrics, batch):
            if accumulate:
                grad_fn = jaxaccum.nnx.value_and_grad(tutorial_loss, has_aux="concat",
                                                      num_microbatches=k)
                (loss, logits), grads = grad_fn(model, batch)
                metrics.update(loss=loss, logits=logits, labels=batch["label"])
            else:  # k sequential micro-batch calls, gradients averaged by hand
                grads = None
                for i in range(k):
                    micro = jax.tree.map(lambda a, i=i: a[i::k], batch)
                    (loss, logits), g = nnx.value_and_grad(tutorial_loss, has_aux=True)(
                        model, micro)
                    metrics.update(loss=loss, logits=logits, labels=micro["label"])
                    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
                grads = jax.tree.map(lambda g: g / k, grads)
            optimizer.update(model, grads)

        for batch in tutorial_batches(mnist, 12):
            train_step(model, optimizer, metrics, batch)
        return metrics.compute()

    ours, ref = run(True), run(False)
    print(f"tutorial train accuracy: accumulated {float(ours['accuracy']):.4f}, sequential "
          f"{float(ref['accuracy']):.4f}")
    # Both runs evaluate the same micro-batches, but their parameters differ by float32 rounding
    # (gradients summed in another order) after 12 Adam steps: a logit near a tie may flip one
    # argmax. Two of the 384 examples (0.005) is far below the strided-reshape bug (0.12 vs 0.94).
    assert float(ours["accuracy"]) == pytest.approx(float(ref["accuracy"]), abs=2 / 384)
    assert float(ours["loss"]) == pytest.approx(float(ref["loss"]), rel=1e-5)
    assert float(ours["accuracy"]) > 0.3  # it learns: the labels line up with the logits


def test_concat_aux_is_in_batch_order_and_stack_is_strided():
    params, batch = mlp_params(jax.random.key(0)), random_batch(jax.random.key(1), 24)

    def fn(p, b):
        return mse_loss(p, b), b[0][:, 0]

    for k in (1, 3, 8, 24):
        (_, concat), _ = jaxaccum.value_and_grad(fn, num_microbatches=k, has_aux="concat")(
            params, batch)
        np.testing.assert_array_equal(concat, batch[0][:, 0])
        (_, stacked), _ = jaxaccum.value_and_grad(fn, num_microbatches=k, has_aux=True)(
            params, batch)
        np.testing.assert_array_equal(stacked, batch[0][:, 0].reshape(-1, k).T)


def test_concat_of_a_scalar_aux_says_what_to_use_instead():
    params, batch = mlp_params(jax.random.key(0)), random_batch(jax.random.key(1), 8)
    fn = jaxaccum.value_and_grad(lambda p, b: (mse_loss(p, b), {"s": 1.0}),
                                 num_microbatches=2, has_aux="concat")
    with refuses(ValueError, match=r"jaxaccum.value_and_grad.*\['s'\].*'mean'"):
        fn(params, batch)


# --- linen: dropout keys per micro-batch --------------------------------------------------------


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(4)(x)


def test_linen_dropout_draws_each_microbatch_masks_as_sequential_apply_calls():
    k, model = 4, DropoutMLP()
    x, y = random_batch(jax.random.key(1), 16, sizes=(8, 4))
    params = model.init(jax.random.key(0), x, train=False)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.sgd(0.1))

    def loss_fn(params, batch, rngs):
        x, y = batch
        out = state.apply_fn({"params": params}, x, train=True, rngs=rngs)
        return jnp.mean((out - y) ** 2)

    key = jax.random.key(7)
    step = jaxaccum.linen.train_step(loss_fn, num_microbatches=k, donate=False)
    new, loss, _ = step(state, (x, y), rngs={"dropout": key})

    grads, losses = [], []  # k sequential apply calls with keys fold_in(key, i)
    for i in range(k):
        rngs = {"dropout": jax.random.fold_in(key, i)}
        value, g = jax.value_and_grad(loss_fn)(params, (x[i::k], y[i::k]), rngs)
        losses.append(value)
        grads.append(g)
    ref = state.apply_gradients(grads=jax.tree.map(lambda *g: sum(g) / k, *grads))
    assert_trees_close(new.params, ref.params, 1e-6)
    assert float(loss) == pytest.approx(float(sum(losses) / k), rel=1e-6)

    # one key for every micro-batch (what passing the key as an argument did) differs
    def same_key(params, batch, key):
        return loss_fn(params, batch, {"dropout": key})

    g_same = jaxaccum.value_and_grad(same_key, num_microbatches=k)(params, (x, y), key)[1]
    g_ours = jax.tree.map(lambda *g: sum(g) / k, *grads)
    assert jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                                        g_same, g_ours))[0] > 1e-4


# --- NNX: keywords, graph nodes by keyword, clones ------------------------------------------------


class Noisy(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((8, 4)))
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs):
        return self.drop(x @ self.w, rngs=rngs)


def noisy_loss(model, batch, *, rngs, scale=1.0):
    x, y = batch
    return scale * jnp.mean((model(x, rngs) - y) ** 2)


def test_nnx_step_passes_keywords_and_carries_graph_nodes_given_by_keyword():
    k = 4
    x, y = random_batch(jax.random.key(1), 16, sizes=(8, 4))
    model, rngs = Noisy(), nnx.Rngs(dropout=3)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = jaxaccum.nnx.train_step(noisy_loss, num_microbatches=k)
    loss, _ = step(model, optimizer, (x, y), rngs=rngs, scale=2.0)

    ref_model, ref_rngs = Noisy(), nnx.Rngs(dropout=3)
    grads, losses = None, []
    for i in range(k):  # the same micro-batches one after the other
        value, g = nnx.value_and_grad(lambda m, b, r: noisy_loss(m, b, rngs=r, scale=2.0))(
            ref_model, (x[i::k], y[i::k]), ref_rngs)
        losses.append(value)
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    ref_opt = nnx.Optimizer(ref_model, optax.sgd(0.1), wrt=nnx.Param)
    ref_opt.update(ref_model, jax.tree.map(lambda g: g / k, grads))
    assert int(rngs.dropout.count[...]) == int(ref_rngs.dropout.count[...]) == k
    assert float(loss) == pytest.approx(float(sum(losses) / k), rel=1e-6)
    assert_trees_close(model.w[...], ref_model.w[...], 1e-6)


def test_nnx_value_and_grad_takes_a_graph_node_by_keyword():
    x, y = random_batch(jax.random.key(1), 16, sizes=(8, 4))
    model, rngs = Noisy(), nnx.Rngs(dropout=3)
    fn = nnx.jit(lambda m, b, r: jaxaccum.nnx.value_and_grad(noisy_loss, num_microbatches=4)(
        m, b, rngs=r))
    loss, grads = fn(model, (x, y), rngs)
    assert np.isfinite(float(loss)) and int(rngs.dropout.count[...]) == 4
    assert grads["w"][...].shape == (8, 4)


def test_nnx_clone_survives_the_default_step_and_donation_is_opt_in():
    x, y = random_batch(jax.random.key(1), 16, sizes=(8, 4))
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    best = nnx.clone(model)  # a best-model snapshot sharing arrays with model
    step = jaxaccum.nnx.train_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2),
                                   num_microbatches=2)
    step(model, optimizer, (x, y))
    assert best(x).shape == (16, 4)  # not deleted: the default step does not donate
    assert not np.array_equal(best.kernel[...], model.kernel[...])


# --- Equinox ------------------------------------------------------------------------------------


def test_equinox_module_passed_whole_equals_filter_value_and_grad():
    model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))
    x, y = random_batch(jax.random.key(1), 32, sizes=(8, 4))

    def loss(model, batch):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    ref_loss, ref_grads = eqx.filter_value_and_grad(loss)(model, (x, y))
    for k in (1, 4):
        value, grads = eqx.filter_jit(jaxaccum.value_and_grad(loss, num_microbatches=k))(
            model, (x, y))
        assert float(value) == pytest.approx(float(ref_loss), rel=1e-6)
        assert_trees_close(eqx.filter(grads, eqx.is_array), eqx.filter(ref_grads, eqx.is_array),
                           1e-6)
        updated = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
        assert isinstance(updated, eqx.nn.MLP)


# --- errors that name the entry point and the fix ---------------------------------------------


def test_nnx_module_and_train_state_to_the_core_api_name_the_front_end():
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    x = jnp.ones((4, 8))
    fn = jaxaccum.value_and_grad(lambda m, b: jnp.mean(m(b)), num_microbatches=2)
    with refuses(TypeError, match=r"jaxaccum.value_and_grad.*jaxaccum\.nnx"):
        fn(model, x)
    state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(8)},
                                          tx=optax.sgd(0.1))
    with refuses(TypeError, match=r"jaxaccum.value_and_grad.*jaxaccum\.linen"):
        fn(state, x)


def test_batch_by_keyword_says_keywords_are_passed_whole():
    params, batch = mlp_params(jax.random.key(0)), random_batch(jax.random.key(1), 8)
    fn = jaxaccum.value_and_grad(mse_loss, num_microbatches=2)
    with refuses(TypeError, match="jaxaccum.value_and_grad.*passed whole"):
        fn(params, batch=batch)


@pytest.mark.parametrize("name, hint", [
    ("aux_reduce", "has_aux="), ("data_axis", "DataParallel"), ("fsdp", "DataParallel"),
    ("param_shardings", "DataParallel"), ("remat", "jax.checkpoint"),
])
def test_removed_options_say_what_replaces_them(name, hint):
    for entry, make in (
        ("jaxaccum.value_and_grad", lambda **o: jaxaccum.value_and_grad(mse_loss, **o)),
        ("jaxaccum.train_step", lambda **o: jaxaccum.train_step(mse_loss, optax.sgd(1), **o)),
        ("jaxaccum.nnx.train_step", lambda **o: jaxaccum.nnx.train_step(mse_loss, **o)),
        ("jaxaccum.linen.train_step", lambda **o: jaxaccum.linen.train_step(mse_loss, **o)),
    ):
        with refuses(TypeError, match=f"{entry}: the option {name}=.*{hint}"):
            make(num_microbatches=2, **{name: None})


def test_unknown_option_and_bad_counts_name_the_entry_point():
    with refuses(TypeError, match="jaxaccum.nnx.value_and_grad: unknown option"):
        jaxaccum.nnx.value_and_grad(mse_loss, num_microbatches=2, microbatches=2)
    with refuses(ValueError, match="jaxaccum.train_step: exactly one of"):
        jaxaccum.train_step(mse_loss, optax.sgd(1.0))
    with refuses(ValueError, match="jaxaccum.linen.train_step: num_microbatches must"):
        jaxaccum.linen.train_step(mse_loss, num_microbatches=0)
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    with refuses(ValueError, match="DataParallel\\(mesh, data_axis='data'\\)"):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=2, mesh=mesh)


def test_per_device_batch_size_is_named_per_device():
    from jaxaccum import _validation

    with refuses(ValueError, match="per-device batch size 6 .*48 over 8 devices"):
        _validation.resolve_num_microbatches(6, 4, None, "jaxaccum.train_step", devices=8)


# --- zero-weight and skipped steps in the Flax front ends; which variables they update ---------


def _linear_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("donate", [False, True])
def test_nnx_step_with_every_microbatch_skipped_changes_nothing(donate):
    x, y = random_batch(jax.random.key(1), 16, sizes=(8, 4))
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    before = np.array(model.kernel[...])
    step = jaxaccum.nnx.train_step(_linear_loss, num_microbatches=4, skip_nonfinite=True,
                                   donate=donate)
    loss, info = step(model, optimizer, (x * jnp.nan, y))
    assert float(loss) == 0.0 and int(optimizer.step[...]) == 0 and int(info.skipped) == 4
    np.testing.assert_array_equal(model.kernel[...], before)
    step(model, optimizer, (x, y))
    assert int(optimizer.step[...]) == 1 and not np.array_equal(model.kernel[...], before)


class TwoPart(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(jnp.ones((8, 4)))
        self.b = nnx.Param(jnp.ones((8, 4)))

    def __call__(self, x):
        return x @ self.a + x @ self.b


def test_nnx_step_differentiates_what_the_optimizer_updates():
    x, y = random_batch(jax.random.key(1), 16, sizes=(8, 4))
    model = TwoPart()
    only_a = nnx.PathContains("a")
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=only_a)
    step = jaxaccum.nnx.train_step(_linear_loss, num_microbatches=4)
    step(model, optimizer, (x, y))
    np.testing.assert_array_equal(model.b[...], jnp.ones((8, 4)))  # not in the optimizer's wrt
    ref = TwoPart()
    grads = nnx.grad(_linear_loss, argnums=nnx.DiffState(0, only_a))(ref, (x, y))
    np.testing.assert_allclose(model.a[...], 1.0 - 0.1 * grads["a"][...], rtol=1e-6)


def test_linen_step_with_zero_total_weight_changes_nothing():
    def loss_fn(params, batch):
        x, y, w = batch
        return jnp.mean((x @ params - y) ** 2), jnp.sum(w)

    state = train_state.TrainState.create(apply_fn=None, params=jnp.ones((8, 4)),
                                          tx=optax.adam(0.1))
    x, y = random_batch(jax.random.key(1), 16, sizes=(8, 4))
    for donate in (False, True):
        step = jaxaccum.linen.train_step(loss_fn, num_microbatches=4, weighted=True,
                                         donate=donate)
        new, loss, _ = step(state if not donate else jax.tree.map(jnp.copy, state),
                         (x, y, jnp.zeros(16)))
        assert int(new.step) == 0 and float(loss) == 0.0
        np.testing.assert_array_equal(new.params, state.params)
        assert int(new.opt_state[0].count) == 0


def test_linen_apply_gradients_passes_the_weight_and_the_new_overwrite_value():
    tx = jaxaccum.multi_steps(optax.sgd(1.0), every_k=2)
    params = {"params": jnp.zeros(2), "_overwrite_with_gradient": jnp.zeros(2)}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    grads = [{"params": jnp.array([1.0, 0.0]), "_overwrite_with_gradient": jnp.array([5.0, 6.0])},
             {"params": jnp.array([0.0, 4.0]), "_overwrite_with_gradient": jnp.array([7.0, 8.0])}]
    state = jaxaccum.linen.apply_gradients(state, grads[0], weight=3.0)
    state = jaxaccum.linen.apply_gradients(state, grads[1], weight=1.0)
    # the weighted mean (3 * g0 + 1 * g1) / 4, one SGD step; the overwrite is the latest value
    np.testing.assert_allclose(state.params["params"], [-0.75, -1.0])
    np.testing.assert_array_equal(state.params["_overwrite_with_gradient"], [7.0, 8.0])
    assert int(state.step) == 1


class Scaled(eqx.Module):
    """An Equinox module with a plain float hyperparameter (a leaf, not an array)."""

    weight: jax.Array
    scale: float

    def __call__(self, x):
        return self.scale * jnp.tanh(x @ self.weight)


def test_equinox_float_fields_are_not_differentiated():
    """As ``eqx.filter_value_and_grad``: only inexact arrays get gradients; the float field's
    gradient is None, so an update leaves it exactly as it was."""
    model = Scaled(jax.random.normal(jax.random.key(0), (8, 4)) / 3, 2.0)
    x, y = random_batch(jax.random.key(1), 16, sizes=(8, 4))

    def loss(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2)

    ref_loss, ref_grads = eqx.filter_value_and_grad(loss)(model, (x, y))
    value, grads = eqx.filter_jit(jaxaccum.value_and_grad(loss, num_microbatches=4))(
        model, (x, y))
    assert float(value) == pytest.approx(float(ref_loss), rel=1e-6)
    assert grads.scale is None and ref_grads.scale is None
    np.testing.assert_allclose(grads.weight, ref_grads.weight, rtol=1e-5, atol=1e-7)
    updated = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
    assert updated.scale == 2.0
