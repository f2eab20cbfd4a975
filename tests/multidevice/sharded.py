"""Sharded training on 8 host devices: every mesh case of ``tests/test_sharded.py``.

Meshes: (8,) data; (4, 2) data x model with tensor-parallel kernels; (8,) FSDP (kernels
sharded over the data axis); (2, 4) data x fsdp with ``data_axis=("data", "fsdp")``; and the
FSDP + TP cases: (4, 2) data x model with kernels sharded over both axes, (8, 1) data x model
with FSDP kernels. Each on an Auto and an Explicit mesh (the Explicit model writes its
contractions with ``out_sharding=``). Prints ``{"<mesh>/<axis type>/<fsdp>/<k>": {...}}``.
"""

from __future__ import annotations

import itertools
import re
import traceback
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._xla import hlo as _hlo

from .common import accumulation_options, emit, hlo_text, memory

# per device, activations (0.5 MB) outweigh parameters (0.3 MB)
B, D, H, OUT = 2048, 64, 512, 16
TRAIN_STEPS = 3

Params = dict[str, Any]
Batch = tuple[Any, Any]
Loss = Callable[[Params, Batch], jax.Array]


class MeshCase(NamedTuple):
    shape: tuple[int, ...]
    names: tuple[str, ...]
    data_axes: tuple[str, ...]
    specs: dict[str, P]
    ks: tuple[int, ...] = (1, 4, 16)
    fsdp_modes: tuple[str, ...] = ("step",)
    # The FSDP + TP cases: run even if the library fails on them (the error is reported),
    # measured for all-gathers over the model axis, without the unnamed-shardings variant.
    guarded: bool = False


BOTH = ("step", "microbatch")
MESHES = {
    "data": MeshCase((8,), ("data",), ("data",), {"w1": P(), "b1": P(), "w2": P()}),
    "data_model": MeshCase(
        (4, 2),
        ("data", "model"),
        ("data",),
        {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)},
    ),
    "fsdp": MeshCase(
        (8,),
        ("data",),
        ("data",),
        {"w1": P("data", None), "b1": P(), "w2": P("data", None)},
        fsdp_modes=BOTH,
    ),
    "data_fsdp": MeshCase(
        (2, 4),
        ("data", "fsdp"),
        ("data", "fsdp"),
        {"w1": P("fsdp", None), "b1": P("fsdp"), "w2": P("fsdp", None)},
        fsdp_modes=BOTH,
    ),
    "fsdp_model": MeshCase(
        (4, 2),
        ("data", "model"),
        ("data",),
        {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data")},
        ks=(1, 4),
        fsdp_modes=BOTH,
        guarded=True,
    ),
    "fsdp_8x1": MeshCase(
        (8, 1),
        ("data", "model"),
        ("data",),
        {"w1": P("data", None), "b1": P(), "w2": P("data", None)},
        ks=(1, 4),
        fsdp_modes=BOTH,
        guarded=True,
    ),
}


def make_data() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(D, H)).astype(np.float32) / 4,
        "b1": rng.normal(size=(H,)).astype(np.float32) / 10,
        "w2": rng.normal(size=(H, OUT)).astype(np.float32) / 8,
    }
    x = rng.normal(size=(B, D)).astype(np.float32)
    y = rng.normal(size=(B, OUT)).astype(np.float32)
    return params, x, y


def make_loss(explicit: bool, data_axes: tuple[str, ...], model: str | None) -> Loss:
    batch_axes: str | tuple[str, ...] = data_axes if len(data_axes) > 1 else data_axes[0]

    def loss(p: Params, b: Batch) -> jax.Array:
        x, y = b
        if explicit:  # a model written for Explicit axes
            h = jnp.einsum("bd,dh->bh", x, p["w1"], out_sharding=P(batch_axes, model))
            h = jnp.tanh(h + p["b1"])
            out = jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P(batch_axes, None))
        else:
            out = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
        return jnp.mean((out - y) ** 2)

    return loss


def plain_loss(p: Params, b: Batch) -> jax.Array:
    x, y = b
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)


def data_groups(mesh: Mesh, data_axes: tuple[str, ...]) -> set[int]:
    """Device counts of every nonempty subset of the data axes."""
    return {
        int(np.prod([mesh.shape[a] for a in sub]))
        for r in range(1, len(data_axes) + 1)
        for sub in itertools.combinations(data_axes, r)
    }


def same_sharding(tree: Any, specs: Any, mesh: Mesh) -> bool:
    leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    return all(
        a.sharding.is_equivalent_to(NamedSharding(mesh, s), a.ndim)
        for a, s in zip(jax.tree.leaves(tree), leaves, strict=True)
    )


# -- replica groups as mesh axes (for "no all-gather over the model axis") --------------------

_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LISTED = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_NAMED = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def replica_groups(line: str, num_devices: int) -> list[list[int]] | list[str]:
    """The replica groups of one collective: lists of device (partition) ids, or, for the
    ``mesh[...] {...}`` form, the names of the axes it runs over."""
    named = _NAMED.search(line)
    if named:
        return re.findall(r"'([^']+)'", named.group(2))
    iota = _IOTA.search(line)
    if iota:
        shape = [int(n) for n in iota.group(1).split(",")]
        ids = np.arange(num_devices).reshape([int(n) for n in iota.group(2).split(",")])
        if iota.group(3):
            ids = ids.transpose([int(n) for n in iota.group(3).split(",")])
        return [list(map(int, g)) for g in ids.reshape(shape)]
    listed = _LISTED.search(line)
    if listed and listed.group(1):
        groups = re.findall(r"\{([\d,]*)\}", listed.group(1))
        return [[int(i) for i in g.split(",") if i] for g in groups]
    return [list(range(num_devices))]  # replica_groups={}: every device


def group_axes(line: str, mesh: Mesh) -> set[str]:
    """The mesh axes along which the devices of a collective's replica groups differ.

    Partition p is device ``mesh.devices.flat[p]``: its coordinates unravel p in the mesh's
    shape. The ``mesh[...]`` form names XLA's axes ``axis_0, axis_1, ...``, in mesh order."""
    groups = replica_groups(line, mesh.devices.size)
    names = list(mesh.axis_names)
    axes: set[str] = set()
    for group in groups:
        if isinstance(group, str):
            index = int(group.rsplit("_", 1)[-1]) if group.startswith("axis_") else None
            axes.add(str(names[index]) if index is not None else group)
            continue
        coords = np.array(np.unravel_index(group, mesh.devices.shape)).T
        for i, name in enumerate(names):
            if mesh.shape[name] > 1 and len(set(coords[:, i].tolist())) > 1:
                axes.add(str(name))
    return axes


def all_gathers_over(hlo: str, mesh: Mesh, axis: str) -> list[int]:
    """The result bytes of every all-gather whose replica groups span ``axis``."""
    found = []
    for lines in _hlo.computations(hlo).values():
        for line in lines:
            if re.search(r"\sall-gather(?:-start)?\(", line) and axis in group_axes(line, mesh):
                found.append(_hlo._result_bytes(line, "all-gather"))
    return found


# -- the cases --------------------------------------------------------------------------------


class Reference(NamedTuple):
    loss: float
    grads: Params
    scale: float
    trajectory: dict[str, np.ndarray]  # TRAIN_STEPS Adam steps on the full batch


def reference(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> Reference:
    loss, grads = jax.jit(jax.value_and_grad(plain_loss))(params, (x, y))
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))
    opt = optax.adam(1e-2)

    @jax.jit
    def step(p: Params, s: Any) -> tuple[Params, Any]:
        updates, s = opt.update(jax.grad(plain_loss)(p, (x, y)), s, p)
        return optax.apply_updates(p, updates), s

    p: Params = dict(params)
    state = opt.init(p)
    for _ in range(TRAIN_STEPS):
        p, state = step(p, state)
    return Reference(float(loss), grads, scale, {k: np.asarray(v) for k, v in p.items()})


def grads_rel(grads: Any, ref: Reference) -> float:
    diffs = (
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref.grads), strict=True)
    )
    return max(diffs) / ref.scale


def run_mode(
    out: dict[str, Any],
    key: str,
    case: MeshCase,
    mesh: Mesh,
    explicit: bool,
    fsdp: str,
    params: Params,
    batch: Batch,
    ref: Reference,
    base: dict[str, Any],
) -> None:
    """One mesh, axis type and fsdp option: value_and_grad at each k, then train_step."""
    model = "model" if "model" in case.names else None
    loss = make_loss(explicit, case.data_axes, model)
    groups = data_groups(mesh, case.data_axes)
    for k in case.ks:
        # Auto axes under our own jit: tracers carry no sharding, so we name them
        options = accumulation_options(mesh, case.data_axes, fsdp, None if explicit else case.specs)
        fn = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k, **options))
        compiled = fn.lower(params, batch).compile()
        value, grads = compiled(params, batch)
        ma = memory(compiled)
        hlo = hlo_text(compiled)
        out[f"{key}/{k}"] = {
            "loss_rel": abs(float(value) - ref.loss) / abs(ref.loss),
            "grads_rel": grads_rel(grads, ref),
            "grad_shardings_kept": same_sharding(grads, case.specs, mesh),
            "reductions": _hlo.gradient_reductions(hlo, groups),
            "counts": _hlo.collective_counts(hlo),
            "temp": ma.temp_size_in_bytes,
            "argument": ma.argument_size_in_bytes,
            "plain": base,
        }
        if model is not None:
            out[f"{key}/{k}"]["model_all_gathers"] = all_gathers_over(hlo, mesh, model)
    if not explicit and not case.guarded:  # without param_shardings: FSDP leaves gathered
        options = accumulation_options(mesh, case.data_axes, fsdp)
        fn = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=4, **options))
        value, grads = fn(params, batch)
        out[f"{key}/unnamed"] = {
            "loss_rel": abs(float(value) - ref.loss) / abs(ref.loss),
            "grads_rel": grads_rel(grads, ref),
        }
    opt = optax.adam(1e-2)
    options = accumulation_options(mesh, case.data_axes, fsdp)
    step = jaxaccum.train_step(loss, opt, num_microbatches=4, **options)
    p = jax.tree.map(jnp.copy, params)
    state = opt.init(p)
    train_compiled = step.lower(p, state, batch).compile()
    state_specs = jax.tree.map(lambda a: a.sharding.spec, state)
    for _ in range(TRAIN_STEPS):
        p, state, _, _ = step(p, state, batch)
    hlo = hlo_text(train_compiled)
    out[f"{key}/train"] = {
        "params_kept": same_sharding(p, case.specs, mesh),
        "state_kept": same_sharding(state, state_specs, mesh),
        "temp": memory(train_compiled).temp_size_in_bytes,
        "reductions": _hlo.gradient_reductions(hlo, groups),
        "params_rel": max(float(np.max(np.abs(np.asarray(p[k]) - ref.trajectory[k]))) for k in p)
        / max(float(np.max(np.abs(v))) for v in ref.trajectory.values()),
    }
    if model is not None:
        out[f"{key}/train"]["model_all_gathers"] = all_gathers_over(hlo, mesh, model)


def run_mesh(
    out: dict[str, Any],
    name: str,
    case: MeshCase,
    axis_type: str,
    arrays: tuple[dict[str, np.ndarray], np.ndarray, np.ndarray],
    ref: Reference,
) -> None:
    explicit = axis_type == "explicit"
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh(case.shape, case.names, axis_types=(kind,) * len(case.names))
    host_params, x, y = arrays
    with jax.set_mesh(mesh):
        params = {
            k: jax.device_put(v, NamedSharding(mesh, case.specs[k])) for k, v in host_params.items()
        }
        batch_axes = case.data_axes if len(case.data_axes) > 1 else case.data_axes[0]
        batch = jax.device_put((x, y), NamedSharding(mesh, P(batch_axes)))
        loss = make_loss(explicit, case.data_axes, "model" if "model" in case.names else None)

        def gathered_loss(p: Params, b: Batch) -> jax.Array:
            """The plain-jit baseline gathers FSDP leaves itself."""
            if explicit:
                p = jax.tree.map(
                    lambda a, s: jax.reshard(a, P(*[e if e == "model" else None for e in s])),
                    p,
                    case.specs,
                )
            return loss(p, b)

        plain = jax.jit(jax.value_and_grad(gathered_loss)).lower(params, batch).compile()
        base = {
            "temp": memory(plain).temp_size_in_bytes,
            "reductions": _hlo.gradient_reductions(
                hlo_text(plain), data_groups(mesh, case.data_axes)
            ),
            "largest_param": max(v.nbytes for v in host_params.values()),
        }
        for fsdp in case.fsdp_modes:
            key = f"{name}/{axis_type}/{fsdp}"
            try:
                run_mode(out, key, case, mesh, explicit, fsdp, params, batch, ref, base)
            except Exception as e:
                if not case.guarded:
                    raise
                message = f"{type(e).__name__}: {e}".splitlines()[0][:500]
                out[f"{key}/error"] = {
                    "error": message,
                    "where": traceback.format_exc().splitlines()[-3:],
                }


def main(meshes: Collection[str] = tuple(MESHES)) -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    arrays = make_data()
    ref = reference(*arrays)
    out: dict[str, Any] = {}
    for name in meshes:
        for axis_type in ("auto", "explicit"):
            run_mesh(out, name, MESHES[name], axis_type, arrays, ref)
    emit(out)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:] or tuple(MESHES))
