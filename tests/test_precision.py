"""The precision contract (docs/guides/precision.md) in bfloat16, for every entry point that
computes.

``tests/conftest.py`` turns XLA's excess precision off, so bfloat16 is rounded at every op as
on GPUs and TPUs. Each test runs the entry point on bfloat16 parameters and inputs and checks
it against a **float64 model of the accumulation**: every micro-batch's loss, gradient and aux
computed by plain JAX on that micro-batch alone in bfloat16 (what the loss function gives on it:
its own bfloat16 error, whatever it is), then combined in float64 by the documented rules
(weights, zero-weight micro-batches, ``skip_nonfinite``, aux reductions, the noise scale). The
bounds are derived, not tuned: what is left between the entry point and that model is the
accumulation's own arithmetic, float32 sums (``gamma = n eps32`` times the magnitude of the
summed terms, ``n`` the additions and products on the way) and one final rounding of the
result to bfloat16 (a half ulp: ``2^-8 |x|``). A sum kept in bfloat16, a weight or count in
bfloat16, a micro-batch value rounded before it is weighted, each adds an error of ``2^-8``
times the terms, far above the float32 part; the deterministic tests below make such a slip
grow with the number of micro-batches (a bfloat16 sum of 512 ones is 256).

The page's table of measured errors comes from ``benchmarks/results/precision.json``
(``benchmarks/precision.py``); :func:`test_precision_page_matches_the_json` keeps them equal.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from conftest import examples
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reference import (
    EPS16,
    EPS32,
    FRONT_ENDS,
    LEAF_NAMES,
    STEPS,
    Scenario,
    _expected_aux,
    assert_close,
    combine,
)
from reference import loss_fn as reference_loss
from reference import run as run_front_end

import jaxaccum
import jaxaccum.packing

BF16 = np.dtype(ml_dtypes.bfloat16)
ROOT = pathlib.Path(__file__).resolve().parents[1]
D = 3


def _f64(x: Any) -> np.ndarray:
    return np.asarray(np.asarray(x).astype(np.float64))


# --- the float64 model of the accumulation of plain-JAX bfloat16 micro-batches ---------------


@functools.cache
def _plain(weighted: bool, leaves: tuple[str, ...] | None) -> Any:
    """Plain ``jax.value_and_grad`` of the scenario's loss on one micro-batch, jitted once per
    loss (jitted code rounds bfloat16 as eager code does: excess precision is off)."""
    loss = reference_loss(weighted, leaves)

    def fun(w: Any, batch: Any) -> Any:
        out = loss(w, batch)
        value, aux = out if leaves is not None else (out, None)
        value, weight = value if weighted else (value, jnp.ones((), jnp.float32))
        return value, (weight, aux)

    return jax.jit(jax.value_and_grad(fun, has_aux=True))


def _microbatch_rows(s: Scenario) -> list[dict[str, Any]]:
    """Every evaluated micro-batch as plain JAX computes it alone, in the scenario's dtype."""
    leaves = None if s.aux is None else tuple(s.aux)
    x, y, m = s.x.astype(s.dtype), s.y.astype(s.dtype), s.m
    w = jnp.asarray(s.w.astype(s.dtype))
    rows = []
    for idx in s.microbatch_indices():
        (value, (weight, aux)), grad = _plain(s.weighted, leaves)(w, (x[idx], y[idx], m[idx]))
        loss, g, wt = _f64(value), _f64(grad), float(weight)
        finite = bool(np.isfinite(loss) and np.all(np.isfinite(g)))
        aux = {} if aux is None else {k: _f64(v) for k, v in aux.items()}
        rows.append(dict(wt=wt, loss=float(loss), grad=g, finite=finite, aux=aux, idx=idx,
                         n=len(idx), loss_dtype=np.dtype(value.dtype)))
    return rows


def _loss_dtype(s: Scenario) -> np.dtype:
    """The dtype the scenario's loss function returns its value in (as jax would make it)."""
    size = s.x.shape[0] // s.k
    x, y, m = s.x[:size].astype(s.dtype), s.y[:size].astype(s.dtype), s.m[:size]
    out = jax.eval_shape(_plain(s.weighted, None), jnp.asarray(s.w.astype(s.dtype)), (x, y, m))
    return np.dtype(out[0][0].dtype)


def _model(s: Scenario) -> dict[str, Any]:
    """The documented combination of the plain micro-batch results, in float64, with the
    float32 bounds of the accumulation's own arithmetic (absolute, per element)."""
    rows = _microbatch_rows(s)
    # the bf16 micro-batch results are the terms: their own size is the bounds' scale
    c = combine(s, rows, D, lambda row: (abs(row["loss"]), np.abs(row["grad"])))
    skipped, kept, total, loss, grads = c["skipped"], c["kept"], c["total"], c["loss"], c["grads"]
    loss_mag, grad_mag = c["loss_mag"], c["grad_mag"]
    # float32 arithmetic of the accumulation: per element one product w_i * g_i and k sums
    # (the weight's own k sums), then 1/total and one multiply: at most k + 4 roundings of
    # eps32 each, relative to the sum of |terms| / total (doubled: first-order bounds)
    scale = 1.0 / total if total and np.isfinite(total) else 0.0
    gamma = 2 * (s.k + 4) * EPS32
    loss_f32 = gamma * loss_mag * scale + 1e-30
    grads_f32 = gamma * grad_mag * scale + 1e-30
    # the one final rounding to a 16-bit dtype: a half ulp, 2^-8 of the (float32) value
    loss_dtype = _loss_dtype(s)
    final_loss = EPS16 * (abs(loss) + loss_f32) if loss_dtype == BF16 else 0.0
    final_grads = EPS16 * (np.abs(grads) + grads_f32) if np.dtype(s.dtype) == BF16 else 0.0
    return dict(rows=rows, kept=kept, skipped=skipped, total=total, loss=loss, grads=grads,
                loss_bound=loss_f32 + final_loss, grads_bound=grads_f32 + final_grads,
                loss_dtype=loss_dtype, grad_sq_mag=grad_mag, scale=scale)


def _aux_dtype(leaf: str, name: str, dtype: Any) -> np.dtype:
    """The documented dtype of an aux leaf after its reduction (precision.md's table)."""
    own = np.dtype(np.int32) if leaf == "pos" else np.dtype(BF16 if leaf == "half" else dtype)
    if name in ("mean", "weighted_mean"):
        return np.dtype(np.float32)  # a mean of any leaf (integers too) is float32
    if name == "sum" and leaf != "pos":
        return np.promote_types(own, np.float32)  # float sums in at least float32
    return own  # stack, concat, max, min, last: the leaf's own values; integer sums too


def _verify(front: str, s: Scenario, got: dict[str, Any]) -> None:
    want = _model(s)
    info = got["info"]
    # StepInfo's fixed dtypes, whatever the parameters' dtype
    assert info.skipped.dtype == jnp.int32 and info.num_microbatches.dtype == jnp.int32
    assert info.weight.dtype == jnp.float32
    assert int(info.skipped) == want["skipped"]
    assert int(info.num_microbatches) == len(want["rows"])
    # the weight is a float32 sum of float32 counts: exact for these small integers
    assert_close("info.weight", info.weight, want["total"], 0.0)
    value = got["value"]
    loss, aux = (value, info.aux) if front in STEPS else (
        value if s.aux is not None else (value, None))
    # the loss comes back in the loss function's dtype (statistics_first's loss, scaled by a
    # float32 total, is float32), its float32 mean rounded once
    loss_dtype = np.dtype(np.float32) if front == "statistics_first" else want["loss_dtype"]
    assert np.dtype(loss.dtype) == loss_dtype, (loss.dtype, loss_dtype)
    loss_bound = want["loss_bound"] if loss_dtype == want["loss_dtype"] else (
        want["loss_bound"] - EPS16 * abs(want["loss"]) if want["loss_dtype"] == BF16 else
        want["loss_bound"])
    assert_close("loss", loss, want["loss"], loss_bound)
    if "grads" in got:  # in the parameters' dtype
        assert np.dtype(got["grads"].dtype) == np.dtype(s.dtype)
        assert_close("grads", got["grads"], want["grads"], want["grads_bound"])
    if "params" in got:  # SGD(1): round(w - grads) in the parameters' dtype, or w unchanged
        params = got["params"]
        assert np.dtype(params.dtype) == np.dtype(s.dtype)
        w = _f64(s.w.astype(s.dtype))
        if want["total"] != 0:
            after = w - want["grads"]
            # the step's bf16 gradient (grads_bound), then one rounding of w - g (a half ulp)
            bound = want["grads_bound"] + EPS16 * (np.abs(after) + want["grads_bound"])
            assert_close("params", params, after, bound)
        else:
            assert_close("params", params, w, 0.0)
    if s.aux is None:
        assert aux is None
    else:
        _verify_aux(s, aux, want)
    if s.noise_scale:
        _verify_noise(s, info.noise_scale, want)
    else:
        assert info.noise_scale is None


def _verify_aux(s: Scenario, aux: Any, want: dict[str, Any]) -> None:
    assert s.aux is not None and set(aux) == set(s.aux)
    values, _ = _expected_aux(s, want["rows"], want["kept"])
    for leaf, name in s.aux.items():
        got = aux[leaf]
        dtype = _aux_dtype(leaf, name, s.dtype)
        assert np.dtype(got.dtype) == dtype, f"aux {leaf!r} ({name}): {got.dtype}, not {dtype}"
        if name in ("sum", "mean", "weighted_mean"):
            # a float32 sum of k values (k weighted products) and one division: (2k + 4)
            # roundings of eps32 relative to the largest |value| (and its weight)
            terms = [np.max(np.abs(r["aux"][leaf])) * max(1.0, abs(r["wt"]))
                     for r in want["kept"]] or [0.0]
            bound = 2 * (2 * s.k + 4) * EPS32 * float(np.nansum(terms)) + 1e-30
        else:  # the micro-batches' own values, moved, not computed: exact
            bound = 0.0
        assert_close(f"aux {leaf!r} ({name})", got, values[leaf], bound)


def _verify_noise(s: Scenario, noise: Any, want: dict[str, Any]) -> None:
    """The noise scale from the same micro-batch gradients, in float64, with the bounds of
    its float32 sums and of ``|G|^2`` taken from the step's mean gradient (float32; the bound
    of the gradient in the parameters' dtype covers it)."""
    assert isinstance(noise, jaxaccum.NoiseScale)
    for field in noise:
        assert field.dtype == jnp.float32
    sq, big, samples = np.float64(0), np.float64(0), 0  # NumPy floats: x / 0 is inf or NaN
    for r in want["kept"]:
        n = r["wt"] if s.weighted else float(r["n"])
        if not n > 0:
            if s.weighted and r["wt"] != 0:
                sq = big = np.nan
            continue
        sq += n * float(np.sum(r["grad"] ** 2))
        big += n
        samples += 1
    g2 = np.float64(np.sum(want["grads"] ** 2))
    with np.errstate(all="ignore"):
        trace = (sq - big * g2) / (samples - 1.0) if samples > 1 else np.nan
        gradient_sq = g2 - trace / big
        small = big / samples
    assert_close("noise big_batch", noise.big_batch, big, 0.0)
    assert_close("noise small_batch", noise.small_batch, small, EPS32 * abs(small))
    # |G|^2 of the mean gradient: each element within grads_bound of G, so |G|^2 within
    # 2 |G| . bound + |bound|^2; the float32 sum of n_i |g_i|^2 within gamma of its size
    gb = want["grads_bound"]
    d_g2 = float(2 * np.sum(np.abs(want["grads"]) * gb) + np.sum(gb**2))
    d_g2 += 2 * (D + 2) * EPS32 * g2
    d_sq = 2 * (D + s.k + 4) * EPS32 * sq
    with np.errstate(all="ignore"):
        d_trace = (d_sq + big * d_g2) / (samples - 1.0) if samples > 1 else 0.0
        d_trace += 4 * EPS32 * abs(trace)
        d_gsq = d_g2 + d_trace / big + 4 * EPS32 * abs(gradient_sq)
    assert_close("noise trace", noise.trace, trace, d_trace + 1e-30)
    assert_close("noise gradient_sq", noise.gradient_sq, gradient_sq, d_gsq + 1e-30)


# --- scenarios --------------------------------------------------------------------------------

@st.composite
def bf16_scenarios(draw: Any) -> tuple[str, Scenario]:
    """A front end and a bfloat16 scenario: k (1 included), weights with zero-weight
    micro-batches (every one of them, too), a NaN example, a runtime count, every option."""
    front = draw(st.sampled_from(FRONT_ENDS))
    k = draw(st.integers(1, 5))
    size = draw(st.integers(1, 3))
    runtime = draw(st.booleans())
    count = draw(st.integers(0, k)) if runtime else None
    b = k * size
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.normal(size=(b, D)).astype(np.float32)
    y = (rng.normal(size=(b,)) * draw(st.sampled_from([1.0, 8.0]))).astype(np.float32)
    w = (rng.normal(size=(D,)) / 2).astype(np.float32)
    m = rng.choice(np.array([0.0, 1.0, 1.0, 2.0, 3.0, 7.0], np.float32), size=b)
    weighted = draw(st.booleans())
    micro = [np.arange(i, b, k) if count is None else np.arange(i * size, (i + 1) * size)
             for i in range(k)]
    special = draw(st.sampled_from(["none", "zero", "zero", "all_zero", "nan_example"]))
    where = micro[draw(st.integers(0, k - 1))]
    if special == "zero":
        m[where] = 0.0
    elif special == "all_zero":
        m[:] = 0.0
    elif special == "nan_example":
        x[where[0], 0] = np.nan
    aux = None
    if draw(st.booleans()):
        aux = {leaf: draw(st.sampled_from(names)) for leaf, names in LEAF_NAMES.items()}
    noise = draw(st.booleans()) and (runtime or k >= 2)
    return front, Scenario(x, y, m, w, k, count, weighted, draw(st.booleans()), aux, noise,
                           dtype=BF16)


def _fixed(k: int, size: int, seed: int = 3, **kw: Any) -> Scenario:
    rng = np.random.default_rng(seed)
    b = k * size
    return Scenario(rng.normal(size=(b, D)).astype(np.float32),
                    rng.normal(size=(b,)).astype(np.float32),
                    rng.choice(np.array([1.0, 2.0, 3.0], np.float32), size=b),
                    (rng.normal(size=(D,)) / 2).astype(np.float32), k, dtype=BF16, **kw)


def _empty(s: Scenario, microbatch: int) -> Scenario:
    m = s.m.copy()
    m[microbatch::s.k] = 0.0
    return Scenario(**{**s.__dict__, "m": m})


ALL_AUX = {"res": "concat", "avg": "mean", "pos": "sum", "half": "weighted_mean"}


@settings(max_examples=examples(16), deadline=None, report_multiple_bugs=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(case=("value_and_grad", _fixed(1, 4, noise_scale=False, aux=ALL_AUX)))
@example(case=("train_step", _empty(_fixed(4, 2, weighted=True, aux=ALL_AUX,
                                           noise_scale=True), 2)))
@example(case=("nnx.value_and_grad", _fixed(3, 2, weighted=True, skip_nonfinite=True,
                                            aux={"avg": "sum", "half": "max"})))
@given(case=bf16_scenarios())
def test_bfloat16_front_ends_match_the_float64_model(case):
    """Every front end in bfloat16: loss, gradients, parameters after SGD(1), aux, StepInfo
    and noise scale within the accumulation's float32 arithmetic and one final rounding of
    the float64 combination of plain JAX's bfloat16 micro-batches; every dtype as
    documented."""
    front, s = case
    _verify(front, s, run_front_end(front, s))


# --- sums over many micro-batches stay float32 ------------------------------------------------

K_MANY = 512  # past 256 a bfloat16 sum of ones stops growing (its ulp at 256 is 2)


def _many() -> tuple[Any, Any, float, float]:
    """512 single-example micro-batches whose bfloat16 gradients (1 and 1.5), squared
    residuals (0.25, 0.5625) and weights (1, 3) are exact, and whose float32 sums are too: an
    exact float32 accumulation gives exactly 1.25 (and 13/32); a bfloat16 one cannot."""
    x = jnp.ones((K_MANY, 1), jnp.bfloat16)
    y = jnp.asarray(np.tile([-0.5, -0.75], K_MANY // 2), jnp.bfloat16)
    return x, y, 1.25, 0.40625


def _sq_loss(w, batch):
    x, y = batch[:2]
    return jnp.mean((x @ w - y) ** 2)


def test_many_microbatches_sum_in_float32():
    x, y, grad, loss = _many()
    w = jnp.zeros((1,), jnp.bfloat16)
    fn = jax.jit(jaxaccum.value_and_grad(_sq_loss, num_microbatches=K_MANY, return_info=True,
                                         noise_scale=True))
    value, g, info = fn(w, (x, y))
    assert value.dtype == jnp.bfloat16 and g.dtype == jnp.bfloat16
    assert float(value) == loss and float(g[0]) == grad  # exact: see _many
    assert info.weight.dtype == jnp.float32 and float(info.weight) == K_MANY
    assert float(info.noise_scale.big_batch) == K_MANY
    # sum n_i |g_i|^2 = 256 (1 + 2.25) exactly, |G|^2 = 1.5625: trace = (832 - 800) / 511
    assert float(info.noise_scale.trace) == pytest.approx(32 / 511, rel=8 * EPS32)


def test_many_weighted_microbatches_sum_in_float32():
    """Weighted: each micro-batch's float32 mean times its weight, summed in float32."""
    x, y, _, _ = _many()
    m = jnp.asarray(np.tile([1.0, 3.0], K_MANY // 2), jnp.float32)

    def loss(w, batch):
        x, y, m = batch
        # + 1/3: a float32 value no bfloat16 holds, whose gradient is the exact bf16 one
        sq = ((x @ w - y) ** 2).astype(jnp.float32) + jnp.float32(1 / 3)
        return jnp.sum(m * sq) / jnp.sum(m), jnp.sum(m)

    w = jnp.zeros((1,), jnp.bfloat16)
    step = jaxaccum.train_step(loss, optax.sgd(1.0), num_microbatches=K_MANY, weighted=True)
    params, _, value, info = step(w, optax.sgd(1.0).init(w), (x, y, m))
    # sum w_i g_i / sum w_i = (1 * 1 + 3 * 1.5) / 4 = 1.375, exact in bf16
    assert params.dtype == jnp.bfloat16 and float(params[0]) == -1.375
    assert float(info.weight) == 2 * K_MANY
    # (0.25 + 3 * 0.5625) / 4 + 1/3, a float32 mean: float32 rounding, not bfloat16's
    want = (0.25 + 3 * 0.5625) / 4 + 1 / 3
    assert value.dtype == jnp.float32
    assert abs(float(value) - want) <= 2 * (K_MANY + 4) * EPS32 * want


def test_weight_times_gradient_in_float32():
    """Each micro-batch's gradient times its weight is formed in float32: bf16 gradients 1 and
    1.3828125 (exact) with weights 3 and 5 average to 1.2421875 once rounded; rounding 5 *
    1.3828125 to bfloat16 first gives 1.234375 (found by search over such pairs)."""
    x = jnp.ones((2, 1), jnp.bfloat16)
    y = jnp.asarray([-0.5, -0.69140625], jnp.bfloat16)  # gradients 2 (0 - y): 1, 1.3828125
    m = jnp.asarray([3.0, 5.0], jnp.float32)

    def loss(w, batch):
        x, y, m = batch
        return jnp.sum(m * (x @ w - y) ** 2) / jnp.sum(m), jnp.sum(m)

    w = jnp.zeros((1,), jnp.bfloat16)
    _, g = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=2, weighted=True))(
        w, (x, y, m))
    assert g.dtype == jnp.bfloat16 and float(g[0]) == 1.2421875
    opt = jaxaccum.multi_steps(optax.sgd(1.0), every_k=2)
    state = opt.init(w)
    for gi, mi in zip(jnp.asarray([[1.0], [1.3828125]], jnp.bfloat16), m, strict=True):
        u, state = opt.update(gi, state, w, weight=mi)
    assert u.dtype == jnp.bfloat16 and float(u[0]) == -1.2421875


def test_multi_steps_sums_in_float32():
    """512 calls of multi_steps: a float32 acc_grads and acc_weight, whatever the leaves."""
    x, y, grad, _ = _many()
    opt = jaxaccum.multi_steps(optax.sgd(1.0), every_k=K_MANY)
    w = jnp.zeros((1,), jnp.bfloat16)
    state = opt.init(w)
    assert state.acc_grads.dtype == jnp.float32 and state.acc_weight.dtype == jnp.float32
    grads = jax.vmap(lambda xi, yi: jax.grad(_sq_loss)(w, (xi[None], yi[None])))(x, y)
    m = jnp.asarray(np.tile([1.0, 3.0], K_MANY // 2), jnp.float32)

    def body(state, gw):
        u, state = opt.update(gw[0], state, w, weight=gw[1])
        return state, u

    state, updates = jax.lax.scan(body, state, (grads, m))
    assert updates.dtype == jnp.bfloat16 and float(updates[-1, 0]) == -1.375
    assert bool(state.emitted) and int(state.gradient_step) == 1


# --- coupled and statistics-first losses ---------------------------------------------------


def test_coupled_pullback_sums_in_float32():
    """512 micro-batches pulled back through a coupled loss: cotangents 1 and 1.5 (exact in
    bfloat16), whose float32 sum 640 is exact; a bfloat16 accumulator stops near 256 * 2."""
    x = jnp.ones((K_MANY, 1), jnp.bfloat16)
    c = jnp.asarray(np.tile([1.0, 1.5], K_MANY // 2), jnp.bfloat16)

    def encode(w, batch):
        return batch[0] @ w

    def loss(w, z, batch):
        return jnp.sum(z[:, 0] * batch[1])  # couples nothing, but runs the coupled path

    w = jnp.zeros((1, 1), jnp.bfloat16)
    value, g = jax.jit(jaxaccum.coupled_value_and_grad(encode, loss, num_microbatches=K_MANY))(
        w, (x, c))
    assert g.dtype == jnp.bfloat16 and float(g[0, 0]) == 640.0


def _encode(w, x):
    return x @ w  # (m, E) representations


def _coupled_loss(w, z, x):
    # couples the batch: a log-sum-exp over every example's score
    return jax.nn.logsumexp(jnp.sum(jnp.tanh(z), -1)) - jnp.mean(z[:, 0])


@settings(max_examples=examples(3), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@example(k=4, seed=1, step=True)
@given(k=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16), step=st.booleans())
def test_coupled_bfloat16_within_the_full_batch_error(k, seed, step):
    """coupled_value_and_grad / coupled_train_step in bfloat16: no worse than plain JAX's one
    full batch in bfloat16, plus one rounding of each micro-batch's pulled-back gradient and
    float32's sum of them, and one final rounding."""
    rng = np.random.default_rng(seed)
    x32 = rng.normal(size=(8, D)).astype(np.float32)
    w32 = (rng.normal(size=(D, 2)) / 2).astype(np.float32)
    x, w = jnp.asarray(x32, jnp.bfloat16), jnp.asarray(w32, jnp.bfloat16)

    def full(w, x):
        return _coupled_loss(w, _encode(w, x), x)

    v_plain, g_plain = jax.jit(jax.value_and_grad(full))(w, x)
    with jax.enable_x64():
        x64, w64 = jnp.asarray(_f64(x), jnp.float64), jnp.asarray(_f64(w), jnp.float64)
        v64, g64 = jax.value_and_grad(full)(w64, x64)
        z64 = _encode(w64, x64)
        cot = jax.grad(lambda z: _coupled_loss(w64, z, x64))(z64)
        v64, g64, cot = float(v64), np.asarray(g64), np.asarray(cot)
    # each micro-batch's pulled-back gradient |x_i|^T |cot_i|, summed over micro-batches
    mag = sum(np.abs(x64[i::k]).T @ np.abs(cot[i::k]) for i in range(k))
    if step:
        opt = optax.sgd(1.0)
        params, _, value, info = jaxaccum.coupled_train_step(
            _encode, _coupled_loss, opt, num_microbatches=k)(jnp.copy(w), opt.init(w), x)
        grads = _f64(w) - _f64(params)  # SGD(1), one more rounding of w - g (below)
    else:
        value, g, info = jax.jit(jaxaccum.coupled_value_and_grad(
            _encode, _coupled_loss, num_microbatches=k, return_info=True))(w, x)
        assert g.dtype == jnp.bfloat16
        grads = _f64(g)
    assert value.dtype == jnp.bfloat16 and info.weight.dtype == jnp.float32
    assert int(info.num_microbatches) == k and float(info.weight) == k
    err_full = np.abs(_f64(g_plain) - g64)
    bound = (err_full + EPS16 * (np.abs(_f64(g_plain)) + np.abs(grads))  # the two finals
             + EPS16 * mag  # each micro-batch's bf16 pull-back, rounded once
             + 2 * (8 + D + k) * EPS32 * mag)  # float32: the dots' and the k-sum's
    if step:
        bound = bound + EPS16 * np.abs(_f64(w) - g64) * 2  # round(w - g), and its subtraction
    assert_close("coupled grads", grads, g64, bound)
    # the value is the loss on the same bf16 representations: plain JAX's, exactly
    assert_close("coupled loss", value, float(v_plain), 0.0)


@settings(max_examples=examples(3), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(k=st.sampled_from([1, 3, 4]), seed=st.integers(0, 2**16), step=st.booleans())
def test_statistics_first_bfloat16_statistics_sum_in_float32(k, seed, step):
    """statistics_first in bfloat16: the statistics (bf16 per micro-batch) summed in float32,
    the loss accumulated as value_and_grad's; against the float64 model of the micro-batches."""
    rng = np.random.default_rng(seed)
    b = 12
    x = jnp.asarray(rng.normal(size=(b, D)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(D,)) / 2, jnp.bfloat16)

    def stats(w, x):
        return {"lse": jax.nn.logsumexp(x @ w), "n": jnp.sum(jnp.ones(x.shape[0], jnp.bfloat16))}

    def fun(w, x, totals):
        return jnp.mean((x @ w - totals["lse"] / totals["n"]) ** 2)

    if step:
        opt = optax.sgd(1.0)
        stepper = jaxaccum.statistics_first_train_step(stats, fun, opt, num_microbatches=k)
        params, _, value, info = stepper(jnp.copy(w), opt.init(w), x)  # donated
    else:
        value, g, info = jax.jit(jaxaccum.statistics_first(
            stats, fun, num_microbatches=k, return_info=True))(w, x)
    # the model: bf16 statistics per micro-batch summed in float64, then each micro-batch's
    # loss and gradient by plain JAX with those totals (as float32, the documented dtype)
    parts = [jax.jit(stats)(w, x[i::k]) for i in range(k)]
    for p in parts:
        assert p["lse"].dtype == jnp.bfloat16
    totals64 = {n: sum(_f64(p[n]) for p in parts) for n in ("lse", "n")}
    totals = {n: jnp.asarray(v, jnp.float32) for n, v in totals64.items()}
    vg = jax.jit(jax.value_and_grad(fun))
    micro = [vg(w, x[i::k], totals) for i in range(k)]
    loss = np.mean([_f64(v) for v, _ in micro])
    grads = np.mean([_f64(g_) for _, g_ in micro], 0)
    mag = np.mean([np.abs(_f64(g_)) for _, g_ in micro], 0)
    # the totals: a float32 sum of k bf16 values is exact to eps32 k; passing them as float32
    # values rounded from that sum changes each micro-batch's result by at most that much,
    # times the loss's sensitivity, well inside the float32 bound kept below (2 (k + 4) eps32)
    if step:
        assert params.dtype == jnp.bfloat16
        after = _f64(w) - grads
        bound = 2 * (k + 8) * EPS32 * mag + EPS16 * np.abs(grads) + EPS16 * np.abs(after) * 2
        assert_close("params", params, after, bound)
    else:
        assert g.dtype == jnp.bfloat16
        assert_close("grads", g, grads, 2 * (k + 8) * EPS32 * mag + EPS16 * np.abs(grads))
    assert info.weight.dtype == jnp.float32 and float(info.weight) == k
    lmag = np.mean([abs(_f64(v)) for v, _ in micro])
    # the float32 statistics make the loss float32: float32 sums, no 16-bit rounding
    assert value.dtype == jnp.float32
    assert_close("loss", value, loss, 2 * (k + 8) * EPS32 * lmag)


# --- multi_steps in bfloat16 ---------------------------------------------------------------


@settings(max_examples=examples(4), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), k=st.integers(1, 5), weighted=st.booleans(),
       zero=st.booleans(), skip=st.booleans(), accumulator=st.sampled_from(["default", "f32"]))
def test_multi_steps_bfloat16_window(seed, k, weighted, zero, skip, accumulator):
    """A window of bf16 micro-batch gradients: the emitted update is the float64 weighted
    mean of those same gradients within float32 sums and one final rounding; the state's
    dtypes as documented (float32 acc_grads, acc_weight; int32 counters)."""
    rng = np.random.default_rng(seed)
    grads = jnp.asarray(rng.normal(size=(k, D)) * 4, jnp.bfloat16)
    weights = rng.choice(np.array([1.0, 2.0, 5.0], np.float32), size=k)
    if zero:
        weights[rng.integers(k)] = 0.0
    kw = {} if accumulator == "default" else {"accumulator_dtype": jnp.float32}
    opt = jaxaccum.multi_steps(optax.sgd(1.0), every_k=k, skip_nonfinite=skip, **kw)
    w = jnp.zeros((D,), jnp.bfloat16)
    state = opt.init(w)
    update = jax.jit(opt.update)
    for i in range(k):
        u, state = update(grads[i], state, w, weight=weights[i] if weighted else None)
        assert state.acc_grads.dtype == jnp.float32 and state.acc_weight.dtype == jnp.float32
        assert state.mini_step.dtype == jnp.int32 and state.gradient_step.dtype == jnp.int32
    wt = weights if weighted else np.ones(k)
    g64 = _f64(grads)
    total = wt.sum()
    assert u.dtype == jnp.bfloat16
    if total == 0:
        assert not bool(state.emitted) and np.all(_f64(u) == 0)
        return
    mean = (wt[:, None] * g64).sum(0) / total
    mag = (wt[:, None] * np.abs(g64)).sum(0) / total
    gamma = 2 * (k + 4) * EPS32 * mag
    assert_close("update", -_f64(u), mean, gamma + EPS16 * (np.abs(mean) + gamma))


# --- token_mean and sequence_mean --------------------------------------------------------


@settings(max_examples=examples(2), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@example(seed=5, k=4, empty=True)
@given(seed=st.integers(0, 2**16), k=st.sampled_from([1, 2, 4]), empty=st.booleans())
def test_packing_means_bfloat16(seed, k, empty):
    """token_mean / sequence_mean of a bfloat16 loss: value and weight in float32 (a count is
    never 16-bit: 300 tokens are not a bf16 number; a mean rounded to bf16 before it is
    weighted loses half an ulp per micro-batch), and the accumulated mean over every token
    (sequence) of the batch within float32 sums alone."""
    rng = np.random.default_rng(seed)
    rows, length = 4 * k, 80
    seg = np.zeros((rows, length), np.int32)
    for r in range(rows):
        if empty and r % k == 0:
            continue  # a padding-only row: with k > 1, micro-batch 0 holds no token
        cuts = np.sort(rng.choice(np.arange(1, length), size=2, replace=False))
        seg[r, :cuts[0]] = 1
        seg[r, cuts[0]:cuts[1]] = 2
    x = jnp.asarray(rng.normal(size=(rows, length)), jnp.bfloat16)
    w = jnp.asarray([0.75], jnp.bfloat16)

    def per_token(w, x):
        return (x * w[0] - 1.0) ** 2  # bf16 per-token losses

    for name in ("token_mean", "sequence_mean"):
        mean_fn = getattr(jaxaccum.packing, name)

        def loss(w, batch, mean_fn=mean_fn):
            x, seg = batch
            return mean_fn(per_token(w, x), seg)

        value, g = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k, weighted=True))(
            w, (x, jnp.asarray(seg)))
        one_value, one_weight = loss(w, (x[:1], jnp.asarray(seg[:1])))
        assert one_value.dtype == jnp.float32 and one_weight.dtype == jnp.float32
        assert value.dtype == jnp.float32 and g.dtype == jnp.bfloat16
        tok = _f64(per_token(w, x))  # the bf16 per-token losses, as the loss computes them
        real = seg > 0
        if name == "token_mean":
            want = tok[real].mean() if real.any() else 0.0
            terms = np.abs(tok[real]).sum() / max(real.sum(), 1)
            n = real.sum()
        else:
            means = [tok[r][seg[r] == s].mean() for r in range(rows) for s in (1, 2)
                     if np.any(seg[r] == s)]
            want = float(np.mean(means)) if means else 0.0
            terms = float(np.mean(np.abs(means))) if means else 0.0
            n = len(means)
        # each micro-batch's float32 mean of <= n terms and the float32 weighted sum of k of
        # them: no bf16 rounding of the value anywhere (the loss comes back in float32)
        bound = 2 * (n + k + 4) * EPS32 * terms
        assert_close(name, value, want, bound)


# --- the page's table is the JSON's --------------------------------------------------------


def test_precision_page_matches_the_json():
    """docs/guides/precision.md's measured table is what benchmarks/precision.py's ``table``
    prints from the committed benchmarks/results/precision.json (test_docs.py's rule)."""
    spec = importlib.util.spec_from_file_location("precision_benchmark",
                                                  ROOT / "benchmarks" / "precision.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    data = json.loads((ROOT / "benchmarks/results/precision.json").read_text())
    page = (ROOT / "docs/guides/precision.md").read_text(encoding="utf-8")
    shown = page.split("<!-- precision:start -->\n")[1].split("<!-- precision:end -->")[0]
    assert shown == module.table(data), (
        "docs/guides/precision.md's table differs from benchmarks/precision.py's table() of "
        "benchmarks/results/precision.json: paste its output between the precision markers")
    functions = {r["function"] for r in data["rows"]}
    for name in ("value_and_grad", "train_step", "coupled_value_and_grad", "statistics_first",
                 "multi_steps", "jaxaccum.nnx.train_step", "jaxaccum.linen.train_step",
                 "jaxaccum.packing.token_mean", "jaxaccum.packing.sequence_mean"):
        assert name in functions, name


def test_bfloat16_aux_sum_is_accumulated_in_float32():
    """512 micro-batches each report 1.0 in bfloat16: a bfloat16 sum stalls at 256."""

    def fn(w, x):
        return jnp.mean(w * x), jnp.ones((), jnp.bfloat16)

    (_, total), _ = jax.jit(jaxaccum.value_and_grad(fn, num_microbatches=512, has_aux="sum"))(
        jnp.ones(()), jnp.ones(512))
    assert float(total) == 512.0
