"""Explicit (8,) mesh: parameters meeting batch-sharded activations (bias, scale), in nested
jits, in the model's own scan over layers, and in a convolution."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import _hlo

from .common import accumulation_options, emit, hlo_text

B, D, L = 256, 16, 3
Params = dict[str, Any]


def matmul(explicit: bool) -> Callable[[jax.Array, jax.Array], jax.Array]:
    if explicit:
        return lambda h, w: jnp.einsum("bd,de->be", h, w, out_sharding=P("data", None))
    return jnp.dot


def top_level(p: Params, x: jax.Array, explicit: bool = True) -> jax.Array:
    """A bias add and a LayerNorm-like scale; a nested jit."""
    dot = matmul(explicit)
    h = x
    for i in range(L):
        h = jax.jit(lambda h, w, b: jnp.tanh(dot(h, w) + b))(h, p["w"][i], p["b"][i])
    return jnp.mean((h * p["scale"]) ** 2)


def scanned(p: Params, x: jax.Array, explicit: bool = True) -> jax.Array:
    """The same layers in a lax.scan."""
    dot = matmul(explicit)

    def layer(h: jax.Array, wb: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        return jnp.tanh(dot(h, wb[0]) + wb[1]), None

    h, _ = jax.lax.scan(layer, x, (p["w"], p["b"]))
    return jnp.mean((h * p["scale"]) ** 2)


def conv(p: Params, x: jax.Array, explicit: bool = True) -> jax.Array:
    """JAX 0.10 has no reduced rule for conv_general_dilated."""
    img = x.reshape(x.shape[0], 4, 4, 1)
    h = jax.lax.conv_general_dilated(
        img, p["ck"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jnp.mean((jnp.tanh(h + p["b"][0]).mean((1, 2)) * p["scale"]) ** 2)


def main() -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    rng = np.random.default_rng(0)
    host = {
        "w": rng.normal(size=(L, D, D)).astype(np.float32) / 4,
        "b": rng.normal(size=(L, D)).astype(np.float32) / 10,
        "scale": 1 + rng.normal(size=(D,)).astype(np.float32) / 10,
        "ck": rng.normal(size=(3, 3, 1, D)).astype(np.float32) / 3,
    }
    x_host = rng.normal(size=(B, D)).astype(np.float32)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    out = {}
    models: tuple[tuple[str, Callable[..., jax.Array]], ...] = (
        ("top_level", top_level),
        ("scanned", scanned),
        ("conv", conv),
    )
    for name, loss in models:
        ref_loss, ref_grads = jax.jit(
            jax.value_and_grad(lambda p, x, loss=loss: loss(p, x, explicit=False))
        )(host, x_host)
        with jax.set_mesh(mesh):
            params = jax.device_put(host, NamedSharding(mesh, P()))
            x = jax.device_put(x_host, NamedSharding(mesh, P("data")))
            fn = jax.jit(
                jaxaccum.value_and_grad(loss, num_microbatches=4, **accumulation_options(mesh))
            )
            value, grads = fn(params, x)
            scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref_grads))
            diff = max(float(np.max(np.abs(np.asarray(grads[k]) - ref_grads[k]))) for k in grads)
            out[name] = {
                "grads_rel": diff / scale,
                "loss_rel": abs(float(value) - float(ref_loss)) / abs(float(ref_loss)),
                "reductions": _hlo.gradient_reductions(hlo_text(fn.lower(params, x).compile()), 8),
            }
    emit(out)


if __name__ == "__main__":
    main()
