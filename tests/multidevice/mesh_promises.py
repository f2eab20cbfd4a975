"""Promises on 8 host devices that the reference model (tests/multidevice/reference.py) does
not reach: carried state refused on Auto axes, ZeRO-3's per-micro-batch gather kept in the
loop, the micro-batch count of a data x model mesh, an Explicit-axis skip decided by one
device's NaN partial gradient, and an Explicit FSDP gradient reduce-scattered."""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._xla import hlo as _hlo

from .common import emit

B = 64
rng = np.random.default_rng(0)
PARAMS = {"w": rng.normal(size=(16, 32)).astype(np.float32) / 4,
          "v": rng.normal(size=(32, 8)).astype(np.float32) / 6}
X = rng.normal(size=(B, 16)).astype(np.float32)
Y = rng.normal(size=(B, 8)).astype(np.float32)


def mse(p: Any, x: Any, y: Any) -> Any:
    return jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2)


def loss(p: Any, b: Any) -> Any:
    return mse(p, b[0], b[1])


def root(p: Any, x: Any, y: Any) -> Any:  # a finite loss, NaN gradient at an all-zero example
    return mse(p, x, y) + jnp.mean(jnp.sqrt(jnp.abs(x @ p["w"][:, 0])))


def explicit_root_loss(p: Any, b: Any) -> Any:
    h = jnp.einsum("bd,dh->bh", b[0], p["w"], out_sharding=P("data", None))
    out = jnp.einsum("bh,ho->bo", jnp.tanh(h), p["v"], out_sharding=P("data", None))
    return jnp.mean((out - b[1]) ** 2) + jnp.mean(jnp.sqrt(jnp.abs(h[:, 0])))


def carry_loss(p: Any, b: Any, c: Any) -> Any:
    return loss(p, b), c + 1.0


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...], kind: AxisType) -> Any:
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def put(mesh: Any, tree: Any, spec: P) -> Any:
    return jax.device_put(tree, NamedSharding(mesh, spec))


def sgd_step(fn_loss: Any, params: Any, batch: Any, **kw: Any) -> tuple[float, Any, Any]:
    """One SGD(1) step: its gradient is params - new."""
    opt = optax.sgd(1.0)
    step = jaxaccum.train_step(fn_loss, opt, donate=False, **kw)
    new, _, value, info = step(params, opt.init(params), batch)
    grads = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                         params, new)
    return float(value), grads, info


def rel(grads: Any, x: Any, y: Any, f: Any = mse) -> float:
    ref = jax.grad(f)(PARAMS, x, y)
    return max(float(np.max(np.abs(grads[k] - np.asarray(ref[k])))) for k in ref) / max(
        float(np.max(np.abs(np.asarray(r)))) for r in ref.values())


def auto(out: dict[str, Any]) -> None:
    mesh = mesh_of((8,), ("data",), AxisType.Auto)
    with jax.set_mesh(mesh):
        try:
            jax.jit(jaxaccum.value_and_grad(carry_loss, num_microbatches=2, mesh=mesh,
                                            carry_argnums=2))(
                put(mesh, PARAMS, P()), put(mesh, (X, Y), P("data")), jnp.zeros(()))
            out["auto_carry_error"] = None
        except ValueError as e:
            out["auto_carry_error"] = f"{type(e).__name__}: {e}"
        # ZeRO-3: the gather of each FSDP kernel stays in the loop
        sharded = {k: put(mesh, v, P("data", None)) for k, v in PARAMS.items()}
        opt, zero3 = optax.sgd(0.1), {}
        for option in json.loads('["step", "microbatch"]'):  # as read from a config file
            dp = jaxaccum.DataParallel(mesh, fsdp=option)
            step = jaxaccum.train_step(loss, opt, num_microbatches=4, mesh=dp)
            compiled = step.lower(sharded, opt.init(sharded),
                                  put(mesh, (X, Y), P("data"))).compile()
            _, grads, _ = sgd_step(loss, sharded, put(mesh, (X, Y), P("data")),
                                   num_microbatches=4, mesh=dp)
            zero3[option] = {"counts": _hlo.collective_counts(compiled.as_text() or ""),
                             "temp": compiled.memory_analysis().temp_size_in_bytes,
                             "grads_rel": rel(grads, X, Y)}
        out["zero3"] = zero3
    mesh = mesh_of((4, 2), ("data", "model"), AxisType.Auto)  # k per device x 4 data devices
    with jax.set_mesh(mesh):
        _, grads, info = sgd_step(loss, put(mesh, PARAMS, P()), put(mesh, (X, Y), P("data")),
                                  num_microbatches=2,
                                  mesh=jaxaccum.DataParallel(mesh, data_axis="data"))
        out["data_model"] = {"num_microbatches": int(info.num_microbatches),
                             "grads_rel": rel(grads, X, Y)}


def explicit(out: dict[str, Any]) -> None:
    mesh = mesh_of((8,), ("data",), AxisType.Explicit)
    with jax.set_mesh(mesh):
        # a finite loss whose gradient is NaN only in the partial sum of the device holding
        # example 25 (micro-batch 1 of 2): every device must agree to skip it
        zero = X.copy()
        zero[25] = 0.0
        value, grads, info = sgd_step(explicit_root_loss, put(mesh, PARAMS, P()),
                                      put(mesh, (zero, Y), P("data")), num_microbatches=2,
                                      mesh=mesh, skip_nonfinite=True)
        out["explicit_skip_gradient"] = {"skipped": int(info.skipped),
                                         "weight": float(info.weight),
                                         "loss_finite": bool(np.isfinite(value)),
                                         "grads_rel": rel(grads, X[0::2], Y[0::2], root)}
        # FSDP ("step"): each kernel's gradient reduce-scattered once per step
        sharded = {k: put(mesh, v, P("data", None)) for k, v in PARAMS.items()}
        fn = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=4, mesh=mesh))
        batch = put(mesh, (X, Y), P("data"))
        _, grads = fn(sharded, batch)
        out["explicit_fsdp"] = {
            "counts": _hlo.collective_counts(fn.lower(sharded, batch).compile().as_text() or ""),
            "grads_rel": rel({k: np.asarray(v) for k, v in grads.items()}, X, Y)}


def main() -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    out: dict[str, Any] = {}
    auto(out)
    explicit(out)
    emit(out)


if __name__ == "__main__":
    main()
