"""Checkpoint and resume in the middle of an accumulation window, as a preempted job would.

``python -m tests.multidevice.reliability MODE [CHECKPOINT]``; modes: ``first`` (stops after
9 of 20 micro-batch calls, mid-window, and saves CHECKPOINT with orbax), ``resume`` (restores
it and runs the rest), ``straight`` (all 20 calls), ``train_step`` (the recommended path, 5
windows). Prints the parameters and, but for ``train_step``, the gradient step.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

from .common import arrays_to_json, emit

K, WINDOWS, STOP = 4, 5, 9  # 20 micro-batch calls; the first process stops after 9 (mid-window)
Params = dict[str, jax.Array]


def loss(p: Params, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def data(i: int) -> tuple[jax.Array, jax.Array]:
    key = jax.random.fold_in(jax.random.key(0), i)
    return jax.random.normal(key, (8, 6)), jax.random.normal(jax.random.fold_in(key, 1), (8, 3))


def main(mode: str, path: str = "") -> None:
    params: Params = {
        "w1": jax.random.normal(jax.random.key(1), (6, 16)) / 3,
        "w2": jax.random.normal(jax.random.key(2), (16, 3)) / 4,
    }
    opt = jaxaccum.multi_steps(optax.adamw(optax.cosine_decay_schedule(1e-2, 5)), K)

    @jax.jit
    def call(params: Params, state: Any, batch: tuple[jax.Array, jax.Array]) -> tuple[Params, Any]:
        grads = jax.grad(loss)(params, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    if mode == "train_step":  # the recommended path, for the determinism test
        step = jaxaccum.train_step(loss, optax.adam(1e-2), num_microbatches=K)
        adam_state = optax.adam(1e-2).init(params)
        for i in range(WINDOWS):
            parts = [data(K * i + j) for j in range(K)]
            batch = jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
            params, adam_state, _, _ = step(params, adam_state, batch)
        emit({"params": arrays_to_json(params)})
        return
    state = opt.init(params)
    start, stop = 0, K * WINDOWS
    if mode == "first":
        stop = STOP
    elif mode == "resume":
        import orbax.checkpoint as ocp

        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "state": state})
        restored = ocp.StandardCheckpointer().restore(path, target)
        params, state, start = restored["params"], restored["state"], STOP
        assert type(state) is type(opt.init(params)) and int(state.mini_step) == STOP % K
    for i in range(start, stop):
        params, state = call(params, state, data(i))
    if mode == "first":
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(path, {"params": params, "state": state})
    emit({"params": arrays_to_json(params), "gradient_step": int(np.asarray(state.gradient_step))})


if __name__ == "__main__":
    main(*sys.argv[1:])
