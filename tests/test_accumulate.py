"""jaxaccum.value_and_grad equals the full-batch jax.value_and_grad."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    assert_trees_close,
    examples,
    max_rel_diff,
    mlp_apply,
    mlp_params,
    mse_loss,
    random_batch,
    refuses,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxaccum

KEY = jax.random.key(0)
PARAMS = mlp_params(KEY)
BATCH = random_batch(jax.random.key(1), 64)


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16, 64])
def test_equals_full_batch(k):
    expected_loss, expected_grads = jax.jit(jax.value_and_grad(mse_loss))(PARAMS, BATCH)
    loss, grads = jax.jit(jaxaccum.value_and_grad(mse_loss, num_microbatches=k))(PARAMS, BATCH)
    assert_trees_close(loss, expected_loss, 1e-6)
    assert_trees_close(grads, expected_grads, 1e-6)
    assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda g: g.dtype, PARAMS)


@pytest.mark.parametrize("size", [1, 8, 64])
def test_microbatch_size_matches_num_microbatches(size):
    by_size = jax.jit(jaxaccum.value_and_grad(mse_loss, microbatch_size=size))(PARAMS, BATCH)
    by_count = jax.jit(jaxaccum.value_and_grad(mse_loss, num_microbatches=64 // size))(
        PARAMS, BATCH
    )
    assert max_rel_diff(by_size, by_count) == 0.0


def test_k1_emits_no_scan():
    fn = jaxaccum.value_and_grad(mse_loss, num_microbatches=1)
    assert "scan" not in str(jax.make_jaxpr(fn)(PARAMS, BATCH))
    assert "scan" in str(
        jax.make_jaxpr(jaxaccum.value_and_grad(mse_loss, num_microbatches=2))(PARAMS, BATCH)
    )


@pytest.mark.parametrize("k", [1, 4])
def test_has_aux_stacks_per_microbatch(k):
    def loss_with_aux(params, batch):
        pred = mlp_apply(params, batch[0])
        return jnp.mean((pred - batch[1]) ** 2), {"first": pred[0], "n": batch[0].shape[0]}

    (loss, aux), grads = jax.jit(
        jaxaccum.value_and_grad(loss_with_aux, num_microbatches=k, has_aux=True)
    )(PARAMS, BATCH)
    assert aux["first"].shape == (k, 4)
    np.testing.assert_array_equal(aux["n"], np.full(k, 64 // k))
    # Micro-batches are strided: micro-batch i holds examples i, i + k, ..., so its first
    # prediction is example i's.
    full_pred = mlp_apply(PARAMS, BATCH[0])
    np.testing.assert_allclose(aux["first"], full_pred[:k], rtol=1e-6, atol=1e-6)
    assert_trees_close(loss, mse_loss(PARAMS, BATCH), 1e-6)


def test_argnums_tuple_batch_argnums_and_rest():
    def loss(params, scale, x, offset, y):
        return jnp.mean((scale * mlp_apply(params, x) + offset - y) ** 2)

    scale = jnp.asarray(1.5)
    x, y = BATCH
    expected = jax.value_and_grad(loss, argnums=(0, 1))(PARAMS, scale, x, 0.25, y)
    got = jax.jit(
        jaxaccum.value_and_grad(loss, num_microbatches=8, argnums=(0, 1), batch_argnums=(2, 4))
    )(PARAMS, scale, x, 0.25, y)
    assert_trees_close(got, expected, 1e-6)


def masked_loss(params, batch):
    """(mean over valid examples, number of valid examples)."""
    x, y, mask = batch
    per_example = jnp.mean((mlp_apply(params, x) - y) ** 2, axis=-1)
    count = jnp.sum(mask)
    return jnp.sum(per_example * mask) / count, count  # 0/0 = NaN when count == 0


def uneven_mask():
    # 8 strided micro-batches of 8 (micro-batch i holds examples i, i + 8, ...): valid counts
    # 8, 1, 0, 5, 8, 2, 3, 7 (the third is empty).
    counts = np.array([8, 1, 0, 5, 8, 2, 3, 7])
    j = np.arange(64)
    return jnp.asarray((j // 8 < counts[j % 8]).astype(np.float32))


def test_weighted_uneven_equals_full_masked_mean():
    mask = uneven_mask()
    batch = (*BATCH, mask)
    expected = jax.value_and_grad(lambda p, b: masked_loss(p, b)[0])(PARAMS, batch)
    got = jax.jit(jaxaccum.value_and_grad(masked_loss, num_microbatches=8, weighted=True))(
        PARAMS, batch
    )
    assert np.isfinite(got[0])
    assert_trees_close(got, expected, 1e-6)


def test_mean_of_microbatch_means_is_wrong():
    """The bug fixed in Hugging Face's accumulation in 2024: averaging per-micro-batch means."""
    mask = uneven_mask()
    batch = (*BATCH, mask)
    expected_loss, expected = jax.value_and_grad(lambda p, b: masked_loss(p, b)[0])(PARAMS, batch)

    def per_microbatch_mean(p, b):
        x, y, mask = b
        per_example = jnp.mean((mlp_apply(p, x) - y) ** 2, axis=-1)
        return jnp.sum(per_example * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    naive_loss, naive = jaxaccum.value_and_grad(per_microbatch_mean, num_microbatches=8)(
        PARAMS, batch
    )
    assert max_rel_diff(naive, expected) > 0.05
    assert abs(float(naive_loss - expected_loss)) > 1e-3 * abs(float(expected_loss))


def test_weighted_all_zero_gives_zero_not_nan():
    batch = (*BATCH, jnp.zeros(64))
    loss, grads = jax.jit(jaxaccum.value_and_grad(masked_loss, num_microbatches=4, weighted=True))(
        PARAMS, batch
    )
    assert float(loss) == 0.0
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(grads))


def dropout_loss(params, batch):
    """Dropout (keep 0.8) on the hidden layer, the mask drawn per example from its own key."""
    x, y, keys = batch
    layer0, layer1 = params["layer0"], params["layer1"]
    h = jnp.tanh(x @ layer0["w"] + layer0["b"])
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.8, h.shape[1:]))(keys)
    h = jnp.where(keep, h / 0.8, 0.0)
    return jnp.mean((h @ layer1["w"] + layer1["b"] - y) ** 2)


def test_dropout_per_example_keys_independent_of_k():
    keys = jaxaccum.per_example_keys(jax.random.key(7), 64)
    batch = (*BATCH, keys)
    grads = [
        jax.jit(jaxaccum.value_and_grad(dropout_loss, num_microbatches=k))(PARAMS, batch)[1]
        for k in (1, 8)
    ]
    assert_trees_close(grads[1], grads[0], 1e-6)


def test_dropout_single_batch_key_depends_on_k():
    """One key per call: each micro-batch draws with the same key, so masks change with k."""

    def batch_key_loss(params, batch, key):
        x, y = batch
        keys = jax.random.split(key, x.shape[0])  # what a batch-level key does
        return dropout_loss(params, (x, y, keys))

    key = jax.random.key(7)
    grads = [
        jax.jit(jaxaccum.value_and_grad(batch_key_loss, num_microbatches=k))(PARAMS, BATCH, key)[1]
        for k in (1, 8)
    ]
    assert max_rel_diff(grads[1], grads[0]) > 1e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_dtype_follows_params_accumulator_float32(dtype):
    params = mlp_params(KEY, dtype=dtype)
    batch = jax.tree.map(lambda x: x.astype(dtype), BATCH)
    loss, grads = jax.jit(jaxaccum.value_and_grad(mse_loss, num_microbatches=8))(params, batch)
    assert loss.dtype == dtype
    assert all(g.dtype == dtype for g in jax.tree.leaves(grads))
    ref = jax.value_and_grad(mse_loss)(
        jax.tree.map(lambda p: p.astype(jnp.float32), params),
        jax.tree.map(lambda x: x.astype(jnp.float32), batch),
    )
    assert_trees_close(grads, ref[1], 1e-6 if dtype == jnp.float32 else 2e-2)


# --- bad input: one test each, messages name the argument and the values ---------------------


def test_k_not_dividing_batch():
    with refuses(ValueError, match=r"num_microbatches=3 does not divide the batch size 64"):
        jax.jit(jaxaccum.value_and_grad(mse_loss, num_microbatches=3))(PARAMS, BATCH)


def test_microbatch_size_not_dividing_batch():
    with refuses(ValueError, match=r"microbatch_size=5 does not divide the batch size 64"):
        jaxaccum.value_and_grad(mse_loss, microbatch_size=5)(PARAMS, BATCH)


@pytest.mark.parametrize("bad", [0, -2])
def test_k_below_one(bad):
    with refuses(
        ValueError, match=rf"num_microbatches must be >= 1; got num_microbatches={bad}"
    ):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=bad)


def test_k_not_int():
    with refuses(TypeError, match=r"num_microbatches must be a positive int; got 2.0"):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=2.0)


@pytest.mark.parametrize(("n", "m"), [(None, None), (2, 32)])
def test_both_or_neither_count(n, m):
    with refuses(ValueError, match=r"exactly one of num_microbatches and microbatch_size"):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=n, microbatch_size=m)


def test_leaves_with_different_batch_sizes():
    x, y = BATCH
    with refuses(
        ValueError, match=r"share one leading batch size; got .*\[0\]: 64, .*\[1\]: 32"
    ):
        jax.jit(jaxaccum.value_and_grad(mse_loss, num_microbatches=2))(PARAMS, (x, y[:32]))


def test_non_scalar_loss():
    def per_example(params, batch):
        return jnp.mean((mlp_apply(params, batch[0]) - batch[1]) ** 2, axis=-1)

    with refuses(
        ValueError, match=r"the loss returned by the loss function must be a scalar.*shape \(16,\)"
    ):
        jax.jit(jaxaccum.value_and_grad(per_example, num_microbatches=4))(PARAMS, BATCH)


def test_weighted_without_weight():
    with refuses(TypeError, match=r"loss function must return \(loss, weight\)"):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=2, weighted=True)(PARAMS, BATCH)


def test_argnums_overlapping_batch():
    with refuses(ValueError, match=r"argnums=1 and batch_argnums=1 overlap"):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=2, argnums=1)


def test_scalar_batch_leaf():
    with refuses(ValueError, match=r"argument 1\[1\] is a scalar"):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=2)(PARAMS, (BATCH[0], 1.0))


# --- property test -----------------------------------------------------------------------


@settings(max_examples=examples(25), deadline=None)
@given(
    data=st.data(),
    micro=st.integers(1, 6),
    k=st.sampled_from([1, 2, 3, 4, 6]),
    features=st.lists(st.integers(1, 5), min_size=1, max_size=3),
)
def test_property_weighted_equivalence(data, micro, k, features):
    batch_size = micro * k
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    weights = data.draw(
        st.lists(st.sampled_from([0.0, 1.0, 2.0, 0.5]), min_size=batch_size, max_size=batch_size)
    )
    params = {
        f"w{i}": jnp.asarray(rng.normal(size=(f,)), jnp.float32) for i, f in enumerate(features)
    }
    xs = {
        f"w{i}": jnp.asarray(rng.normal(size=(batch_size, f)), jnp.float32)
        for i, f in enumerate(features)
    }
    w = jnp.asarray(weights, jnp.float32)

    def per_example(p, x):
        return sum(jnp.sum(jnp.sin(x[n] * p[n]), axis=-1) ** 2 for n in p)

    def loss(p, batch):
        x, w = batch
        total = jnp.sum(w)
        return jnp.sum(per_example(p, x) * w) / jnp.maximum(total, 1e-30), total

    def full(p, batch):
        x, w = batch
        total = jnp.sum(w)
        return jnp.where(total > 0, jnp.sum(per_example(p, x) * w) / jnp.maximum(total, 1e-30), 0)

    expected = jax.value_and_grad(full)(params, (xs, w))
    got = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k, weighted=True))(params, (xs, w))
    assert_trees_close(got, expected, 1e-5)


# --- non-finite micro-batches and hostile inputs -----------------------------------------------


def skipped_count(loss, batch, **options):
    """How many micro-batches ``skip_nonfinite`` leaves out: ``train_step``'s ``info.skipped``
    (``value_and_grad`` returns what ``jax.value_and_grad`` returns, and no count)."""
    opt = optax.sgd(0.0)
    step = jaxaccum.train_step(loss, opt, skip_nonfinite=True, donate=False, **options)
    _, _, _, info = step(PARAMS, opt.init(PARAMS), batch)
    return int(info.skipped), int(info.num_microbatches)


def with_nan_in_microbatch(batch, index):
    """A NaN in example ``index``, which strided micro-batch ``index`` holds (index < k)."""
    x, y = batch
    return x.at[index].set(jnp.nan), y


@pytest.mark.parametrize("k", [4, 8])
def test_skip_nonfinite_equals_remaining_examples(k):
    bad = with_nan_in_microbatch(BATCH, 2)
    keep = np.flatnonzero(np.arange(64) % k != 2)
    expected = jax.value_and_grad(mse_loss)(PARAMS, jax.tree.map(lambda a: a[keep], BATCH))
    loss, grads = jax.jit(
        jaxaccum.value_and_grad(mse_loss, num_microbatches=k, skip_nonfinite=True)
    )(PARAMS, bad)
    assert skipped_count(mse_loss, bad, num_microbatches=k) == (1, k)
    assert_trees_close((loss, grads), expected, 1e-6)


def test_nan_propagates_without_skip():
    bad = with_nan_in_microbatch(BATCH, 2)
    loss, grads = jax.jit(jaxaccum.value_and_grad(mse_loss, num_microbatches=8))(PARAMS, bad)
    assert np.isnan(float(loss))
    assert all(bool(jnp.any(jnp.isnan(g))) for g in jax.tree.leaves(grads))


def test_skip_nonfinite_everything_gives_zero():
    x, y = BATCH
    loss, grads = jax.jit(
        jaxaccum.value_and_grad(mse_loss, num_microbatches=4, skip_nonfinite=True)
    )(PARAMS, (x * jnp.inf, y))
    assert float(loss) == 0.0
    assert skipped_count(mse_loss, (x * jnp.inf, y), num_microbatches=4) == (4, 4)
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(grads))


def test_integer_params_rejected():
    params = {"w": jnp.ones((8, 4), jnp.int32)}
    with refuses(TypeError, match=r"leaf \['w'\] has dtype int32; gradients need floating"):
        jaxaccum.value_and_grad(lambda p, b: jnp.mean(b[0] @ p["w"]), num_microbatches=2)(
            params, BATCH
        )


def test_none_leaves_pass_through():
    params = {"mlp": PARAMS, "frozen": None}
    fn = jax.jit(jaxaccum.value_and_grad(lambda p, b: mse_loss(p["mlp"], b), num_microbatches=4))
    _, grads = fn(params, BATCH)
    assert grads["frozen"] is None
    assert_trees_close(grads["mlp"], jax.grad(mse_loss)(PARAMS, BATCH), 1e-6)


def test_float16_params():
    params = jax.tree.map(lambda p: p.astype(jnp.float16), PARAMS)
    batch = jax.tree.map(lambda a: a.astype(jnp.float16), BATCH)
    _, grads = jax.jit(jaxaccum.value_and_grad(mse_loss, num_microbatches=8))(params, batch)
    assert all(g.dtype == jnp.float16 for g in jax.tree.leaves(grads))
    assert_trees_close(grads, jax.grad(mse_loss)(PARAMS, BATCH), 2e-2)


def test_k_equals_batch_size_4096_is_a_loop_not_unrolled():
    batch = random_batch(jax.random.key(5), 4096)
    texts = {
        k: jax.jit(jaxaccum.value_and_grad(mse_loss, num_microbatches=k))
        .lower(PARAMS, batch)
        .compile()
        .as_text()
        for k in (4, 4096)
    }
    assert "while" in texts[4096]
    assert len(texts[4096]) < 1.5 * len(texts[4])  # program size does not grow with k
    got = jax.jit(jaxaccum.value_and_grad(mse_loss, num_microbatches=4096))(PARAMS, batch)
    assert_trees_close(got, jax.value_and_grad(mse_loss)(PARAMS, batch), 1e-5)


def test_bfloat16_float32_accumulator_beats_bfloat16_accumulator():
    """bf16 params and gradients, k = 64: the float32 accumulator keeps the sum exact."""
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
    batch = jax.tree.map(lambda a: a.astype(jnp.bfloat16), random_batch(jax.random.key(9), 256))
    micro = [jax.tree.map(lambda a, i=i: a[i * 4 : (i + 1) * 4], batch) for i in range(64)]
    per_micro = [jax.grad(mse_loss)(params, m) for m in micro]
    reference = jax.tree.map(
        lambda *gs: np.mean([np.asarray(g, np.float64) for g in gs], axis=0), *per_micro
    )
    errors = {}
    for name, acc in (("float32", jnp.float32), ("bfloat16", None)):
        fn = jaxaccum.value_and_grad(mse_loss, num_microbatches=64, accumulator_dtype=acc)
        _, grads = jax.jit(fn)(params, batch)
        assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
        errors[name] = max_rel_diff(grads, reference)
    # float32: the final rounding to bfloat16 and ulp-level differences of the micro-batch
    # gradients (XLA fuses bf16 math differently in and out of the loop): under one bf16 ulp
    assert errors["float32"] <= 2**-8
    assert errors["bfloat16"] > 2.5 * errors["float32"]  # measured: 1.3e-2 vs 3.3e-3


def test_empty_batch():
    x, y = BATCH
    with refuses(ValueError, match=r"the batch is empty \(leading batch size 0\)"):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=1)(PARAMS, (x[:0], y[:0]))


def test_batch_without_leaves():
    with refuses(ValueError, match=r"batch_argnums=\(1,\): the batch arguments hold no"):
        jaxaccum.value_and_grad(lambda p, b: jnp.sum(p), num_microbatches=1)(jnp.ones(2), ())


# --- hardening: keyword arguments, weights, accumulator width ---------------------------


def test_keyword_arguments_are_passed_whole():
    def loss(params, batch, *, scale, offset=0.0):
        return scale * mse_loss(params, batch) + offset

    expected = jax.value_and_grad(loss)(PARAMS, BATCH, scale=2.0, offset=jnp.asarray(0.5))
    fn = jaxaccum.value_and_grad(loss, num_microbatches=4)
    got = jax.jit(fn)(PARAMS, BATCH, scale=2.0, offset=jnp.asarray(0.5))
    assert_trees_close(got, expected, 1e-6)


def test_zero_weight_nan_microbatch_is_not_counted_as_skipped():
    """An empty micro-batch (0/0 loss) contributes nothing; it is not a skipped one."""
    mask = uneven_mask()  # the third strided micro-batch is empty: its loss is 0/0
    loss, grads = jax.jit(
        jaxaccum.value_and_grad(masked_loss, num_microbatches=8, weighted=True, skip_nonfinite=True)
    )(PARAMS, (*BATCH, mask))
    assert skipped_count(masked_loss, (*BATCH, mask), num_microbatches=8, weighted=True)[0] == 0
    expected = jax.value_and_grad(lambda p, b: masked_loss(p, b)[0])(PARAMS, (*BATCH, mask))
    assert_trees_close((loss, grads), expected, 1e-6)


def signed_loss(params, batch):
    """A weighted loss whose weight is the batch's own (possibly negative) sum of ``w``."""
    x, y, w = batch
    per_example = jnp.mean((mlp_apply(params, x) - y) ** 2, axis=-1)
    return jnp.mean(per_example), jnp.sum(w)


def test_negative_weight_is_nan_not_silently_dropped():
    w = jnp.ones(64).at[3].set(-10.0)  # strided micro-batch 3 of 8 has weight -3
    fn = jaxaccum.value_and_grad(signed_loss, num_microbatches=8, weighted=True)
    loss, grads = jax.jit(fn)(PARAMS, (*BATCH, w))
    assert np.isnan(float(loss))
    assert all(bool(jnp.all(jnp.isnan(g))) for g in jax.tree.leaves(grads))


def test_negative_weight_is_skipped_and_counted_with_skip_nonfinite():
    w = jnp.ones(64).at[3].set(-10.0)
    fn = jaxaccum.value_and_grad(signed_loss, num_microbatches=8, weighted=True,
                                 skip_nonfinite=True)
    loss, grads = jax.jit(fn)(PARAMS, (*BATCH, w))
    assert skipped_count(signed_loss, (*BATCH, w), num_microbatches=8, weighted=True)[0] == 1
    keep = np.flatnonzero(np.arange(64) % 8 != 3)
    expected = jax.value_and_grad(mse_loss)(PARAMS, jax.tree.map(lambda a: a[keep], BATCH))
    assert_trees_close((loss, grads), expected, 1e-6)


def test_finite_loss_with_infinite_gradient_is_skipped():
    """Skipping must look at the gradient, not only the loss."""

    def loss(w, x):
        return 1e10 * jnp.mean(x * w)  # d/dw = 1e10 mean(x): inf when x ~ 3e38, loss ~ 3e18

    x = jnp.ones(16).at[jnp.arange(16) % 4 == 1].set(3e38)  # strided micro-batch 1
    w = jnp.asarray(1e-30)
    fn = jaxaccum.value_and_grad(loss, num_microbatches=4, skip_nonfinite=True)
    value, grad = jax.jit(fn)(w, x)
    assert np.isfinite(float(jax.jit(loss)(w, x[1::4])))  # that micro-batch's loss is finite
    opt = optax.sgd(0.0)
    step = jaxaccum.train_step(loss, opt, num_microbatches=4, skip_nonfinite=True)
    assert int(step(w, opt.init(w), x)[3].skipped) == 1
    assert float(grad) == pytest.approx(1e10, rel=1e-6) and np.isfinite(float(value))


def test_float64_leaves_accumulate_in_float64():
    """accumulator_dtype=float32 never narrows a float64 leaf: a 1e-10 term is not lost."""
    with jax.enable_x64(True):
        x = jnp.asarray([1.0, 1e-10, 1e-10, 1e-10], jnp.float64)
        w = jnp.asarray(0.5, jnp.float64)
        fn = jaxaccum.value_and_grad(lambda w, x: jnp.mean(w * x), num_microbatches=4)
        _, grad = jax.jit(fn)(w, x)
        assert grad.dtype == jnp.float64
        assert abs(float(grad) - (1.0 + 3e-10) / 4) < 1e-15


def test_weights_are_constants_for_the_gradient():
    """A weight that depends on the parameters (a soft count) is not differentiated."""

    def soft(params, batch):
        x, y = batch
        per = jnp.mean((mlp_apply(params, x) - y) ** 2, axis=-1)
        w = jnp.sum(jax.nn.sigmoid(x @ params["layer0"]["w"][:, 0]))
        return jnp.mean(per), w

    def reference(params):
        losses, weights = [], []
        for i in range(4):
            loss, w = soft(params, jax.tree.map(lambda a, i=i: a[i::4], BATCH))
            losses.append(loss)
            weights.append(jax.lax.stop_gradient(w))
        return sum(w * loss for w, loss in zip(weights, losses, strict=True)) / sum(weights)

    expected = jax.value_and_grad(reference)(PARAMS)
    got = jax.jit(jaxaccum.value_and_grad(soft, num_microbatches=4, weighted=True))(PARAMS, BATCH)
    assert_trees_close(got, expected, 1e-5)


def test_unroll_gives_the_same_result_and_is_checked():
    """Options.unroll: "default 1: a rolled loop" (unrolled micro-batches' activations live at
    once); any other value gives the same result; an int < 1 is refused."""
    default_fn = jaxaccum.value_and_grad(mse_loss, num_microbatches=8)
    assert re.search(r"\bscan\[.*unroll=1\b", str(jax.make_jaxpr(default_fn)(PARAMS, BATCH)),
                     re.S)
    rolled = jax.jit(default_fn)(PARAMS, BATCH)
    unrolled_fn = jaxaccum.value_and_grad(mse_loss, num_microbatches=8, unroll=4)
    assert_trees_close(jax.jit(unrolled_fn)(PARAMS, BATCH), rolled, 1e-6)
    assert "unroll=4" in str(jax.make_jaxpr(unrolled_fn)(PARAMS, BATCH))
    with refuses(TypeError, match="jaxaccum.value_and_grad: unroll must be"):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=8, unroll=0)


@pytest.mark.parametrize("option", ["has_aux", "weighted", "skip_nonfinite"])
@pytest.mark.parametrize("value", [False, True])
def test_a_numpy_bool_option_is_the_python_bool(option, value):
    """The boolean options take NumPy's bools (as the validation accepts them) with the same
    meaning as Python's."""
    def loss(params, batch):
        value_ = mse_loss(params, batch)
        weight = jnp.float32(batch[0].shape[0])
        out = (value_, weight) if option == "weighted" and value else value_
        return (out, {"x": batch[0][:, 0]}) if option == "has_aux" and value else out

    def run(v):
        return jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=2, **{option: v}))(
            PARAMS, BATCH)

    assert_trees_close(run(np.bool_(value)), run(value), 0.0)


@pytest.mark.parametrize("bad", ["not a dtype", object()])
def test_accumulator_dtype_that_is_no_dtype_is_refused_at_construction(bad):
    """Options.accumulator_dtype: a dtype or None; anything else is refused when the entry
    point is made, naming it."""
    with refuses(TypeError, match=r"^jaxaccum\.value_and_grad: accumulator_dtype must be a "
                 r"dtype or None"):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=2, accumulator_dtype=bad)


def test_a_pair_returned_without_has_aux_names_the_option():
    def with_aux(params, batch):
        return mse_loss(params, batch), batch[0]

    fn = jaxaccum.value_and_grad(with_aux, num_microbatches=2)
    with refuses(TypeError, match="a pair means .* pass has_aux=True .* weighted=True"):
        fn(PARAMS, BATCH)


def test_outer_gradient_of_the_loss_treats_weights_as_constants():
    """The returned value and gradient agree: differentiating the accumulated loss (as a
    hypergradient or a check would) gives the returned gradient, weights held constant, even
    when the weight depends on the parameters (a soft count)."""

    def soft(params, batch):
        x, y = batch
        w = jnp.sum(jax.nn.sigmoid(x @ params["layer0"]["w"][:, 0]))
        return jnp.mean((mlp_apply(params, x) - y) ** 2), w

    fn = jaxaccum.value_and_grad(soft, num_microbatches=4, weighted=True)
    _, grads = jax.jit(fn)(PARAMS, BATCH)
    outer = jax.jit(jax.grad(lambda p: fn(p, BATCH)[0]))(PARAMS)
    for a, b in zip(jax.tree.leaves(outer), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_keyword_arguments_with_defaults_reach_every_microbatch():
    """A keyword with a default (a loss scale) is passed to every micro-batch, not dropped
    (which would silently use the default)."""

    def loss(params, batch, scale=1.0):
        x, y = batch
        return scale * jnp.mean((mlp_apply(params, x) - y) ** 2)

    expected = jax.value_and_grad(loss)(PARAMS, BATCH, scale=3.0)
    value, grads = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=4))(
        PARAMS, BATCH, scale=3.0)
    assert float(value) == pytest.approx(float(expected[0]), rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
