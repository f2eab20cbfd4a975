"""The pipeline's placement hooks on 8 host devices: the README's mesh example, per-example aux
in batch order, skipped micro-batches and the micro-batch count on Auto meshes, ZeRO-3's
gather inside the loop, and skip_nonfinite on Explicit meshes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._xla import hlo as _hlo

from .common import emit, hlo_text, memory

B, D, H, OUT = 256, 64, 128, 16
Params = dict[str, Any]
rng = np.random.default_rng(0)
PARAMS = {"w1": (rng.normal(size=(D, H)) / 4).astype(np.float32),
          "b1": (rng.normal(size=(H,)) / 10).astype(np.float32),
          "w2": (rng.normal(size=(H, OUT)) / 8).astype(np.float32)}
X = rng.normal(size=(B, D)).astype(np.float32)
Y = rng.normal(size=(B, OUT)).astype(np.float32)


def forward(p: Params, x: jax.Array, explicit: bool, model: str | None = None) -> jax.Array:
    if explicit:  # a model written for Explicit axes
        h = jnp.einsum("bd,dh->bh", x, p["w1"], out_sharding=P("data", model))
        h = jnp.tanh(h + p["b1"])
        return jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P("data", None))
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def make_loss(explicit: bool, model: str | None = None) -> Any:
    def loss(p: Params, b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        out = forward(p, b[0], explicit, model)
        return jnp.mean((out - b[1]) ** 2), out[:, 0]

    return loss


def scalar_loss(explicit: bool, model: str | None = None) -> Any:
    """The loss without its aux."""
    loss = make_loss(explicit, model)
    return lambda p, b: loss(p, b)[0]


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...], explicit: bool) -> jax.sharding.Mesh:
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def put(mesh: jax.sharding.Mesh, specs: dict[str, P]) -> tuple[Params, Any]:
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in PARAMS.items()}
    return params, jax.device_put((X, Y), NamedSharding(mesh, P("data")))


def rel(a: Any, b: Any) -> float:
    diffs = [float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
    scale = max(float(np.max(np.abs(np.asarray(y)))) for y in jax.tree.leaves(b))
    return max(diffs) / scale


def readme_example() -> dict[str, Any]:
    """The README's mesh example: Explicit (4, 2) ("data", "model"), w1 P("data", "model"),
    w2 P("model", None), default fsdp="step", 3 Adam steps against one device."""
    opt = optax.adam(1e-2)
    mesh = mesh_of((4, 2), ("data", "model"), True)
    specs = {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", None)}
    single = jax.jit(jaxaccum.train_step(scalar_loss(False), opt,
                                         num_microbatches=4, donate=False))
    ref, state = dict(PARAMS), opt.init(PARAMS)
    for _ in range(3):
        ref, state, _, _ = single(ref, state, (X, Y))
    with jax.set_mesh(mesh):
        params, batch = put(mesh, specs)
        step = jaxaccum.train_step(
            scalar_loss(True, "model"), opt, num_microbatches=4,
            mesh=jaxaccum.DataParallel(mesh, data_axis="data", fsdp="step"))
        state = opt.init(params)
        for _ in range(3):
            params, state, loss, info = step(params, state, batch)
    kept = all(params[k].sharding.is_equivalent_to(NamedSharding(mesh, s), params[k].ndim)
               for k, s in specs.items())
    return {"rel": rel(params, ref), "kept": kept, "num_microbatches": int(info.num_microbatches)}


def concat_and_counts() -> dict[str, Any]:
    """has_aux="concat" in batch order on Auto and Explicit meshes; on an Auto (4, 2) data x
    model mesh the micro-batch count is k x the data devices (4), not x every device (8)."""
    (_, ref_out), _ = jax.value_and_grad(make_loss(False), has_aux=True)(PARAMS, (X, Y))
    out: dict[str, Any] = {}
    for explicit in (False, True):
        mesh = mesh_of((4, 2), ("data", "model"), explicit)
        with jax.set_mesh(mesh):
            params, batch = put(mesh, {"w1": P(None, "model"), "b1": P("model"), "w2": P()})
            fn = jax.jit(jaxaccum.value_and_grad(
                make_loss(explicit, "model"), num_microbatches=4, has_aux="concat",
                mesh=jaxaccum.DataParallel(mesh, "data")))
            (_, per_example), _ = fn(params, batch)
        name = "explicit" if explicit else "auto"
        out[f"concat_{name}"] = float(np.max(np.abs(np.asarray(per_example) - ref_out)))
        if not explicit:
            opt = optax.sgd(0.0)
            with jax.set_mesh(mesh):
                step = jaxaccum.train_step(scalar_loss(False), opt,
                                           num_microbatches=4, donate=False,
                                           mesh=jaxaccum.DataParallel(mesh, "data"))
                info = step(params, opt.init(params), batch)[3]
            out["num_microbatches_auto"] = int(info.num_microbatches)
    return out


def skipped() -> dict[str, Any]:
    """A NaN in example 37 at k = 4. On an Auto mesh each device scans its own share, so the
    micro-batch left out is device 1's local micro-batch 1 (examples 33, 37, ..., 61); on an
    Explicit mesh micro-batch 1 is one global array (examples 1, 5, 9, ...). Either way the
    result equals the batch without those examples, and one micro-batch is counted."""
    bad = X.copy()
    bad[37] = np.nan
    local = B // 8
    dropped = {"auto": [local + j for j in range(local) if j % 4 == 1],
               "explicit": [j for j in range(B) if j % 4 == 1]}

    def reference(name: str) -> Any:
        keep = np.setdiff1d(np.arange(B), dropped[name])
        return jax.value_and_grad(scalar_loss(False))(
            PARAMS, (X[keep], Y[keep]))

    out: dict[str, Any] = {}
    for explicit in (False, True):
        mesh = mesh_of((8,), ("data",), explicit)
        opt = optax.sgd(0.0)
        with jax.set_mesh(mesh):
            params, _ = put(mesh, {"w1": P(), "b1": P(), "w2": P()})
            batch = jax.device_put((bad, Y), NamedSharding(mesh, P("data")))
            loss_fn = scalar_loss(explicit)
            fn = jax.jit(jaxaccum.value_and_grad(
                loss_fn, num_microbatches=4, skip_nonfinite=True,
                mesh=mesh))
            loss, grads = fn(params, batch)
            red = _hlo.gradient_reductions(hlo_text(fn.lower(params, batch).compile()), 8)
            step = jaxaccum.train_step(loss_fn, opt, num_microbatches=4,
                                       skip_nonfinite=True, donate=False, mesh=mesh)
            info = step(params, opt.init(params), batch)[3]
        name = "explicit" if explicit else "auto"
        ref_loss, ref_grads = reference(name)
        out[name] = {"loss_rel": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                     "grads_rel": rel(grads, ref_grads), "skipped": int(info.skipped),
                     "reductions": red}
    return out


def recording(explicit: bool, seen: list[str]) -> Any:
    """``scalar_loss`` that notes how ``w1`` is split when it reaches it (Explicit axes)."""
    def loss(p: Params, b: Any) -> jax.Array:
        if explicit:
            seen.append(str(jax.typeof(p["w1"]).sharding.spec.partitions))
        return scalar_loss(explicit)(p, b)

    return loss


def zero3_in_loop() -> dict[str, Any]:
    """fsdp="microbatch" on an FSDP mesh, Auto and Explicit: the parameters' all-gather stays
    inside the loop (pinned), so temp stays below fsdp="step"'s; the gradient is the same."""
    out: dict[str, Any] = {}
    specs = {"w1": P("data", None), "b1": P(), "w2": P("data", None)}
    for explicit in (False, True):
        mesh = mesh_of((8,), ("data",), explicit)
        with jax.set_mesh(mesh):
            params, batch = put(mesh, specs)
            found: dict[str, Any] = {}
            for fsdp in ("step", "microbatch"):
                dp = jaxaccum.DataParallel(mesh, fsdp=fsdp,
                                           param_shardings=None if explicit else specs)
                seen: list[str] = []
                fn = jax.jit(jaxaccum.value_and_grad(recording(explicit, seen),
                                                     num_microbatches=8, mesh=dp))
                compiled = fn.lower(params, batch).compile()
                counts = _hlo.collective_counts(hlo_text(compiled))
                found[fsdp] = {"all_gather_in_loops": counts["all-gather in loops"],
                               "temp": memory(compiled).temp_size_in_bytes,
                               "grads": fn(params, batch)[1], "loss_sees_w1": sorted(set(seen))}
            found["grads_rel"] = rel(found["microbatch"].pop("grads"), found["step"].pop("grads"))
        out["explicit" if explicit else "auto"] = found
    return out


def main() -> None:
    emit({"readme": readme_example(), "concat": concat_and_counts(), "skipped": skipped(),
          "zero3": zero3_in_loop()})


if __name__ == "__main__":
    main()
