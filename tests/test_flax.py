"""Flax: jaxaccum.nnx (module state carried through the micro-batches) and linen TrainState."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    assert_trees_close,
    assert_within_rounding,
    max_rel_diff,
    random_batch,
    refuses,
    to_float64,
)
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import jaxaccum
import jaxaccum.linen
import jaxaccum.nnx

BATCH = 64


# --- the README's NNX example (literally) ---------------------------------------------------


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, (3, 3), strides=2, rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (3, 3), strides=2, rngs=rngs)
        self.bn2 = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(7 * 7 * 8, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x.reshape(-1, 28, 28, 1))))
        x = nnx.relu(self.bn2(self.conv2(x)))
        return self.out(self.drop(x.reshape(x.shape[0], -1)))


def loss_fn(model, batch):  # the MEAN loss over the examples it is given
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def readme_nnx_example(batches):
    model = CNN(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    step = jaxaccum.nnx.train_step(loss_fn, num_microbatches=4)
    for batch in batches:  # each batch: 4 micro-batches
        loss, _ = step(model, optimizer, batch)
    return model, loss


# Or in your own step: the drop-in for nnx.value_and_grad.
@nnx.jit
def train_step(model, optimizer, batch):
    loss, grads = jaxaccum.nnx.value_and_grad(loss_fn, num_microbatches=4)(model, batch)
    optimizer.update(model, grads)
    return loss


# --- helpers ----------------------------------------------------------------------------------


def batches(mnist, n, size=BATCH, offset=0):
    x, y = mnist.train_images, mnist.train_labels
    return [
        (jnp.asarray(x[offset + i * size: offset + (i + 1) * size]),
         jnp.asarray(y[offset + i * size: offset + (i + 1) * size]))
        for i in range(n)
    ]


@nnx.jit
def plain_value_and_grad(model, batch):
    return nnx.value_and_grad(loss_fn)(model, batch)


def sequential(model, batch, k):
    """The reference: the k strided micro-batches run one after the other through the module
    (train mode), each with plain nnx.value_and_grad; gradients averaged by hand."""
    losses, grads = [], []
    for i in range(k):
        loss, g = plain_value_and_grad(model, jax.tree.map(lambda a, i=i: a[i::k], batch))
        losses.append(loss)
        grads.append(g)
    return sum(losses) / k, jax.tree.map(lambda *g: sum(g) / k, *grads)


@nnx.jit(static_argnums=2)
def accumulated_value_and_grad(model, batch, k):
    return jaxaccum.nnx.value_and_grad(loss_fn, num_microbatches=k)(model, batch)


def bn_stats(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))


def arrays(*nodes):
    """Every array of the nodes' state, as NumPy (keys as their data): a snapshot."""
    def numpy(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.array(x)

    return jax.tree.map(numpy, nnx.to_pure_dict(nnx.state(nodes)))


def rng_count(model):
    return int(model.drop.rngs.count[...])


# --- tests ------------------------------------------------------------------------------------


def float32_masks(model):
    """Dropout draws its masks' uniforms in the dtype of its keep probability: a float32 rate
    draws the same masks whether x64 is enabled or not (the float64 reference needs them)."""
    model.drop.rate = np.float32(model.drop.rate)
    return model


def to_float64_module(model):
    """A float64 copy of ``model`` (call inside ``jax.enable_x64(True)``)."""
    copy = nnx.clone(model)
    nnx.update(copy, jax.tree.map(
        lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        nnx.state(copy)))
    return copy


@pytest.mark.parametrize("k", [1, 4, 8])
def test_nnx_cnn_state_and_gradients_equal_sequential_microbatches(mnist, k):
    batch = batches(mnist, 1)[0]
    model = float32_masks(CNN(nnx.Rngs(0)))
    ref, start = nnx.clone(model), nnx.clone(model)
    loss, grads = accumulated_value_and_grad(model, batch, k)
    full32 = sequential(ref, batch, k)
    stats, ref_stats = bn_stats(model), bn_stats(ref)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
               zip(jax.tree.leaves(stats), jax.tree.leaves(ref_stats), strict=True))
    rel = max_rel_diff((loss, grads), full32)
    print(f"k={k}: BN stats max abs diff {diff:.2e}; grads rel diff to the sequential float32 "
          f"run {rel:.2e}")
    if k == 1:  # no scan: the same computation
        assert rel <= 1e-6
    else:  # k sums in a scan vs k separate programs: rounding, bounded by a float64 run
        with jax.enable_x64(True):
            ref64 = sequential(to_float64_module(start), to_float64(batch), k)
        err, err_full = assert_within_rounding((loss, grads), full32, ref64)
        print(f"  error vs float64 {err:.2e} (sequential float32: {err_full:.2e})")
    assert diff <= 1e-6
    assert max_rel_diff(stats, jax.tree.map(jnp.zeros_like, ref_stats)) > 0  # they did move
    assert rng_count(model) == rng_count(ref) == k
    assert isinstance(grads, nnx.State)


def test_nnx_eval_mode_gradients_do_not_depend_on_k(mnist):
    batch = batches(mnist, 1)[0]
    model = CNN(nnx.Rngs(0))
    model.eval()
    before = bn_stats(model)
    _, g1 = accumulated_value_and_grad(model, batch, 1)
    _, g8 = accumulated_value_and_grad(model, batch, 8)
    print(f"eval mode, k=1 vs k=8: grads rel diff {max_rel_diff(g8, g1):.2e}")
    assert_trees_close(g8, g1, 1e-6)
    assert max_rel_diff(bn_stats(model), before) == 0.0


class Noise(nnx.Module):
    def __init__(self, rngs):
        self.scale = nnx.Param(jnp.ones(32))
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(x * self.scale)


def masks_fn(model, x):
    out = model(x)
    return jnp.mean(out), out != 0  # aux: the dropout mask (x has no zeros)


def test_nnx_dropout_draws_fresh_masks_in_every_microbatch():
    k, x = 4, jnp.ones((16, 32))
    model = Noise(nnx.Rngs(0))
    ref = nnx.clone(model)
    fn = jaxaccum.nnx.value_and_grad(masks_fn, num_microbatches=k, has_aux=True)
    (_, masks), _ = nnx.jit(fn)(model, x)
    assert masks.shape == (k, 4, 32)
    for i in range(k):
        for j in range(i):
            assert not np.array_equal(masks[i], masks[j])
        # micro-batch i draws what the i-th sequential call draws
        (_, ref_mask), _ = nnx.value_and_grad(masks_fn, has_aux=True)(ref, x[i::k])
        np.testing.assert_array_equal(masks[i], ref_mask)
    assert rng_count(model) == rng_count(ref) == k

    # What the glue of issue 11 did: the module's state passed whole (not carried), so every
    # micro-batch started from the same RNG count and drew the same masks.
    graphdef, params, rest = nnx.split(Noise(nnx.Rngs(0)), nnx.Param, ...)

    def uncarried(params, x, rest):
        return masks_fn(nnx.merge(graphdef, params, rest, copy=True), x)

    (_, same), _ = jaxaccum.value_and_grad(uncarried, num_microbatches=k, has_aux=True)(
        params, x, rest)
    assert all(np.array_equal(same[i], same[0]) for i in range(k))


def test_nnx_rngs_passed_to_loss_fn_are_carried():
    class Plain(nnx.Module):
        def __init__(self):
            self.scale = nnx.Param(jnp.ones(32))
            self.drop = nnx.Dropout(0.5)

        def __call__(self, x, rngs):
            return self.drop(x * self.scale, rngs=rngs)

    def fn(model, x, rngs):
        out = model(x, rngs)
        return jnp.mean(out), out != 0

    model, rngs = Plain(), nnx.Rngs(dropout=1)
    (_, masks), _ = nnx.jit(jaxaccum.nnx.value_and_grad(fn, num_microbatches=4, has_aux=True))(
        model, jnp.ones((8, 32)), rngs)
    assert int(rngs.dropout.count[...]) == 4
    assert not np.array_equal(masks[0], masks[1])


def hand_written_step(k):
    """The reference training step: k sequential micro-batch calls, grads averaged by hand."""

    @nnx.jit
    def step(model, optimizer, batch):
        grads = []
        for i in range(k):
            grads.append(nnx.grad(loss_fn)(model, jax.tree.map(lambda a, i=i: a[i::k], batch)))
        optimizer.update(model, jax.tree.map(lambda *g: sum(g) / k, *grads))

    return step


def accuracy(model, mnist, n=1000):
    model.eval()
    logits = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(mnist.test_images[:n]))
    model.train()
    return float(np.mean(np.argmax(logits, -1) == mnist.test_labels[:n]))


def test_nnx_training_equals_hand_written_microbatches(mnist):
    data = batches(mnist, 30)
    model, loss = readme_nnx_example(data)
    ref = CNN(nnx.Rngs(0))
    optimizer = nnx.Optimizer(ref, optax.adam(1e-3), wrt=nnx.Param)
    step = hand_written_step(4)
    for batch in data:
        step(ref, optimizer, batch)
    acc, ref_acc = accuracy(model, mnist), accuracy(ref, mnist)
    params_diff = max_rel_diff(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param))
    print(f"30 steps: accuracy jaxaccum.nnx {acc:.3f}, hand-written {ref_acc:.3f}; params rel "
          f"diff {params_diff:.2e}")
    # Adam's first updates are lr * sign(g) even where |g| is at rounding level, so the
    # parameters part at ~1e-3 relative after one step (SGD: 2e-8 after 1 step, 1e-7 after 30)
    assert abs(acc - ref_acc) <= 0.01
    assert acc > 0.3  # it learned (chance: 0.1)
    assert rng_count(model) == rng_count(ref) == 30 * 4


def test_readme_own_step_equals_train_step(mnist):
    batch = batches(mnist, 1)[0]
    models = [CNN(nnx.Rngs(0)) for _ in range(2)]
    optimizers = [nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param) for m in models]
    own = train_step(models[0], optimizers[0], batch)
    ours, _ = jaxaccum.nnx.train_step(loss_fn, num_microbatches=4)(models[1], optimizers[1],
                                                                   batch)
    assert float(own) == float(ours)
    assert max_rel_diff(arrays(models[0], optimizers[0]), arrays(models[1], optimizers[1])) == 0


def test_nnx_step_with_zero_total_weight_changes_nothing(mnist):
    def weighted_loss(model, batch):
        x, y, w = batch
        per = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
        return jnp.sum(per * w) / jnp.sum(w), jnp.sum(w)

    x, y = batches(mnist, 1, size=16)[0]
    model = CNN(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    step = jaxaccum.nnx.train_step(weighted_loss, num_microbatches=4, weighted=True)
    before = arrays(model, optimizer)
    loss, info = step(model, optimizer, (x, y, jnp.zeros(16)))
    assert float(loss) == 0.0 and float(info.weight) == 0.0
    assert max_rel_diff(arrays(model, optimizer), before) == 0.0
    step(model, optimizer, (x, y, jnp.ones(16)))
    assert int(optimizer.step[...]) == 1 and rng_count(model) == 4


def test_nnx_carried_state_mismatch_names_the_variable():
    def bad(model, batch):
        loss = loss_fn(model, batch)
        model.bn1.mean = nnx.BatchStat(model.bn1.mean[...].astype(jnp.bfloat16))
        return loss

    batch = (jnp.zeros((8, 784)), jnp.zeros(8, jnp.int32))
    fn = jaxaccum.nnx.value_and_grad(bad, num_microbatches=2)
    with refuses(TypeError, match=r"the module's state: leaf .*\['bn1'\]\['mean'\].* came "
                       r"in as float32\[8\] and came back as bfloat16\[8\]"):
        fn(CNN(nnx.Rngs(0)), batch)


def test_nnx_optimizer_with_multi_steps_counts_calls_in_step(mnist):
    x, y = batches(mnist, 1, size=32)[0]
    model = nnx.Linear(784, 10, rngs=nnx.Rngs(0))
    ref = nnx.clone(model)
    optimizer = nnx.Optimizer(model, jaxaccum.multi_steps(optax.sgd(0.1), every_k=4),
                              wrt=nnx.Param)

    @nnx.jit
    def micro_step(model, optimizer, batch, weight):
        grads = nnx.grad(loss_fn)(model, batch)
        optimizer.update(model, grads, weight=weight)  # passed on to tx.update

    @nnx.jit
    def ref_step(ref, micros, weights):  # by hand: the weighted mean of a window, SGD
        grads = [nnx.grad(loss_fn)(ref, micro) for micro in micros]
        mean = jax.tree.map(lambda *g: sum(w * gi for w, gi in zip(weights, g, strict=True))
                            / sum(weights), *grads)
        nnx.update(ref, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(ref, nnx.Param), mean))

    weights = [1.0, 2.0, 3.0, 4.0]
    for window in range(2):
        micros = [(x[window * 16 + 4 * i:][:4], y[window * 16 + 4 * i:][:4]) for i in range(4)]
        for micro, w in zip(micros, weights, strict=True):
            micro_step(model, optimizer, micro, w)
        ref_step(ref, micros, weights)
    assert int(optimizer.step[...]) == 8  # calls (micro-batches)
    assert int(optimizer.opt_state.gradient_step[...]) == 2  # optimizer steps
    assert_trees_close(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param), 1e-6)


# --- linen: the README's example (literally) ------------------------------------------------

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(32)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(10)(nn.relu(x))


class TrainState(train_state.TrainState):
    batch_stats: dict


mlp = MLP()


def linen_loss_fn(params, batch, batch_stats):  # batch_stats: carried through micro-batches
    x, y = batch
    logits, updates = mlp.apply({"params": params, "batch_stats": batch_stats}, x,
                                  train=True, mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, updates["batch_stats"]


def readme_linen_example(batch):
    variables = mlp.init(jax.random.key(0), jnp.ones((1, 784)), train=False)
    state = TrainState.create(apply_fn=mlp.apply, params=variables["params"],
                              batch_stats=variables["batch_stats"], tx=optax.sgd(0.1))
    step = jaxaccum.linen.train_step(linen_loss_fn, num_microbatches=4)
    state, loss, _ = step(state, batch)  # donates state; threads state.batch_stats if present
    return state, loss


def readme_linen_by_hand(state, batch):
    # Or by hand: jaxaccum.value_and_grad, then TrainState's own method.
    (loss, batch_stats), grads = jax.jit(jaxaccum.value_and_grad(
        linen_loss_fn, num_microbatches=4, carry_argnums=2
    ))(state.params, batch, state.batch_stats)
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    return state, loss, grads, batch_stats


def new_state(tx, dtype=jnp.float32):
    variables = mlp.init(jax.random.key(0), jnp.ones((1, 784)), train=False)
    variables = jax.tree.map(lambda v: v.astype(dtype), variables)
    return TrainState.create(apply_fn=mlp.apply, params=variables["params"],
                             batch_stats=variables["batch_stats"], tx=tx)


def eval_mode_loss(params, batch, batch_stats):
    x, y = batch
    logits = mlp.apply({"params": params, "batch_stats": batch_stats}, x, train=False)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), batch_stats


def test_linen_batch_stats_carried_equal_sequential_microbatches(mnist):
    k, batch = 4, batches(mnist, 1)[0]
    state = new_state(optax.sgd(0.1))  # what the README's example starts from
    by_hand, loss, grads, stats = readme_linen_by_hand(state, batch)
    # the reference: k sequential train-mode calls
    ref_stats, ref_grads = state.batch_stats, []
    plain = jax.jit(jax.value_and_grad(linen_loss_fn, has_aux=True))
    for i in range(k):
        micro = jax.tree.map(lambda a, i=i: a[i::k], batch)
        (_, ref_stats), g = plain(state.params, micro, ref_stats)
        ref_grads.append(g)
    ref_grads = jax.tree.map(lambda *g: sum(g) / k, *ref_grads)
    diff = max_rel_diff(stats, ref_stats)
    print(f"linen k={k}: batch_stats rel diff {diff:.2e}, grads rel diff "
          f"{max_rel_diff(grads, ref_grads):.2e}")
    assert diff <= 1e-6
    assert_trees_close(grads, ref_grads, 1e-6)
    assert max_rel_diff(stats, state.batch_stats) > 0  # they did move
    # the one-call step: the same state
    new, step_loss = readme_linen_example(batch)
    assert int(new.step) == 1
    assert_trees_close((new.params, new.batch_stats, step_loss),
                       (by_hand.params, by_hand.batch_stats, loss), 1e-6)


@jax.jit
def grad_fn(params, batch, batch_stats):
    return jax.grad(lambda p: eval_mode_loss(p, batch, batch_stats)[0])(params)


def linen_trajectory(data, k=None, dtype=jnp.float32):
    """10 steps in eval-mode BN: jaxaccum.linen.train_step with k micro-batches, or (k=None)
    the plain full-batch reference, jax.grad and TrainState.apply_gradients."""
    state = new_state(optax.sgd(0.1, momentum=0.9), dtype)
    if k is None:
        step = jax.jit(lambda state, batch: (state.apply_gradients(grads=grad_fn(
            state.params, batch, state.batch_stats)), None, None))
    else:
        step = jaxaccum.linen.train_step(eval_mode_loss, num_microbatches=k)
    for batch in data:
        state, _, _ = step(state, (batch[0].astype(dtype), batch[1]))
    return jax.tree.map(lambda x: np.asarray(x, np.float64), state.params)


def test_linen_eval_mode_trajectories_equal_for_k_1_and_8(mnist):
    data = batches(mnist, 10)
    full32 = linen_trajectory(data)
    with jax.enable_x64(True):
        ref64 = linen_trajectory(data, dtype=jnp.float64)
    for k in (1, 8):
        err, err_full = assert_within_rounding(linen_trajectory(data, k), full32, ref64)
        print(f"linen eval-mode BN, 10 SGD-momentum steps: k={k} error vs float64 {err:.2e}, "
              f"full batch (float32) error {err_full:.2e}")


def test_linen_multi_steps_state_step_counts_optimizer_steps(mnist):
    x, y = batches(mnist, 1, size=32)[0]
    for tx, weight in ((jaxaccum.multi_steps(optax.sgd(0.1), every_k=4), {"weight": 4.0}),
                       (optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4), {})):
        ours = jax.jit(functools.partial(jaxaccum.linen.apply_gradients, **weight))
        theirs = jax.jit(lambda state, grads: state.apply_gradients(grads=grads))
        state = plain = new_state(tx)
        for i in range(8):
            micro = (x[i * 4:(i + 1) * 4], y[i * 4:(i + 1) * 4])
            grads = grad_fn(state.params, micro, state.batch_stats)
            state, plain = ours(state, grads), theirs(plain, grads)
        assert int(state.step) == 2  # optimizer steps
        assert int(plain.step) == 8  # TrainState.apply_gradients counts micro-batches
        assert_trees_close(state.params, plain.params, 1e-6)
    with refuses(TypeError, match="weight"):  # TrainState cannot pass a weight to tx
        plain.apply_gradients(grads=grads, weight=4.0)


class Adapted(nnx.Module):
    """A frozen kernel and a low-rank adapter held in a Variable type of its own (LoRA-style):
    an optimizer with ``wrt=Adapter`` trains only the adapter."""

    def __init__(self):
        self.kernel = nnx.Param(jnp.ones((8, 4)) / 8)
        self.down = Adapter(jnp.ones((8, 2)) / 4)
        self.up = Adapter(jnp.ones((2, 4)) / 2)

    def __call__(self, x):
        return x @ self.kernel + (x @ self.down) @ self.up


class Adapter(nnx.Variable):
    pass


def test_nnx_step_trains_the_variables_the_optimizer_holds_even_if_not_params():
    x, y = random_batch(jax.random.key(1), 16, sizes=(8, 4))

    def loss_fn(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2)

    model = Adapted()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=Adapter)
    jaxaccum.nnx.train_step(loss_fn, num_microbatches=4)(model, optimizer, (x, y))
    ref = Adapted()
    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, Adapter))(ref, (x, y))
    np.testing.assert_array_equal(model.kernel[...], jnp.ones((8, 4)) / 8)  # frozen
    np.testing.assert_allclose(model.down[...], ref.down[...] - 0.1 * grads["down"][...],
                               rtol=1e-5)
    np.testing.assert_allclose(model.up[...], ref.up[...] - 0.1 * grads["up"][...], rtol=1e-5)


@pytest.mark.parametrize("front", ["value_and_grad", "train_step"])
def test_nnx_batch_after_another_argument(front):
    """``batch_argnums=2``: the batch is the loss's third argument, after one passed whole
    (a scale here); the scale is not split, the batch is, and the result is the full batch's."""
    x, y = random_batch(jax.random.key(1), 16, sizes=(8, 4))
    scale = jnp.asarray([0.5, 1.0, 2.0, 4.0])

    def loss_fn(model, scale, batch):
        x, y = batch
        return jnp.mean(((model(x) - y) * scale) ** 2)

    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    ref_loss, ref_grads = nnx.value_and_grad(loss_fn)(model, scale, (x, y))
    if front == "value_and_grad":
        loss, grads = jaxaccum.nnx.value_and_grad(loss_fn, num_microbatches=4,
                                                  batch_argnums=2)(model, scale, (x, y))
        assert_trees_close(nnx.state(grads), nnx.state(ref_grads), 1e-5)
    else:
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        want = jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param),
                            nnx.state(ref_grads))
        loss, _ = jaxaccum.nnx.train_step(loss_fn, num_microbatches=4, batch_argnums=2)(
            model, optimizer, scale, (x, y))
        assert_trees_close(nnx.state(model, nnx.Param), want, 1e-5)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
