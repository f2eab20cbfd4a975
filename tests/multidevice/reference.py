"""The reference model of the docs (``tests/reference.py``) on 8 host devices: a data mesh
with Auto axes (each device evaluates its share of every micro-batch: the reference's units
are those shares) and with Explicit axes (the micro-batches are global), through every front
end that takes a mesh, over seeded random scenarios of weights (zero, negative, NaN), NaN
examples, runtime counts, skipping, every aux reduction and the noise scale (Auto only)."""

from __future__ import annotations

import dataclasses
import sys
import traceback
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from tests.launcher import raised_in_library
from tests.reference import REDUCTIONS, D, Scenario, check

from .common import emit

DEVICES = 8
LEAVES = {"res": ("stack", "concat"), "avg": REDUCTIONS[2:], "pos": ("stack", "sum", "mean",
                                                                    "max", "min", "last"),
          "half": REDUCTIONS[2:]}
# every front end on both kinds of axes (the NNX model has no state beside its parameters:
# state carried on Auto axes is refused, state that is empty is not)
FRONTS = {axes: ("value_and_grad", "statistics_first", "train_step", "nnx.value_and_grad",
                 "nnx.train_step", "linen.train_step") for axes in ("auto", "explicit")}


def scenario(rng: np.random.Generator, axes: str) -> Scenario:
    k = int(rng.integers(1, 4))
    runtime = bool(rng.integers(2))
    per_share = int(rng.integers(1, 3))  # examples per device per micro-batch
    b = k * per_share * DEVICES
    x = rng.normal(size=(b, D)).astype(np.float32)
    y = rng.normal(size=(b,)).astype(np.float32)
    w = (rng.normal(size=(D,)) / 2).astype(np.float32)
    m = rng.choice(np.array([0.0, 1.0, 2.0, 3.0], np.float32), size=b)
    special = rng.choice(["none", "zero", "negative", "nan_weight", "nan_example"])
    j = int(rng.integers(b))
    if special == "zero":
        m[: b // 2] = 0.0
    elif special == "negative":
        m[j] = -4.0
    elif special == "nan_weight":
        m[j] = np.nan
    elif special == "nan_example":
        x[j, 0] = np.nan
    skip = bool(rng.integers(2))
    aux = None
    if rng.integers(2):
        aux = {leaf: str(rng.choice(names)) for leaf, names in LEAVES.items()}
        if axes == "auto" and skip:  # "last" of the last device's kept micro-batch only
            aux = {leaf: ("sum" if name == "last" else name) for leaf, name in aux.items()}
    noise = axes == "auto" and bool(rng.integers(2))
    return Scenario(x, y, m, w, k, int(rng.integers(0, k + 1)) if runtime else None,
                    bool(rng.integers(2)), skip, aux, noise)


def fixed(axes: str) -> list[Scenario]:
    """Every reduced aux over the devices, once with a NaN that must win max and min, once
    weighted with an empty share, runtime counts of 1 and 2, whatever the random draws."""
    rng = np.random.default_rng(3)
    b, k = 32, 2
    x = rng.normal(size=(b, D)).astype(np.float32)
    y = rng.normal(size=(b,)).astype(np.float32)
    w = (rng.normal(size=(D,)) / 2).astype(np.float32)
    m = rng.choice(np.array([1.0, 2.0], np.float32), size=b)
    every = {"res": "concat", "avg": "last", "pos": "max", "half": "min"}
    others = {"res": "stack", "avg": "weighted_mean", "pos": "last", "half": "sum"}
    nan = x.copy()
    nan[5, 0] = np.nan
    empty = m.copy()
    empty[:4] = 0.0  # device 0's share of both micro-batches
    return [Scenario(x, y, m, w, k, None, False, False, every, axes == "auto"),
            Scenario(nan, y, m, w, k, None, False, False, every, False),
            Scenario(x, y, empty, w, k, None, True, False, others, axes == "auto"),
            Scenario(x, y, m, w, k, 1, True, False, every, axes == "auto"),
            Scenario(x, y, m, w, k, 2, False, False, others, axes == "auto")]


def gathered_argument(mesh: Any) -> float:
    """A non-batch argument sharded over the data axis is used whole by every device (the
    docs: arguments other than the batch are passed whole): the relative gradient error
    against one device."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, D)).astype(np.float32)
    table = np.arange(1.0, 9.0, dtype=np.float32)  # the loss needs every entry

    def loss(w: Any, batch: Any, table: Any) -> Any:
        return jax.numpy.mean((batch @ w) ** 2) * jax.numpy.sum(table * table)

    w = np.ones(D, np.float32)
    sgd = optax.sgd(0.1)
    one = jaxaccum.train_step(loss, sgd, num_microbatches=2)(w, sgd.init(w), x, table)[0]
    sharded = jax.device_put(table, NamedSharding(mesh, P("data")))
    # the step reads the shardings of what it is given (Auto axes) and keeps them
    got = jaxaccum.train_step(loss, sgd, num_microbatches=2, mesh=mesh)(
        w, sgd.init(w), x, sharded)[0]
    change = np.asarray(one) - w
    return float(np.max(np.abs(np.asarray(got) - np.asarray(one))) / np.max(np.abs(change)))


def main() -> None:
    cases = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    out: dict[str, Any] = {}
    for axes in ("auto", "explicit"):
        kind = AxisType.Auto if axes == "auto" else AxisType.Explicit
        mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(kind,))
        rng = np.random.default_rng(0)
        ran, failures = 0, []
        scenarios = [*fixed(axes), *(scenario(rng, axes) for _ in range(cases))]
        for n, s in enumerate(scenarios):
            if axes == "auto":  # the reference's units: each device's share of a micro-batch
                s = dataclasses.replace(s, shards=DEVICES)
            for front in FRONTS[axes]:
                try:
                    check(front, s, mesh)
                except Exception as error:  # noqa: BLE001 - reported with the scenario
                    failures.append({"asserted": isinstance(error, AssertionError)
                                     and not raised_in_library(error),
                                     "text": f"case {n} {front}: {traceback.format_exc()[-1500:]}"})
                ran += 1
        out[axes] = {"checks": ran, "failures": failures,
                     "gathered_argument_rel": gathered_argument(mesh)}
    emit(out)


if __name__ == "__main__":
    main()
