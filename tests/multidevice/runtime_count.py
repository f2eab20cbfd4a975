"""A traced number of micro-batches on 8 host devices (data mesh, Auto and Explicit axes):
every count equals one device, one compiled program serves all; the noise scale's micro-batch
norms are each device's own (Auto axes)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._xla import hlo as _hlo

from .common import emit, hlo_text, rel_diff

K, M, D = 4, 32, 16  # at most 4 micro-batches of 32 examples (4 per device)


def loss(w: dict[str, jax.Array], batch: Any) -> jax.Array:
    x, y = batch
    return jnp.mean((jnp.tanh(x @ w["a"]) @ w["b"] - y) ** 2)


def main() -> None:
    rng = np.random.default_rng(0)
    params = {"a": (rng.normal(size=(D, 8)) / 4).astype(np.float32),
              "b": (rng.normal(size=(8,)) / 3).astype(np.float32)}
    stack = (rng.normal(size=(K, M, D)).astype(np.float32),
             rng.normal(size=(K, M)).astype(np.float32))
    one = jax.jit(jaxaccum.value_and_grad(loss, max_microbatches=K))
    out: dict[str, Any] = {}
    for explicit in (False, True):
        kind = AxisType.Explicit if explicit else AxisType.Auto
        mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
        fn = jax.jit(jaxaccum.value_and_grad(loss, max_microbatches=K, mesh=mesh))
        diffs = []
        with jax.set_mesh(mesh):
            p = jax.device_put(params, NamedSharding(mesh, P()))
            s = jax.device_put(stack, NamedSharding(mesh, P(None, "data")))
            for count in range(1, K + 1):
                got = fn(p, jaxaccum.Microbatches(s, count))
                want = one(params, jaxaccum.Microbatches(stack, count))
                diffs.append(rel_diff(got, want))
            hlo = hlo_text(fn.lower(p, jaxaccum.Microbatches(s, 1)).compile())
            cache = fn._cache_size()  # type: ignore[attr-defined]
        out["explicit" if explicit else "auto"] = {
            "diffs": diffs, "programs": cache,
            "all_gathers": hlo.count(" all-gather("),
            "reductions": _hlo.gradient_reductions(hlo, 8),
        }
    out["noise"] = noise_per_device(params, stack)
    emit(out)


def noise_per_device(params: dict[str, Any], stack: Any) -> dict[str, float]:
    """On the Auto (8,) mesh the small batch is one device's share of a micro-batch (4
    examples): the estimate equals one device's on 32 micro-batches of 4 examples that are
    those shares."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    fn = jax.jit(jaxaccum.value_and_grad(loss, max_microbatches=K, mesh=mesh, noise_scale=True,
                                         return_info=True))
    with jax.set_mesh(mesh):
        s = jax.device_put(stack, NamedSharding(mesh, P(None, "data")))
        _, _, got = fn(jax.device_put(params, NamedSharding(mesh, P())),
                       jaxaccum.Microbatches(s, K))
    # device d holds examples [4d, 4d + 4) of every micro-batch: 32 small batches of 4
    shares = jax.tree.map(lambda a: a.reshape(K * 8, 4, *a.shape[2:]), stack)
    plain = jax.jit(jaxaccum.value_and_grad(loss, max_microbatches=K * 8, noise_scale=True,
                                            return_info=True))
    _, _, want = plain(params, jaxaccum.Microbatches(shares, K * 8))
    got, want = got.noise_scale, want.noise_scale
    return {"small": float(got.small_batch), "big": float(got.big_batch),
            "trace": float(got.trace), "trace_want": float(want.trace),
            "gradient_sq": float(got.gradient_sq), "gradient_sq_want": float(want.gradient_sq)}


if __name__ == "__main__":
    main()
