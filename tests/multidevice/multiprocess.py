"""Training with several JAX processes on 127.0.0.1, and the single-process references.

Modes (first argument):

* ``data``: 2 processes x 1 device, a (2,) data mesh, 3 Adam steps at k = 4 on a global
  batch of 64 (each process feeds its half); ``data_reference``: one process, k = 8.
* ``data_model``: 2 processes x 4 devices, a (data=4, model=2) mesh with tensor-parallel
  kernels, 3 momentum steps at k = 4; ``data_model_reference``: one device, k = 16.

Each prints the final parameters (process 0's, gathered) as ``{"params": {name: lists}}``.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

from . import data_parallel
from .common import (
    accumulation_options,
    arrays_to_json,
    emit,
    initialize_distributed,
    process_index,
)

STEPS = 3


def data(distributed: bool) -> dict[str, Any]:
    """Call after :func:`initialize_distributed` when ``distributed``."""
    params, batch, _ = data_parallel.params_and_batch(64)
    opt = optax.adam(1e-2)
    if not distributed:
        step = jaxaccum.train_step(data_parallel.loss, opt, num_microbatches=8)
        state = opt.init(params)
        for _ in range(STEPS):
            params, state, _, _ = step(params, state, batch)
        return params
    pid = process_index()
    mesh = jax.make_mesh((2,), ("data",))
    sharding = jax.NamedSharding(mesh, jax.P("data"))
    local = jax.tree.map(lambda x: np.asarray(x)[pid * 32 : (pid + 1) * 32], batch)
    global_batch = jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, x), local
    )
    step = jaxaccum.train_step(
        data_parallel.loss, opt, num_microbatches=4, **accumulation_options(mesh, "data")
    )
    p = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
    state = opt.init(p)
    for _ in range(STEPS):
        p, state, _, _ = step(p, state, global_batch)
    result = {k: np.asarray(v) for k, v in p.items()}
    jax.distributed.shutdown()
    return result


def tp_loss(p: dict[str, Any], b: tuple[Any, Any]) -> jax.Array:
    x, y = b
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)


def data_model(distributed: bool) -> dict[str, Any]:
    """Call after :func:`initialize_distributed` when ``distributed``."""
    rng = np.random.default_rng(0)
    params: dict[str, np.ndarray] = {
        "w1": rng.normal(size=(16, 64)).astype(np.float32) / 4,
        "b1": np.zeros(64, np.float32),
        "w2": rng.normal(size=(64, 8)).astype(np.float32) / 8,
    }
    x = rng.normal(size=(64, 16)).astype(np.float32)
    y = rng.normal(size=(64, 8)).astype(np.float32)
    opt = optax.sgd(0.1, momentum=0.9)  # not Adam: scale-invariant, it would hide a wrong mean
    if not distributed:
        step = jaxaccum.train_step(tp_loss, opt, num_microbatches=16)
        p: dict[str, Any] = dict(params)
        state = opt.init(p)
        for _ in range(STEPS):
            p, state, _, _ = step(p, state, (x, y))
        return p
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}

    def put(a: np.ndarray, s: P) -> jax.Array:
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, s), lambda i: a[i])

    p = {k: put(v, specs[k]) for k, v in params.items()}
    batch = (put(x, P("data")), put(y, P("data")))
    step = jaxaccum.train_step(
        tp_loss, opt, num_microbatches=4, **accumulation_options(mesh, "data")
    )
    state = opt.init(p)
    for _ in range(STEPS):
        p, state, _, _ = step(p, state, batch)
    kept = all(p[k].sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), p[k].ndim) for k in p)
    assert kept, {k: p[k].sharding for k in p}
    gathered = {
        k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in p.items()
    }
    jax.distributed.shutdown()
    return gathered


def main(mode: str) -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    name, reference, _ = mode.partition("_reference")
    if not reference:
        initialize_distributed()  # before any JAX computation
    params = {"data": data, "data_model": data_model}[name](distributed=not reference)
    emit({"params": arrays_to_json(params)})


if __name__ == "__main__":
    main(*sys.argv[1:])
