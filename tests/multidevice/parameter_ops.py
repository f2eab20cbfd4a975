"""Explicit (8,) mesh: parameters meeting batch-sharded activations (bias, scale), in nested
jits, in the model's own scan over layers (stacked, or a bias the loop closes over beside 2-D
and 3-D kernels outside it), and in a convolution. Then a (4, 2) data x model mesh, Auto and
Explicit: parameter dimensions sharded over both axes at once, data-major and data-minor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._xla import hlo as _hlo

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


def loop_bias(p: Params, x: jax.Array, explicit: bool = True) -> jax.Array:
    """2-D and 3-D kernels at the top level, then a loop that closes over a bias: only the
    bias falls back; the kernels (every leaf of 2 dimensions or more) keep the single
    reduction."""
    dot = matmul(explicit)
    h = jnp.tanh(dot(jnp.tanh(dot(x, p["w2"])), p["w"][0]))
    h = jnp.tanh(jnp.einsum("bd,hde->bhe", h, p["w3"],
                            out_sharding=P("data", None, None) if explicit else None)).mean(1)
    h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h + p["bias"]), None), h, None, length=2)
    return jnp.mean(h**2)


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
        "w3": rng.normal(size=(L, D, D)).astype(np.float32) / 4,
        "bias": rng.normal(size=(D,)).astype(np.float32) / 10,
        "w2": rng.normal(size=(D, D)).astype(np.float32) / 4,  # a kernel of 2 dimensions
    }
    x_host = rng.normal(size=(B, D)).astype(np.float32)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    out = {}
    models: tuple[tuple[str, Callable[..., jax.Array]], ...] = (
        ("top_level", top_level),
        ("scanned", scanned),
        ("loop_bias", loop_bias),
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
    out["bytes"] = {k: int(v.nbytes) for k, v in host.items()}
    out["compound"] = compound_specs()
    emit(out)


def compound_specs() -> dict[str, Any]:
    """A parameter dimension sharded over the data and the model axis together, in both
    orders: ``("data", "model")`` and ``("model", "data")``, each device holding another block."""
    rng = np.random.default_rng(1)
    host = {name: rng.normal(size=(D, D)).astype(np.float32) / 4 for name in ("major", "minor")}
    specs = {"major": P(("data", "model"), None), "minor": P(("model", "data"), None)}
    x_host = rng.normal(size=(64, D)).astype(np.float32)

    def loss(p: Params, x: jax.Array) -> jax.Array:
        return jnp.mean(jnp.tanh(jnp.tanh(x @ p["major"]) @ p["minor"]) ** 2)

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(host, x_host)
    out = {}
    for kind, axis_type in (("auto", AxisType.Auto), ("explicit", AxisType.Explicit)):
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
        with jax.set_mesh(mesh):
            params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
            x = jax.device_put(x_host, NamedSharding(mesh, P("data")))
            fn = jax.jit(jaxaccum.value_and_grad(
                loss, num_microbatches=4, **accumulation_options(mesh, data_axis="data")))
            value, grads = fn(params, x)
            scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref_grads))
            out[kind] = {
                "grads_rel": max(float(np.max(np.abs(np.asarray(grads[k]) - ref_grads[k])))
                                 for k in grads) / scale,
                "loss_rel": abs(float(value) - float(ref_loss)) / abs(float(ref_loss)),
                "specs_kept": all(grads[k].sharding.spec == specs[k] for k in grads),
                "reductions": _hlo.gradient_reductions(hlo_text(fn.lower(params, x).compile()), 4),
            }
    return out


if __name__ == "__main__":
    main()
