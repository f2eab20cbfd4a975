"""The gradient noise scale (``noise_scale=True``): the estimators of McCandlish et al. 2018,
appendix A, from the micro-batch gradients, checked against their formulas, against the exact
covariance of linear least squares, and against per-example gradients on MNIST."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mlp_params, mse_loss, random_batch, refuses

import jaxaccum

D, SIGMA = 16, 1.0

# a value_and_grad reports the noise scale in the StepInfo it returns with return_info
NOISE = {"noise_scale": True, "return_info": True}


def least_squares(w, batch):
    x, y = batch
    return 0.5 * jnp.mean((x @ w - y) ** 2)


def least_squares_batch(key, n, w_star):
    kx, ke = jax.random.split(key)
    x = jax.random.normal(kx, (n, D))
    return x, x @ w_star + SIGMA * jax.random.normal(ke, (n,))


def test_estimates_are_the_papers_formulas_on_the_microbatch_gradients():
    """Computed by hand from k explicit micro-batch gradients (strided, as jaxaccum splits)."""
    params = mlp_params(jax.random.key(0))
    batch = random_batch(jax.random.key(1), 64)
    k = 8
    (_, grads, info) = jax.jit(jaxaccum.value_and_grad(mse_loss, num_microbatches=k,
                                                        **NOISE))(params, batch)
    noise = info.noise_scale
    sq = lambda t: sum(float(np.sum(np.asarray(x, np.float64) ** 2))  # noqa: E731
                       for x in jax.tree.leaves(t))
    small = [jax.grad(mse_loss)(params, jax.tree.map(lambda a, i=i: a[i::k], batch))
             for i in range(k)]
    g_small = np.mean([sq(g) for g in small])
    g_big = sq(grads)
    b, big = 64 / k, 64.0
    want_g = (big * g_big - b * g_small) / (big - b)
    want_s = (g_small - g_big) / (1 / b - 1 / big)
    # float32 gradients: each squared norm carries ~1e-6 relative error; the differences
    # above lose at most a factor g_small / (g_small - g_big) of that
    assert float(noise.gradient_sq) == pytest.approx(want_g, rel=1e-4)
    assert float(noise.trace) == pytest.approx(want_s, rel=1e-4)
    assert float(noise.small_batch) == b and float(noise.big_batch) == big
    assert float(noise.simple) == pytest.approx(want_s / want_g, rel=2e-4)


def test_least_squares_estimate_within_10_percent_of_the_exact_noise_scale():
    """x ~ N(0, I), y = x.w* + N(0, s^2): at w, with d = w - w*, the per-example gradient
    x (x.d - e) has mean d and covariance trace (D + 1)|d|^2 + D s^2 (Isserlis), so
    B_simple = ((D + 1)|d|^2 + D s^2) / |d|^2 exactly. Averaged over 50 steps (trace and
    |G|^2 averaged separately, as the paper does) the estimate is within 10%."""
    w_star = jax.random.normal(jax.random.key(2), (D,))
    delta = jax.random.normal(jax.random.key(3), (D,))
    delta = delta / jnp.linalg.norm(delta)  # |d| = 1
    w = w_star + delta
    trace = (D + 1) * 1.0 + D * SIGMA**2  # |d|^2 = 1
    fn = jax.jit(jaxaccum.value_and_grad(least_squares, num_microbatches=8, **NOISE))
    traces, norms = [], []
    for step in range(50):
        _, _, noise_info = fn(w, least_squares_batch(jax.random.key(100 + step), 512, w_star))
        noise = noise_info.noise_scale
        traces.append(float(noise.trace))
        norms.append(float(noise.gradient_sq))
    assert np.mean(norms) == pytest.approx(1.0, rel=0.1)  # |G|^2 = |d|^2 = 1
    assert np.mean(traces) == pytest.approx(trace, rel=0.1)
    assert np.mean(traces) / np.mean(norms) == pytest.approx(trace / 1.0, rel=0.1)


def test_weighted_microbatches_of_different_sizes_estimate_the_same_truth():
    """weighted=True with micro-batches holding 8 to 64 valid examples (padding masked): the
    generalised estimators (E|g_i|^2 = |G|^2 + tr/n_i) stay unbiased: within 10% of the exact
    least-squares values over 50 steps; and equal to the formulas on explicit gradients."""
    w_star = jax.random.normal(jax.random.key(2), (D,))
    delta = jax.random.normal(jax.random.key(3), (D,))
    w = w_star + delta / jnp.linalg.norm(delta)
    trace = (D + 1) + D * SIGMA**2
    k, m = 8, 64
    valid = (jnp.arange(m)[None, :] < jnp.asarray([8, 16, 24, 32, 40, 48, 56, 64])[:, None])
    valid = jnp.swapaxes(valid, 0, 1).reshape(-1)  # micro-batch i (strided) holds 8(i+1) valid

    def weighted_ls(w, batch):
        x, y, v = batch
        n = jnp.sum(v)
        return 0.5 * jnp.sum(jnp.where(v, (x @ w - y) ** 2, 0.0)) / jnp.maximum(n, 1), n

    fn = jax.jit(jaxaccum.value_and_grad(weighted_ls, num_microbatches=k, weighted=True,
                                         **NOISE))
    traces, norms = [], []
    for step in range(50):
        x, y = least_squares_batch(jax.random.key(300 + step), k * m, w_star)
        _, grads, noise_info = fn(w, (x, y, valid))
        noise = noise_info.noise_scale
        traces.append(float(noise.trace))
        norms.append(float(noise.gradient_sq))
    assert float(noise.big_batch) == 288.0 and float(noise.small_batch) == 36.0
    assert np.mean(norms) == pytest.approx(1.0, rel=0.1)
    assert np.mean(traces) == pytest.approx(trace, rel=0.1)
    # the formulas, on the last step's explicit micro-batch gradients
    micro = [(x[i::k], y[i::k], valid[i::k]) for i in range(k)]
    sizes = [float(jnp.sum(b[2])) for b in micro]
    sq = [float(jnp.sum(jax.grad(lambda w, b: weighted_ls(w, b)[0])(w, b) ** 2)) for b in micro]
    big = float(jnp.sum(grads**2))
    want_trace = (sum(n * g for n, g in zip(sizes, sq, strict=True)) - 288.0 * big) / (k - 1)
    assert float(noise.trace) == pytest.approx(want_trace, rel=1e-4)
    assert float(noise.gradient_sq) == pytest.approx(big - want_trace / 288.0, rel=1e-3)


def test_train_step_reports_the_noise_scale_and_refuses_what_it_cannot_measure():
    params = mlp_params(jax.random.key(4))
    batch = random_batch(jax.random.key(5), 32)
    step = jaxaccum.train_step(mse_loss, optax.sgd(0.1), num_microbatches=4, noise_scale=True,
                               donate=False)
    _, _, _, info = step(params, optax.sgd(0.1).init(params), batch)
    _, _, noise_info = jaxaccum.value_and_grad(mse_loss, num_microbatches=4, **NOISE)(
        params, batch)
    noise = noise_info.noise_scale
    assert float(info.noise_scale.trace) == pytest.approx(float(noise.trace), rel=1e-5)
    with refuses(ValueError, match="needs at least 2 micro-batches"):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=1, **NOISE)(params, batch)
    with refuses(TypeError, match="noise_scale must be a bool"):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=4, noise_scale=1)


def test_traced_count_noise_scale_counts_only_real_microbatches():
    w_star = jnp.zeros(D)
    w = jnp.ones(D) / 4
    x, y = least_squares_batch(jax.random.key(6), 6 * 32, w_star)
    stack = (x.reshape(6, 32, D), y.reshape(6, 32))
    fn = jax.jit(jaxaccum.value_and_grad(least_squares, max_microbatches=6, **NOISE))
    plain = jax.jit(jaxaccum.value_and_grad(least_squares, num_microbatches=4, **NOISE))
    _, _, got_info = fn(w, jaxaccum.Microbatches(stack, 4))
    got = got_info.noise_scale
    # the same 4 micro-batches, as jaxaccum's strided split of their concatenation sees them
    flat = jax.tree.map(lambda a: jnp.swapaxes(a[:4], 0, 1).reshape(-1, *a.shape[2:]), stack)
    _, _, want_info = plain(w, flat)
    want = want_info.noise_scale
    assert float(got.big_batch) == 128.0
    assert float(got.trace) == pytest.approx(float(want.trace), rel=1e-5)
    assert float(got.gradient_sq) == pytest.approx(float(want.gradient_sq), rel=1e-5)
    _, _, one_info = fn(w, jaxaccum.Microbatches(stack, 1))  # nothing to compare: NaN, not inf
    one = one_info.noise_scale
    assert np.isnan(float(one.trace)) and np.isnan(float(one.simple))


def test_mnist_mlp_estimate_within_20_percent_of_per_example_gradients(mnist):
    """The GistMLP on 4096 MNIST training images: the noise scale from per-example gradients
    (the covariance's trace and the unbiased |G|^2 of the whole pool) against jaxaccum's,
    averaged over 50 steps of 512 examples drawn from the same pool, k = 8."""

    from jaxaccum.experiment import models

    apply, params = models.functional(models.GistMLP())
    images = jnp.asarray(mnist.train_images[:4096])
    labels = jnp.asarray(mnist.train_labels[:4096])

    def loss(p, batch):
        return models.mse_one_hot(apply(p, batch[0]), batch[1])

    per_example = jax.jit(jax.vmap(jax.grad(lambda p, x, y: loss(p, (x[None], y[None]))),
                                   in_axes=(None, 0, 0)))
    total, total_sq = None, 0.0
    for i in range(0, 4096, 512):
        g = per_example(params, images[i:i + 512], labels[i:i + 512])
        s = jax.tree.map(lambda a: jnp.sum(a, axis=0), g)
        total = s if total is None else jax.tree.map(jnp.add, total, s)
        total_sq += sum(float(jnp.sum(jnp.square(a))) for a in jax.tree.leaves(g))
    n = 4096
    mean_sq = sum(float(jnp.sum(jnp.square(a / n))) for a in jax.tree.leaves(total))
    trace = (total_sq / n - mean_sq) * n / (n - 1)
    g_sq = mean_sq - trace / n
    truth = trace / g_sq

    fn = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=8, **NOISE))
    rng = np.random.default_rng(0)
    traces, norms = [], []
    for _ in range(50):
        idx = rng.choice(n, 512, replace=False)
        _, _, noise_info = fn(params, (images[idx], labels[idx]))
        noise = noise_info.noise_scale
        traces.append(float(noise.trace))
        norms.append(float(noise.gradient_sq))
    assert np.mean(traces) / np.mean(norms) == pytest.approx(truth, rel=0.2)


def test_noise_scale_refuses_explicit_axes_and_per_microbatch_fsdp():
    explicit = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    # refused when the function is built, before any call or trace
    with refuses(ValueError, match="value_and_grad: noise_scale=True is not available on a mesh"):
        jaxaccum.value_and_grad(mse_loss, num_microbatches=4, **NOISE, mesh=explicit)
    with refuses(ValueError, match="train_step: noise_scale=True is not available on a mesh"):
        jaxaccum.train_step(mse_loss, optax.sgd(0.1), num_microbatches=4, noise_scale=True,
                            mesh=explicit)
    auto = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    # the mode as a literal, and as a config file or a command line gives it (a str built at
    # run time, not the interned literal: an identity test would miss it)
    for mode in ("microbatch", "".join(["micro", "batch"])):
        fsdp = jaxaccum.DataParallel(auto, fsdp=mode)  # type: ignore[arg-type]
        with refuses(ValueError, match="fsdp='microbatch'.*use fsdp='step'"):
            jaxaccum.value_and_grad(mse_loss, num_microbatches=4, **NOISE, mesh=fsdp)


def test_nnx_steps_return_the_noise_scale():
    from flax import nnx

    import jaxaccum.nnx

    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    x, y = random_batch(jax.random.key(9), 32)

    def loss(m, b):
        return jnp.mean((m(b[0]) - b[1]) ** 2)

    _, _, noise = nnx.jit(jaxaccum.nnx.value_and_grad(loss, num_microbatches=4, **NOISE))(
        model, (x, y))
    opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    _, step_info = jaxaccum.nnx.train_step(loss, num_microbatches=4, noise_scale=True)(
        model, opt, (x, y))
    from_step, noise = step_info.noise_scale, noise.noise_scale
    assert float(from_step.trace) == pytest.approx(float(noise.trace), rel=1e-5)
    assert float(noise.big_batch) == 32.0 and float(noise.small_batch) == 8.0


def test_squared_norms_of_bfloat16_gradients_are_float32_sums():
    """The precision contract: every squared norm is summed in float32, whatever the
    gradient's dtype. 4115 bfloat16 values of magnitude 1 + 2**-7 (exact in bfloat16): the
    sum of their squares is within float32's worst-case rounding (n eps of the sum, about 2)
    of float64's; a sum returned in bfloat16 is rounded to a spacing of 32 past 4096 (here
    by 15.5)."""
    from jaxaccum import _noise

    value = 1 + 2.0**-7
    g = {"w": jnp.full((4112,), value, jnp.bfloat16), "b": jnp.full((3,), -value, jnp.bfloat16)}
    got = jax.jit(_noise.squared_norm)(g)
    exact = 4115 * value**2
    assert got.dtype == jnp.float32
    assert abs(float(got) - exact) <= 4115 * np.finfo(np.float32).eps * exact, (float(got), exact)
