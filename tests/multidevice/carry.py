"""Carried state and aux reductions on an Explicit (8,) mesh against a single device (k = 4)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

from .common import accumulation_options, emit, rel_diff


def loss(p: dict[str, Any], b: tuple[Any, Any], s: dict[str, Any]) -> Any:
    """BatchNorm-like: normalise by the micro-batch mean, update running stats."""
    x, y = b
    h = x @ p["w1"]
    mean = jnp.mean(h, axis=0)
    out = jnp.tanh(h - mean) @ p["w2"]
    new = {"mean": 0.9 * s["mean"] + 0.1 * jax.lax.stop_gradient(mean), "count": s["count"] + 1}
    return (jnp.mean((out - y) ** 2), {"first": jnp.max(out), "n": jnp.asarray(x.shape[0])}), new


def main() -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(8, 16)).astype(np.float32) / 3,
        "w2": rng.normal(size=(16, 4)).astype(np.float32) / 4,
    }
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = rng.normal(size=(256, 4)).astype(np.float32)
    stats = {"mean": np.zeros(16, np.float32), "count": np.zeros((), np.int32)}
    kw: dict[str, Any] = dict(
        num_microbatches=4, carry_argnums=2, has_aux={"first": "last", "n": "sum"}
    )
    ((l1, aux1), s1), g1 = jax.jit(jaxaccum.value_and_grad(loss, **kw))(params, (x, y), stats)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
        fn = jax.jit(jaxaccum.value_and_grad(loss, **accumulation_options(mesh), **kw))
        ((l2, aux2), s2), g2 = fn(params, batch, stats)
    out: dict[str, Any] = {
        "grads": rel_diff(g2, g1),
        "loss": rel_diff(l2, l1),
        "stats": rel_diff(s2["mean"], s1["mean"]),
        "count": int(s2["count"]),
        "n": int(aux2["n"]),
        "n_single": int(aux1["n"]),
        "first": rel_diff(aux2["first"], aux1["first"]),
    }
    auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    try:
        jaxaccum.value_and_grad(loss, **accumulation_options(auto), **kw)(params, (x, y), stats)
    except ValueError as e:
        out["auto_error"] = str(e)
    emit(out)


if __name__ == "__main__":
    main()
