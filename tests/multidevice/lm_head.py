"""``jaxaccum.linear_cross_entropy`` in a jaxaccum step on a (4, 2) data x model mesh of host
devices, the head's vocabulary sharded over "model" (the rest replicated, the batch over
"data"), Auto axes: loss and gradients against one device, and each device's compiled temp
beside one device's; the same with the head inside ``jax.shard_map`` over "model"
(``axis_name``: each device its slice of the vocabulary, no gather), and with ``axis_name``
called outside any ``shard_map`` (the loss splits the vocabulary itself, each device's slice
of the head gradient added into its slice of the accumulator), on Auto and on Explicit axes.
At a larger head (compiled, not run), each device's temp on (4, 2) and on (4, 1). Prints
``{"<way>/<axis type>": {...}, ..., "memory": {...}}``, a case's error in place of its
numbers."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._xla import hlo as _hlo

from .common import accumulation_options, emit, hlo_text, memory, rel_diff

V, D, T, K = 1_000, 16, 512, 4  # a vocabulary its chunk (96) does not divide


def loss(params: Any, batch: Any) -> Any:
    x, labels = batch
    hidden = jnp.tanh(x @ params["mix"])
    return jaxaccum.linear_cross_entropy(hidden, params["head"], labels, reduction="weighted",
                                         vocab_chunk=96, token_chunk=48, z_loss=1e-3,
                                         label_smoothing=0.1)


def split_loss() -> Any:
    """The loss with the head inside ``jax.shard_map`` over "model": each device its slice of
    the vocabulary (``axis_name="model"``), the slices combined over the axis."""
    def fun(params: Any, batch: Any) -> Any:
        x, labels = batch
        hidden = jnp.tanh(x @ params["mix"])
        head = functools.partial(
            jaxaccum.linear_cross_entropy, reduction="weighted", vocab_chunk=96,
            token_chunk=48, z_loss=1e-3, label_smoothing=0.1, axis_name="model")
        return jax.shard_map(head, in_specs=(P(), P("model", None), P()),
                             out_specs=(P(), P()), axis_names={"model"})(
            hidden, params["head"], labels)
    return fun


def wrap_loss(params: Any, batch: Any) -> Any:
    """The loss with ``axis_name="model"`` and no ``shard_map`` of the caller's: the loss
    splits the vocabulary over the context mesh's "model" axis itself."""
    x, labels = batch
    hidden = jnp.tanh(x @ params["mix"])
    return jaxaccum.linear_cross_entropy(hidden, params["head"], labels, reduction="weighted",
                                         vocab_chunk=96, token_chunk=48, z_loss=1e-3,
                                         label_smoothing=0.1, axis_name="model")


def kernel_loss(axis_name: str | None) -> Any:
    """A Flax ``Dense``-style head: a ``(D, V)`` kernel (``vocab_axis=1``) and a bias."""
    def fun(params: Any, batch: Any) -> Any:
        x, labels = batch
        return jaxaccum.linear_cross_entropy(
            jnp.tanh(x @ params["mix"]), params["kernel"], labels, bias=params["bias"],
            vocab_axis=1, reduction="weighted", vocab_chunk=96, token_chunk=48,
            axis_name=axis_name)
    return fun


def kernel_layout(params: Any, batch: Any, kind: AxisType) -> dict[str, Any]:
    """``axis_name`` called directly with a ``(D, V)`` kernel split over "model" on its second
    axis and a bias split with it, on (4, 2): against one device."""
    rng = np.random.default_rng(1)
    params = {"mix": params["mix"], "kernel": np.ascontiguousarray(params["head"].T),
              "bias": rng.normal(size=V).astype(np.float32)}
    ref = jax.jit(jaxaccum.value_and_grad(kernel_loss(None), num_microbatches=K,
                                          weighted=True))(params, batch)
    specs = {"mix": P(), "kernel": P(None, "model"), "bias": P("model")}
    return run_case(kernel_loss("model"), params, batch, ref, (4, 2), kind, specs)


def scaled_loss(axis_name: str | None) -> Any:
    """A LayerNorm-like scale before the head: a parameter that meets the batch-sharded
    activations elementwise (on Explicit axes jaxaccum reshards it, or falls back)."""
    def fun(params: Any, batch: Any) -> Any:
        x, labels = batch
        hidden = jnp.tanh(x @ params["mix"]) * params["scale"]
        return jaxaccum.linear_cross_entropy(hidden, params["head"], labels,
                                             reduction="weighted", vocab_chunk=96,
                                             token_chunk=48, axis_name=axis_name)
    return fun


def embedded_loss(lookup: str, axis_name: str | None = "model") -> Any:
    """An embedding looked up by indexing (``table[tokens]``, which JAX cannot do on a reduced
    table) or with ``.at[tokens].get(out_sharding=...)``, then the head over "model"."""
    def fun(params: Any, batch: Any) -> Any:
        tokens, labels = batch
        table = params["table"]
        hidden = (table[tokens] if lookup == "index" else
                  table.at[tokens].get(out_sharding=P("data", None)))
        return jaxaccum.linear_cross_entropy(jnp.tanh(hidden), params["head"], labels,
                                             reduction="weighted", vocab_chunk=96,
                                             token_chunk=48, axis_name=axis_name)
    return fun


def data_axis_loss(params: Any, batch: Any) -> Any:
    """``axis_name`` naming the data axis by mistake: refused, never a wrong loss."""
    x, labels = batch
    return jaxaccum.linear_cross_entropy(jnp.tanh(x @ params["mix"]), params["head"], labels,
                                         reduction="weighted", axis_name="data")


def more_models(params: Any, batch: Any, ref: Any) -> dict[str, Any]:
    """A scale before the head, an embedding, and the data axis named by mistake."""
    out: dict[str, Any] = {}
    rng = np.random.default_rng(2)
    scaled = {**params, "scale": rng.normal(size=D).astype(np.float32)}
    one = jax.jit(jaxaccum.value_and_grad(scaled_loss(None), num_microbatches=K,
                                          weighted=True))
    specs = {"mix": P(), "head": P("model", None), "scale": P()}
    tokens = rng.integers(0, V, T).astype(np.int32)
    embedded = {"table": scaled["head"] * 0.5, "head": params["head"]}
    for kind in (AxisType.Auto, AxisType.Explicit):
        name = kind.name.lower()
        out[f"scale/{name}"] = run_case(scaled_loss("model"), scaled, batch, one(scaled, batch),
                                        (4, 2), kind, specs)
        out[f"data-axis/{name}"] = run_case(data_axis_loss, params, batch, ref, (4, 2), kind,
                                            {"mix": P(), "head": P("model", None)})
        # (out_sharding names Explicit axes only)
        for lookup in ("index", "at") if kind == AxisType.Explicit else ("index",):
            fun = embedded_loss(lookup)
            want = jax.jit(jaxaccum.value_and_grad(embedded_loss("index", None),
                                                   num_microbatches=K,
                                                   weighted=True))(embedded, (tokens, batch[1]))
            out[f"embed-{lookup}/{name}"] = run_case(
                fun, embedded, (tokens, batch[1]), want, (4, 2), kind,
                {"table": P(), "head": P("model", None)})
    return out


def step_temp(fun: Any, shape: tuple[int, int], vocab: int, width: int, tokens: int,
              kind: AxisType = AxisType.Auto) -> int:
    """Each device's compiled temp of a k = 4 step of ``fun`` on a data x model mesh of
    ``shape`` (axes of type ``kind``), the head's vocabulary over "model"."""
    mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(kind,) * 2)
    params = {"mix": jax.ShapeDtypeStruct((width, width), jnp.float32,
                                          sharding=NamedSharding(mesh, P())),
              "head": jax.ShapeDtypeStruct((vocab, width), jnp.float32,
                                           sharding=NamedSharding(mesh, P("model", None)))}
    batch = (jax.ShapeDtypeStruct((tokens, width), jnp.float32,
                                  sharding=NamedSharding(mesh, P("data"))),
             jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=NamedSharding(mesh, P("data"))))
    with jax.set_mesh(mesh):
        step = jax.jit(jaxaccum.value_and_grad(fun, num_microbatches=K, weighted=True,
                                               **accumulation_options(mesh, "data")))
        return int(memory(step.lower(params, batch).compile()).temp_size_in_bytes)


def memory_at_size() -> dict[str, Any]:
    """V = 16,384, D = 256, 4,096 tokens: the head's float32 slice on a device of (4, 2) is
    8 MiB. Each device's temp with ``axis_name`` outside any shard_map ("wrap"), inside one of
    the caller's ("split"), on (4, 2), and with the whole vocabulary on each device (4, 1)."""
    vocab, width, tokens = 16_384, 256, 4_096

    def plain(params: Any, batch: Any) -> Any:
        return jaxaccum.linear_cross_entropy(jnp.tanh(batch[0] @ params["mix"]), params["head"],
                                             batch[1], reduction="weighted")

    def wrap(params: Any, batch: Any) -> Any:
        return jaxaccum.linear_cross_entropy(jnp.tanh(batch[0] @ params["mix"]), params["head"],
                                             batch[1], reduction="weighted", axis_name="model")

    def split(params: Any, batch: Any) -> Any:
        head = functools.partial(jaxaccum.linear_cross_entropy, reduction="weighted",
                                 axis_name="model")
        return jax.shard_map(head, in_specs=(P(), P("model", None), P()),
                             out_specs=(P(), P()), axis_names={"model"})(
            jnp.tanh(batch[0] @ params["mix"]), params["head"], batch[1])

    sizes = (vocab, width, tokens)
    return {"slice_bytes": vocab // 2 * width * 4,
            "wrap_4x2": step_temp(wrap, (4, 2), *sizes),
            "wrap_4x2_explicit": step_temp(wrap, (4, 2), *sizes, kind=AxisType.Explicit),
            "split_4x2": step_temp(split, (4, 2), *sizes),
            "plain_4x1": step_temp(plain, (4, 1), *sizes)}


def run_case(fun: Any, params: Any, batch: Any, ref: Any, shape: tuple[int, int],
             kind: AxisType, specs: dict[str, Any]) -> dict[str, Any]:
    """A k = 4 step of ``fun`` on a data x model mesh of ``shape`` and axis type ``kind``
    (parameters split as ``specs``, the batch over "data") against one device's ``ref``, or
    the error it raised (each case's own: the others still run)."""
    mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(kind, kind))
    with jax.set_mesh(mesh):
        p = {n: jax.device_put(v, NamedSharding(mesh, specs[n])) for n, v in params.items()}
        b = jax.device_put(batch, NamedSharding(mesh, P("data")))
        step = jax.jit(jaxaccum.value_and_grad(fun, num_microbatches=K, weighted=True,
                                               **accumulation_options(mesh, "data")))
        try:
            got = step(p, b)
            compiled = step.lower(p, b).compile()
        except Exception as error:  # noqa: BLE001
            return {"error": f"{type(error).__name__}: {error}"}
    return {"rel": rel_diff(got, ref), "temp": memory(compiled).temp_size_in_bytes,
            "all_gather_bytes": max([size for op, _, size, _ in
                                     _hlo.collectives(hlo_text(compiled))
                                     if op == "all-gather"], default=0),
            "grad_shardings": {n: str(g.sharding.spec) for n, g in got[1].items()}}


def main() -> None:
    rng = np.random.default_rng(0)
    params = {"mix": (rng.normal(size=(D, D)) / 4).astype(np.float32),
              "head": (rng.normal(size=(V, D)) / 4).astype(np.float32)}
    labels = rng.integers(0, V, T)
    labels[rng.random(T) < 0.3] = -100
    batch = (rng.normal(size=(T, D)).astype(np.float32), labels.astype(np.int32))
    one = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=K, weighted=True))
    ref = one(params, batch)
    out: dict[str, Any] = {
        "one_device_temp": memory(one.lower(params, batch).compile()).temp_size_in_bytes}
    specs = {"mix": P(), "head": P("model", None)}
    for kind in (AxisType.Auto, AxisType.Explicit):
        name = kind.name.lower()
        for way, fun in (("plain", loss), ("split", split_loss()), ("wrap", wrap_loss)):
            out[f"{way}/{name}"] = run_case(fun, params, batch, ref, (4, 2), kind, specs)
        # one data device and the vocabulary over all eight (tensor parallelism alone)
        out[f"wrap-1x8/{name}"] = run_case(wrap_loss, params, batch, ref, (1, 8), kind, specs)
        out[f"wrap-kernel/{name}"] = kernel_layout(params, batch, kind)
    out["split-1x8/auto"] = run_case(split_loss(), params, batch, ref, (1, 8),
                                     AxisType.Auto, specs)
    out.update(more_models(params, batch, ref))
    out["memory"] = memory_at_size()
    emit(out)

if __name__ == "__main__":
    main()
