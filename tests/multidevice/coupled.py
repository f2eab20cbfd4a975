"""A batch-coupled (CLIP) loss on 8 host devices: data mesh and data x model mesh, Auto and
Explicit, against one device; the compiled step's gathers and gradient reductions."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._xla import hlo as _hlo

from .common import emit, hlo_text

B, D, H, E = 128, 16, 32, 8
Params = dict[str, Any]


def make_params() -> Params:
    rng = np.random.default_rng(0)
    tower = lambda: {"w1": (rng.normal(size=(D, H)) / 4).astype(np.float32),  # noqa: E731
                     "w2": (rng.normal(size=(H, E)) / 6).astype(np.float32)}
    return {"img": tower(), "txt": tower(), "log_t": np.asarray(1.5, np.float32)}


def apply_tower(p: Params, x: jax.Array) -> jax.Array:
    z = jnp.tanh(x @ p["w1"]) @ p["w2"]
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def encode(p: Params, batch: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    return apply_tower(p["img"], batch[0]), apply_tower(p["txt"], batch[1])


def clip_loss(p: Params, reps: tuple[jax.Array, jax.Array], batch: Any) -> jax.Array:
    z_img, z_txt = reps
    if jax.sharding.get_abstract_mesh().are_all_axes_explicit:  # the small (B, E) gathered
        z_txt = jax.reshard(z_txt, P())
    logits = z_img @ z_txt.T * jnp.exp(p["log_t"])
    eye = jnp.eye(logits.shape[0])  # the matching pairs, without a gather (Explicit meshes)
    a = -jnp.sum(jax.nn.log_softmax(logits, axis=1) * eye) / logits.shape[0]
    b = -jnp.sum(jax.nn.log_softmax(logits, axis=0) * eye) / logits.shape[0]
    return (a + b) / 2


def rel(a: Any, b: Any) -> float:
    diffs = [float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
    return max(diffs) / max(float(np.max(np.abs(np.asarray(y)))) for y in jax.tree.leaves(b))


def main() -> None:
    params = make_params()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, D)).astype(np.float32)
    batch = (x, (x + 0.3 * rng.normal(size=(B, D))).astype(np.float32))
    ref = jax.jit(jax.value_and_grad(lambda p, b: clip_loss(p, encode(p, b), b)))(params, batch)
    out: dict[str, Any] = {}
    meshes = {"data": ((8,), ("data",)), "data_model": ((4, 2), ("data", "model"))}
    for name, (shape, names) in meshes.items():
        for explicit in (False, True):
            kind = AxisType.Explicit if explicit else AxisType.Auto
            mesh = jax.make_mesh(shape, names, axis_types=(kind,) * len(names))
            with jax.set_mesh(mesh):
                p = jax.device_put(params, NamedSharding(mesh, P()))
                b = jax.device_put(batch, NamedSharding(mesh, P("data")))
                fn = jax.jit(jaxaccum.coupled_value_and_grad(
                    encode, clip_loss, num_microbatches=4,
                    mesh=jaxaccum.DataParallel(mesh, data_axis="data")))
                value, grads = fn(p, b)
                hlo = hlo_text(fn.lower(p, b).compile())
            counts = _hlo.collective_counts(hlo)
            ops = _hlo.collectives(hlo)
            out[f"{name}/{'explicit' if explicit else 'auto'}"] = {
                "loss_rel": abs(float(value) - float(ref[0])) / abs(float(ref[0])),
                "grads_rel": rel(grads, ref[1]),
                "reductions": _hlo.gradient_reductions(hlo, shape[0]),
                "gathers_in_loops": counts["all-gather in loops"],
                "collectives": [[op, loop, size] for op, loop, size, _ in ops],
                "reduced": _hlo.reduced_shapes(hlo),
                "param_shapes": [list(np.shape(x)) for x in jax.tree.leaves(params)],
                "param_bytes": sum(np.asarray(x).nbytes for x in jax.tree.leaves(params)),
                "reps_bytes": 2 * B * E * 4,
            }
    out["statistics_first"] = statistics_first_on_meshes()
    out["check"] = check_on_a_mesh(params, batch)
    emit(out)


def moe_stats(p: Params, batch: Any) -> dict[str, jax.Array]:
    """Tokens routed to each of 8 experts (top 2), summed over the micro-batch."""
    probs = jax.nn.softmax(batch[0] @ p["router"], axis=-1)
    top2 = jax.nn.one_hot(jax.lax.top_k(probs, 2)[1], 8).sum(1)
    return {"routed": top2.sum(0), "n": jnp.asarray(batch[0].shape[0], jnp.float32)}


def moe_loss(p: Params, batch: Any, totals: dict[str, jax.Array]) -> jax.Array:
    """Task loss plus the load balance with the whole batch's routed fractions."""
    x, y = batch
    probs = jax.nn.softmax(x @ p["router"], axis=-1)
    out = jnp.einsum("ne,neo->no", probs, jnp.einsum("nd,edo->neo", x, p["experts"]))
    f = totals["routed"] / (2 * totals["n"])
    return jnp.mean((out - y) ** 2) + 0.8 * jnp.sum(f * jnp.mean(probs, axis=0))


def statistics_first_on_meshes() -> dict[str, Any]:
    """Global MoE load balancing on the (8,) data mesh, Auto and Explicit: equal to one device;
    the statistics and the gradients each reduced once per step, nothing in the loops."""
    rng = np.random.default_rng(2)
    params = {"router": rng.normal(size=(D, 8)).astype(np.float32),
              "experts": (rng.normal(size=(8, D, 4)) / 4).astype(np.float32)}
    batch = (rng.normal(size=(B, D)).astype(np.float32),
             rng.normal(size=(B, 4)).astype(np.float32))
    ref = jax.jit(jax.value_and_grad(
        lambda p, b: moe_loss(p, b, jax.lax.stop_gradient(moe_stats(p, b)))))(params, batch)
    out: dict[str, Any] = {}
    for explicit in (False, True):
        kind = AxisType.Explicit if explicit else AxisType.Auto
        mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
        with jax.set_mesh(mesh):
            p = jax.device_put(params, NamedSharding(mesh, P()))
            b = jax.device_put(batch, NamedSharding(mesh, P("data")))
            fn = jax.jit(jaxaccum.statistics_first(moe_stats, moe_loss, num_microbatches=4,
                                                   mesh=mesh))
            value, grads = fn(p, b)
            hlo = hlo_text(fn.lower(p, b).compile())
        out["explicit" if explicit else "auto"] = {
            "loss_rel": abs(float(value) - float(ref[0])) / abs(float(ref[0])),
            "grads_rel": rel(grads, ref[1]),
            "collectives": [[op, loop, size] for op, loop, size, _ in _hlo.collectives(hlo)],
            "param_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
            "stats_bytes": 9 * 4,
        }
    return out


def check_on_a_mesh(params: Params, batch: Any) -> dict[str, Any]:
    """jaxaccum.check on Auto meshes, the (8,) ``data`` mesh and a (2, 4) mesh whose two axes
    both split the batch (``data_axis=("replica", "data")``: a reduction over all 8 devices
    is one over the data axes): jaxaccum's step, and a jit of a scan over micro-batches of the
    sharded batch (the partitioner reduces every micro-batch's gradient in the loop)."""
    k = 4

    def mse(p: Params, b: Any) -> jax.Array:  # a per-example loss
        z_img, z_txt = encode(p, b)
        return jnp.mean((z_img - z_txt) ** 2)

    def naive(p: Params, b: Any) -> tuple[jax.Array, Any]:
        # strided micro-batches, each still split over the devices (as jaxaccum's are)
        micro = jax.tree.map(
            lambda a: a.reshape(a.shape[0] // k, k, *a.shape[1:]).swapaxes(0, 1), b)

        def body(acc: Any, m: Any) -> tuple[Any, None]:
            value, g = jax.value_and_grad(mse)(p, m)
            return jax.tree.map(jnp.add, acc, (value, g)), None

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, p))
        total, _ = jax.lax.scan(body, zero, micro)
        return jax.tree.map(lambda t: t / k, total)

    out: dict[str, Any] = {}
    meshes = {"": ((8,), ("data",)), "two_axes_": ((2, 4), ("replica", "data"))}
    for prefix, (shape, names) in meshes.items():
        mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
        dp = jaxaccum.DataParallel(mesh, data_axis=names)
        with jax.set_mesh(mesh):
            p = jax.device_put(params, NamedSharding(mesh, P()))
            b = jax.device_put(batch, NamedSharding(mesh, P(names)))
            for name, step in (("jaxaccum", None), ("naive_scan", naive)):
                report = jaxaccum.check(mse, p, b, step=step, num_microbatches=k, mesh=dp)
                out[prefix + name] = {"ok": report.ok, "problems": report.problems,
                                      "reductions": report.reductions,
                                      "in_loops": report.reductions_in_loops}
    # ZeRO-3: fsdp="microbatch" reduce-scatters each micro-batch's gradient, by design
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    tower = {"w1": P("data", None), "w2": P("data", None)}
    specs = {"img": tower, "txt": tower, "log_t": P()}
    dp = jaxaccum.DataParallel(mesh, fsdp="microbatch", param_shardings=specs)
    with jax.set_mesh(mesh):
        p = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
        b = jax.device_put(batch, NamedSharding(mesh, P("data")))
        report = jaxaccum.check(mse, p, b, num_microbatches=k, mesh=dp)
    out["zero3"] = {"ok": report.ok, "problems": report.problems,
                    "in_loops": report.reductions_in_loops}
    return out


if __name__ == "__main__":
    main()
