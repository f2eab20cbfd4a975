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

import numpy as np
import pytest
from conftest import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import FRONT_ENDS, LEAF_NAMES, Scenario, check

EXAMPLES = int(os.environ.get("JAXACCUM_REFERENCE_EXAMPLES", "12"))
D = 3


# --- scenarios --------------------------------------------------------------------------------

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
@settings(max_examples=examples(EXAMPLES), deadline=None, report_multiple_bugs=False,
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
    # micro-batch 1 (rows 1 and 5: micro-batches are strided) weighs -0.5 in all: invalid
    "weighted, a micro-batch of weight -0.5, noise": _with(
        _with(_fixed(weighted=True, noise_scale=True), "m", 1, -0.25), "m", 5, -0.25),
    "weighted, a micro-batch of weight -0.5, noise, skipping": _with(_with(
        _fixed(weighted=True, noise_scale=True, skip_nonfinite=True), "m", 1, -0.25), "m", 5,
        -0.25),
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
