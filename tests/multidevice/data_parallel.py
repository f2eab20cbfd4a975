"""Data parallel on an (8,) mesh: equal to a single device, one gradient reduction per step.

``python -m tests.multidevice.data_parallel single_host`` (the default) measures k = 1, 4, 16;
``... errors`` prints the messages of wrongly configured calls.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp

import jaxaccum
from jaxaccum._xla import hlo as _hlo

from .common import accumulation_options, emit, hlo_text

Params = dict[str, jax.Array]


def params_and_batch(batch_size: int) -> tuple[Params, tuple[jax.Array, jax.Array], jax.Array]:
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (8, 32)) / 3, "w2": jax.random.normal(k2, (32, 4)) / 6}
    x = jax.random.normal(k3, (batch_size, 8))
    y = jax.random.normal(k4, (batch_size, 4))
    mask = (jnp.arange(batch_size) % 5 < 2).astype(jnp.float32).at[: batch_size // 4].set(0.0)
    return params, (x, y), mask


def loss(p: Params, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def masked(p: Params, batch: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    x, y, m = batch
    per = jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2, axis=-1)
    return jnp.sum(per * m) / jnp.maximum(jnp.sum(m), 1.0), jnp.sum(m)


def rel(a: Any, b: Any) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    d = max(float(jnp.max(jnp.abs(x - y))) for x, y in pairs)
    return d / max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))


def single_host() -> dict[str, Any]:
    mesh = jax.make_mesh((8,), ("data",))  # Explicit axes: the default of current JAX
    auto = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params, batch, mask = params_and_batch(256)
    ref = jax.value_and_grad(loss)(params, batch)
    ref_w = jax.value_and_grad(lambda p, b: masked(p, b)[0])(params, (*batch, mask))
    out: dict[str, Any] = {"devices": len(jax.devices())}
    for k in (1, 4, 16):
        fn = jax.jit(
            jaxaccum.value_and_grad(
                loss, num_microbatches=k, **accumulation_options(mesh, data_axis="data")
            )
        )
        fw = jax.jit(
            jaxaccum.value_and_grad(
                masked, num_microbatches=k, weighted=True, **accumulation_options(mesh)
            )
        )
        with jax.set_mesh(mesh):  # explicit sharding mode needs the mesh in context
            hlo = hlo_text(fn.lower(params, batch).compile())
            row: dict[str, Any] = {
                "rel": rel(fn(params, batch), ref),
                "rel_weighted": rel(fw(params, (*batch, mask)), ref_w),
                "counts": _hlo.collective_counts(hlo),
                "reductions": _hlo.gradient_reductions(hlo, 8),
            }
        # the same with an Auto-axis mesh (the older default)
        fa = jax.jit(
            jaxaccum.value_and_grad(
                loss, num_microbatches=k, **accumulation_options(auto, data_axis="data")
            )
        )
        row["rel_auto_mesh"] = rel(fa(params, batch), ref)
        row["auto_counts"] = _hlo.collective_counts(hlo_text(fa.lower(params, batch).compile()))
        # the naive way: a scan over micro-batches of a batch-sharded array under plain jit
        sharded = jax.device_put(batch, jax.NamedSharding(auto, jax.P("data")))
        naive = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k))
        naive_hlo = hlo_text(naive.lower(params, sharded).compile())
        row["naive_counts"] = _hlo.collective_counts(naive_hlo)
        out[str(k)] = row
    return out


def errors() -> dict[str, Any]:
    mesh = jax.make_mesh((8,), ("data",))
    params, batch, _ = params_and_batch(12)
    msgs = []
    configs: tuple[Any, ...] = (
        lambda: accumulation_options(mesh, data_axis="model"),
        lambda: {"mesh": jax.make_mesh((4, 2), ("data", "model"))},  # several axes, none named
        lambda: accumulation_options(mesh),
    )
    for kwargs in configs:
        try:
            jaxaccum.value_and_grad(loss, num_microbatches=1, **kwargs())(params, batch)
        except ValueError as e:
            msgs.append(str(e))
    return {"messages": msgs}


def main(mode: str = "single_host") -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    emit({"single_host": single_host, "errors": errors}[mode]())


if __name__ == "__main__":
    main(*sys.argv[1:])
