"""Every front end against the reference model of the docs (``tests/reference.py``).

One scenario (data, weights that may be zero, negative or NaN, a NaN example, k, a runtime
count, ``weighted``, ``skip_nonfinite``, an aux reduction per leaf of float32, int32 and
bfloat16 aux, ``noise_scale``) drawn by hypothesis, run through every entry point that takes
those options, and compared with what the docs say it must give: loss, gradients, the
parameters after one SGD(1) step (or none when the total weight is 0), the aux, and the
``StepInfo`` (skipped, weight, micro-batches evaluated, noise scale) with its fixed dtypes.

The number of examples per front end is ``JAXACCUM_REFERENCE_EXAMPLES`` (default 12 in the
suite; the closing numbers of a thorough run come from 200).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import EPS16, EPS32, Scenario, assert_close, expected, loss_fn

import jaxaccum
import jaxaccum.linen
import jaxaccum.nnx

EXAMPLES = int(os.environ.get("JAXACCUM_REFERENCE_EXAMPLES", "12"))
D = 3


class Linear(nnx.Module):
    def __init__(self, w: np.ndarray) -> None:
        self.w = nnx.Param(jnp.asarray(w))


def _nnx_loss(loss):
    return lambda model, batch: loss(model.w[...], batch)


def _totals_loss(loss, weighted: bool, examples: int):
    """``loss`` times ``totals["n"] / examples``: 1 exactly when the statistics are the sum
    of every evaluated micro-batch's example count, as ``statistics_first`` promises."""

    def fun(w, batch, totals):
        out = loss(w, batch)
        factor = totals["n"] / examples
        if isinstance(out, tuple) and isinstance(out[0], tuple):  # ((loss, weight), aux)
            (value, weight), aux = out
            return (value * factor, weight), aux
        if isinstance(out, tuple):
            return (out[0] * factor, out[1])
        return out * factor

    return fun


def _stats(w, batch):
    return {"n": jnp.asarray(batch[0].shape[0], jnp.float32)}


def run(front: str, s: Scenario) -> dict[str, Any]:
    """Runs scenario ``s`` through ``front``; returns loss, grads, info, aux and the
    parameters after one SGD(1) step (steps only)."""
    loss = loss_fn(s.weighted, None if s.aux is None else tuple(s.aux))
    opts = s.options
    w = jnp.asarray(s.w)
    batch = s.batch()
    sgd = optax.sgd(1.0)
    out: dict[str, Any] = {}
    if front == "value_and_grad":
        value, grads, info = jax.jit(jaxaccum.value_and_grad(loss, return_info=True, **opts))(
            w, batch)
        out.update(value=value, grads=grads, info=info)
    elif front == "statistics_first":
        examples = s.x.shape[0] if s.count is None else s.count * (s.x.shape[0] // s.k)
        fn = jaxaccum.statistics_first(_stats, _totals_loss(loss, s.weighted, max(examples, 1)),
                                       return_info=True, **opts)
        value, grads, info = jax.jit(fn)(w, batch)
        out.update(value=value, grads=grads, info=info)
    elif front == "train_step":
        step = jaxaccum.train_step(loss, sgd, **opts)
        params, _, value, info = step(w, sgd.init(w), batch)
        out.update(value=value, info=info, params=params)
    elif front == "nnx.value_and_grad":
        model = Linear(s.w)
        fn = nnx.jit(jaxaccum.nnx.value_and_grad(_nnx_loss(loss), return_info=True, **opts))
        value, grads, info = fn(model, batch)
        out.update(value=value, grads=grads["w"][...], info=info)
    elif front == "nnx.train_step":
        model = Linear(s.w)
        optimizer = nnx.Optimizer(model, sgd, wrt=nnx.Param)
        value, info = jaxaccum.nnx.train_step(_nnx_loss(loss), **opts)(model, optimizer, batch)
        out.update(value=value, info=info, params=model.w[...])
    elif front == "linen.train_step":
        state = train_state.TrainState.create(apply_fn=None, params=w, tx=sgd)
        state, value, info = jaxaccum.linen.train_step(loss, **opts)(state, batch)
        out.update(value=value, info=info, params=state.params)
    else:
        raise ValueError(front)
    return out


FRONT_ENDS = ("value_and_grad", "statistics_first", "train_step", "nnx.value_and_grad",
              "nnx.train_step", "linen.train_step")
STEPS = ("train_step", "nnx.train_step", "linen.train_step")


def check(front: str, s: Scenario) -> None:
    """Asserts that ``front`` gives what the reference model says for ``s``."""
    want = expected(s)
    got = run(front, s)
    info = got["info"]
    # one contract: the info's fields and dtypes, whatever the options
    assert isinstance(info, jaxaccum.StepInfo), type(info)
    assert info.skipped.dtype == jnp.int32 and info.num_microbatches.dtype == jnp.int32
    assert info.weight.dtype == jnp.float32
    assert int(info.skipped) == want.skipped
    assert int(info.num_microbatches) == want.num_microbatches
    assert_close("info.weight", info.weight, want.weight, 4 * EPS32 * abs(want.weight))
    value = got["value"]
    if front in STEPS:  # a step returns the loss alone; the aux is in the info
        loss, aux = value, info.aux
    else:
        loss, aux = (value if s.aux is not None else (value, None))
    assert jnp.shape(loss) == () and jnp.asarray(loss).dtype == jnp.float32
    assert_close("loss", loss, want.loss, want.loss_bound)
    if "grads" in got:
        assert_close("grads", got["grads"], want.grads, want.grads_bound)
    if "params" in got:  # SGD(1): w - grads, or w unchanged when the total weight is 0
        after = s.w - want.grads if want.stepped else s.w
        bound = want.grads_bound + 2 * EPS32 * np.abs(s.w) if want.stepped else 0.0
        assert_close("params", got["params"], after, bound)
    if s.aux is None:
        assert aux is None
    else:
        _check_aux(s, aux, want)
    if s.noise_scale:
        _check_noise(info.noise_scale, want)
    else:
        assert info.noise_scale is None


def _check_aux(s: Scenario, aux: Any, want: Any) -> None:
    assert set(aux) == set(s.aux), (set(aux), set(s.aux))
    scale = max([1.0] + [float(np.nanmax(np.abs(v))) for v in want.aux.values()
                         if np.size(v) and np.any(np.isfinite(v))])
    for leaf, name in s.aux.items():
        got = aux[leaf]
        assert np.dtype(got.dtype) == np.dtype(want.aux_dtypes[leaf]), (
            f"aux {leaf!r} ({name}): dtype {got.dtype}, expected {want.aux_dtypes[leaf]}")
        if leaf == "pos" and name not in ("mean", "weighted_mean"):
            bound = 0.0
        elif leaf == "half":
            bound = 4 * (s.k + 1) * EPS16 * scale
        else:
            bound = 8 * (s.x.shape[0] + D + s.k) * EPS32 * scale * max(1.0, np.abs(s.w).sum())
        assert_close(f"aux {leaf!r} ({name})", got, want.aux[leaf], bound)


def _check_noise(noise: Any, want: Any) -> None:
    assert isinstance(noise, jaxaccum.NoiseScale)
    g2, trace, small, big = want.noise
    assert_close("noise big_batch", noise.big_batch, big, 4 * EPS32 * abs(big))
    assert_close("noise small_batch", noise.small_batch, small, 8 * EPS32 * abs(small))
    # the estimators subtract sums of squared norms; float32 loses eps32 times their size
    mag = (abs(g2) + abs(trace) * 4 + 1.0) * 1e3 * EPS32 * big
    assert_close("noise trace", noise.trace, trace, mag)
    assert_close("noise gradient_sq", noise.gradient_sq, g2, mag)


# --- scenarios --------------------------------------------------------------------------------

LEAF_NAMES = {
    "res": ("stack", "concat"),
    "avg": ("stack", "sum", "mean", "weighted_mean", "max", "min", "last"),
    "pos": ("stack", "sum", "mean", "max", "min", "last"),
    "half": ("stack", "sum", "mean", "weighted_mean", "max", "min", "last"),
}


@st.composite
def scenarios(draw: Any) -> Scenario:
    k = draw(st.integers(1, 4))
    size = draw(st.integers(1, 3))
    runtime = draw(st.booleans())
    count = draw(st.integers(0, k)) if runtime else None
    b = k * size
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.normal(size=(b, D)).astype(np.float32)
    y = rng.normal(size=(b,)).astype(np.float32)
    w = (rng.normal(size=(D,)) / 2).astype(np.float32)
    m = rng.choice(np.array([0.0, 1.0, 1.0, 2.0, 3.0], np.float32), size=b)
    weighted = draw(st.booleans())
    micro = [np.arange(i, b, k) if count is None else np.arange(i * size, (i + 1) * size)
             for i in range(k)]
    special = draw(st.sampled_from(["none", "none", "zero", "negative", "nan_weight",
                                    "nan_example"]))
    where = micro[draw(st.integers(0, k - 1))]
    if special == "zero":
        m[where] = 0.0
    elif special == "negative":
        m[where] = -2.0
    elif special == "nan_weight":
        m[where[0]] = np.nan
    elif special == "nan_example":
        x[where[0], 0] = np.nan
    aux = None
    if draw(st.booleans()):
        aux = {leaf: draw(st.sampled_from(names)) for leaf, names in LEAF_NAMES.items()}
    noise = draw(st.booleans()) and (runtime or k >= 2)
    return Scenario(x, y, m, w, k, count, weighted, draw(st.booleans()), aux, noise)


@pytest.mark.parametrize("front", FRONT_ENDS)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, report_multiple_bugs=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(s=scenarios())
def test_every_front_end_gives_the_documented_result(front, s):
    check(front, s)


# --- fixed scenarios every run sees, whatever hypothesis draws ---------------------------------


def _fixed(**kw: Any) -> Scenario:
    rng = np.random.default_rng(7)
    k, size = kw.pop("k", 4), kw.pop("size", 2)
    b = k * size
    base = dict(x=rng.normal(size=(b, D)).astype(np.float32),
                y=rng.normal(size=(b,)).astype(np.float32),
                m=rng.choice(np.array([1.0, 2.0, 3.0], np.float32), size=b),
                w=(rng.normal(size=(D,)) / 2).astype(np.float32), k=k)
    base.update(kw)
    return Scenario(**base)


def _with(s: Scenario, field: str, index: Any, value: float) -> Scenario:
    arr = getattr(s, field).copy()
    arr[index] = value
    return Scenario(**{**s.__dict__, field: arr})


ALL_AUX = {"res": "concat", "avg": "mean", "pos": "sum", "half": "weighted_mean"}
FIXED = {
    "plain": _fixed(),
    "weighted, one empty micro-batch": _with(_fixed(weighted=True, aux=ALL_AUX), "m",
                                             slice(1, None, 4), 0.0),
    "weighted, a negative weight": _with(_fixed(weighted=True), "m", 2, -5.0),
    "weighted, a NaN weight, skipped": _with(_fixed(weighted=True, skip_nonfinite=True,
                                                    aux=ALL_AUX, noise_scale=True), "m", 3,
                                             np.nan),
    "NaN example skipped, every aux": _with(_fixed(skip_nonfinite=True, aux={
        "res": "stack", "avg": "max", "pos": "min", "half": "last"}, noise_scale=True),
        "x", (5, 1), np.nan),
    "every micro-batch skipped": _with(_with(_fixed(k=2, size=1, skip_nonfinite=True,
                                                    aux={"avg": "mean", "pos": "max"}),
                                             "x", (0, 0), np.nan), "x", (1, 0), np.nan),
    "runtime count 3 of 4": _fixed(count=3, weighted=True, aux=ALL_AUX, noise_scale=True),
    "runtime count 0": _fixed(count=0, aux={"res": "concat", "avg": "mean"}),
    "runtime count 1": _fixed(count=1, noise_scale=True),
}


@pytest.mark.parametrize("front", FRONT_ENDS)
@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_scenarios(front, name):
    check(front, FIXED[name])
