"""A traced number of micro-batches (``max_microbatches`` + ``jaxaccum.Microbatches``): one
compiled program for every count, each equal to the full batch of the real micro-batches
within float32 rounding of a float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    assert_within_rounding,
    examples,
    full_and_reference,
    max_rel_diff,
    mlp_apply,
    mlp_params,
    mse_loss,
    refuses,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxaccum

K, M = 6, 8  # at most 6 micro-batches of 8 examples


def stack_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(K, M, 8)).astype(np.float32)
    y = rng.normal(size=(K, M, 4)).astype(np.float32)
    return x, y


def test_every_count_equals_the_full_batch_of_its_real_microbatches_in_one_program():
    params = mlp_params(jax.random.key(0))
    x, y = stack_data()
    fn = jax.jit(jaxaccum.value_and_grad(mse_loss, max_microbatches=K))
    for count in range(1, K + 1):
        padded = (x.copy(), y.copy())
        padded[0][count:] = 1e3  # padding that would show if it were evaluated
        got = fn(params, jaxaccum.Microbatches(padded, count))
        real = (x[:count].reshape(-1, 8), y[:count].reshape(-1, 4))
        assert_within_rounding(got, *full_and_reference(mse_loss, params, real))
    assert fn._cache_size() == 1


def test_weighted_counts_give_the_exact_mean_over_valid_items():
    """Micro-batches of different valid counts: the mean over the valid examples of the real
    micro-batches, not a mean of micro-batch means."""
    params = mlp_params(jax.random.key(1))
    x, y = stack_data(1)
    valid = np.arange(K * M).reshape(K, M) % 5 != 0
    valid[1, :6] = False  # micro-batch 1 holds only 2 valid examples

    def weighted(p, b):
        xb, yb, v = b
        per = jnp.mean((mlp_apply(p, xb) - yb) ** 2, axis=-1)
        n = jnp.sum(v)
        return jnp.sum(jnp.where(v, per, 0.0)) / jnp.maximum(n, 1), n

    def full(p, b):
        value, _ = weighted(p, b)
        return value

    fn = jax.jit(jaxaccum.value_and_grad(weighted, max_microbatches=K, weighted=True))
    for count in (2, 5):
        got = fn(params, jaxaccum.Microbatches((x, y, valid), count))
        real = (x[:count].reshape(-1, 8), y[:count].reshape(-1, 4), valid[:count].reshape(-1))
        assert_within_rounding(got, *full_and_reference(full, params, real))


def test_aux_comes_back_in_the_stack_layout():
    params = mlp_params(jax.random.key(2))
    x, y = stack_data(2)

    def loss(p, b):
        out = mlp_apply(p, b[0])
        return jnp.mean((out - b[1]) ** 2), {"out": out, "n": jnp.ones(())}

    fn = jax.jit(jaxaccum.value_and_grad(loss, max_microbatches=K,
                                         has_aux={"out": "concat", "n": "sum"}))
    (_, aux), _ = fn(params, jaxaccum.Microbatches((x, y), 4))
    assert aux["out"].shape == (K, M, 4) and float(aux["n"]) == 4.0
    np.testing.assert_allclose(aux["out"][:4], mlp_apply(params, x[:4]), rtol=1e-5, atol=1e-6)
    assert not np.any(aux["out"][4:])  # never evaluated


def test_train_step_one_program_and_no_update_at_count_zero():
    params = mlp_params(jax.random.key(3))
    x, y = stack_data(3)
    opt = optax.adam(1e-2)
    step = jaxaccum.train_step(mse_loss, opt, max_microbatches=K, donate=False)
    ref_step = jax.jit(lambda p, s, b: (lambda g: (optax.apply_updates(
        p, opt.update(g, s, p)[0]), opt.update(g, s, p)[1]))(jax.grad(mse_loss)(p, b)))
    p, s = params, opt.init(params)
    q, t = params, opt.init(params)
    for count in (3, 1, 6, 2, 5):
        p, s, _, info = step(p, s, jaxaccum.Microbatches((x, y), count))
        q, t = ref_step(q, t, (x[:count].reshape(-1, 8), y[:count].reshape(-1, 4)))
        assert int(info.num_microbatches) == count
    # 5 Adam steps: float32 rounding of one step is ~1e-7 relative, a wrong mean is > 1e-2
    assert max_rel_diff(p, q) < 1e-5
    assert step.num_programs == 1
    same, state, _, info = step(p, s, jaxaccum.Microbatches((x, y), 0))
    assert float(info.weight) == 0.0
    assert max_rel_diff(same, p) == 0.0 and int(state[0].count) == int(s[0].count)


def test_nnx_train_step_takes_a_runtime_count():
    from flax import nnx

    import jaxaccum.nnx

    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    ref = nnx.clone(model)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    x, y = stack_data(4)

    def loss(m, b):
        return jnp.mean((m(b[0]) - b[1]) ** 2)

    step = jaxaccum.nnx.train_step(loss, max_microbatches=K)

    @nnx.jit
    def ref_step(m, o, b):
        o.update(m, nnx.grad(loss)(m, b))

    for count in (2, 6, 3):
        step(model, opt, jaxaccum.Microbatches((x, y), count))
        ref_step(ref, ref_opt, (x[:count].reshape(-1, 8), y[:count].reshape(-1, 4)))
    assert max_rel_diff(model.kernel[...], ref.kernel[...]) < 1e-5


X10 = np.arange(10.0 * 3).reshape(10, 3)


def test_microbatches_helper_pads_the_last_short_batch():
    mb = jaxaccum.microbatches(X10, microbatch_size=2, max_microbatches=8)
    assert mb.data.shape == (8, 2, 3) and int(mb.count) == 5
    np.testing.assert_array_equal(mb.data[:5].reshape(10, 3), X10)


# one documented refusal per test (microbatches' Raises), so that each is checked on its own


def test_microbatches_refuses_more_microbatches_than_max():
    with refuses(ValueError, match="jaxaccum.microbatches: the batch holds 5 .* more than"):
        jaxaccum.microbatches(X10, microbatch_size=2, max_microbatches=4)


@pytest.mark.parametrize("m", [3, 0, -2])
def test_microbatches_refuses_a_size_that_does_not_divide_the_batch(m):
    with refuses(ValueError, match=f"microbatch_size={m} must divide the batch's 10"):
        jaxaccum.microbatches(X10, microbatch_size=m, max_microbatches=4)


@pytest.mark.parametrize("kw, kind, match", [
    (dict(microbatch_size=2.0, max_microbatches=4), TypeError, "microbatch_size must be an int"),
    (dict(microbatch_size=True, max_microbatches=4), TypeError, "microbatch_size must be an int"),
    (dict(microbatch_size=2, max_microbatches=0), ValueError, "max_microbatches must be >= 1"),
    (dict(microbatch_size=2, max_microbatches=1.5), TypeError, "max_microbatches must be a"),
    (dict(microbatch_size=2, max_microbatches=False), TypeError, "max_microbatches must be a"),
])
def test_microbatches_refuses_counts_that_are_not_positive_ints(kw, kind, match):
    """A bool or a float is no count (True is not 1 micro-batch example); the accepted side of
    each boundary: the same call with an int runs."""
    with refuses(kind, match=f"jaxaccum.microbatches: {match}"):
        jaxaccum.microbatches(X10, **kw)
    fixed = {name: 5 if name == "max_microbatches" else 2 for name in kw}
    assert jaxaccum.microbatches(X10, **fixed).count == 5


def test_microbatches_refuses_leaves_that_are_not_per_example():
    # every leaf is per example: leaves of different lengths (in either order) or a scalar
    # leaf are refused, whichever leaf comes first
    for bad in ((X10, X10[:8]), (X10[:8], X10), (X10, np.float32(1.0)), np.float32(1.0)):
        with refuses(ValueError, match=r"jaxaccum.microbatches: every leaf of batch must have "
                                       r"the same leading axis .* got leaves of shapes"):
            jaxaccum.microbatches(bad, microbatch_size=2, max_microbatches=8)


@settings(max_examples=examples(60), deadline=None)
@given(real=st.integers(0, 6), m=st.integers(1, 4), spare=st.integers(-2, 3),
       rest=st.integers(0, 3), tail=st.sampled_from([(), (3,), (2, 2)]),
       dtype=st.sampled_from([np.float32, np.int32, np.bool_]))
def test_microbatches_stacks_as_documented(real, m, spare, rest, tail, dtype):
    """``microbatches(batch, m, K)``: leaves ``(K, m, ...)``, the first ``n / m`` the batch's
    consecutive micro-batches, the rest zeros, ``count = n / m``; refused when ``m`` does not
    divide ``n`` or ``n / m > K``."""
    n = real * m + (rest % m)
    k = max(real + spare, 1)
    x = (np.arange(n * int(np.prod(tail))).reshape(n, *tail) % 5 + 1).astype(dtype)
    batch = {"x": x, "y": np.arange(1, n + 1, dtype=np.int32)}  # nonzero: padding shows
    if n % m:
        with refuses(ValueError, match=f"microbatch_size={m} must divide the batch's {n}"):
            jaxaccum.microbatches(batch, microbatch_size=m, max_microbatches=k)
        return
    if real > k:
        with refuses(ValueError, match=f"holds {real} micro-batches of {m}, more than "
                                       f"max_microbatches={k}"):
            jaxaccum.microbatches(batch, microbatch_size=m, max_microbatches=k)
        return
    mb = jaxaccum.microbatches(batch, microbatch_size=m, max_microbatches=k)
    assert np.shape(mb.count) == () and mb.count.dtype == np.int32 and int(mb.count) == real
    for name, leaf in batch.items():
        got = mb.data[name]
        assert got.shape == (k, m, *leaf.shape[1:]) and got.dtype == leaf.dtype
        np.testing.assert_array_equal(got[:real].reshape(leaf.shape), leaf)
        assert not np.any(got[real:])


def test_microbatches_of_an_empty_tree_count_none():
    mb = jaxaccum.microbatches((), microbatch_size=2, max_microbatches=3)
    assert mb.data == () and int(mb.count) == 0


def test_a_stack_of_no_arrays_is_refused_and_a_long_one_runs():
    """An empty ``Microbatches.data`` is refused with a clear error; K above CPython's small
    integers (300) is a stack like any other: the count's micro-batches, the rest never run."""
    fn = jaxaccum.value_and_grad(lambda w, b: jnp.sum(w), max_microbatches=4)
    with refuses(ValueError, match=r"Microbatches.data of argument 1 holds no arrays"):
        fn(jnp.ones(2), jaxaccum.Microbatches((), 2))
    k = 300
    x = np.arange(k * 2, dtype=np.float32).reshape(k, 1, 2)
    fn = jaxaccum.value_and_grad(lambda w, b: jnp.mean(b @ w), max_microbatches=k)
    value, grad = fn(jnp.ones(2), jaxaccum.Microbatches(x, 3))
    np.testing.assert_allclose(float(value), x[:3].sum() / 3, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), x[:3, 0].mean(0), rtol=1e-6)


def test_stacks_with_different_microbatch_sizes_are_refused():
    params = mlp_params(jax.random.key(5))
    x, y = stack_data()
    fn = jaxaccum.value_and_grad(mse_loss, max_microbatches=K)
    with refuses(ValueError, match=r"the same micro-batch size m \(axis 1\); argument 1 has "
                                   r"the sizes \[1, 8\]"):
        fn(params, jaxaccum.Microbatches((x, y[:, :1]), 2))


def test_bad_inputs_say_what_to_do():
    params = mlp_params(jax.random.key(5))
    x, y = stack_data()
    plain = jaxaccum.value_and_grad(mse_loss, num_microbatches=2)
    with refuses(TypeError, match="build the function with max_microbatches=K"):
        plain(params, jaxaccum.Microbatches((x, y), 2))
    fn = jaxaccum.value_and_grad(mse_loss, max_microbatches=K)
    with refuses(TypeError, match=r"must be a jaxaccum.Microbatches\(data, count\)"):
        fn(params, (x[0], y[0]))
    with refuses(ValueError, match=r"needs the shape \(K=6, m, \.\.\.\)"):
        fn(params, jaxaccum.Microbatches((x[:4], y[:4]), 2))
    with refuses(TypeError, match="Microbatches.count must be an integer scalar"):
        fn(params, jaxaccum.Microbatches((x, y), 2.0))
    with refuses(ValueError, match="exactly one of num_microbatches"):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=2, max_microbatches=K)


def test_python_numpy_and_jax_counts_share_one_program():
    params = mlp_params(jax.random.key(6))
    x, y = stack_data(6)
    opt = optax.sgd(0.1)
    step = jaxaccum.train_step(mse_loss, opt, max_microbatches=K, donate=False)
    state = opt.init(params)
    for count in (2, np.int64(3), jnp.int32(4), np.int32(1)):
        params, state, _, info = step(params, state, jaxaccum.Microbatches((x, y), count))
    assert step.num_programs == 1 and int(info.num_microbatches) == 1
