"""Argument checks of :func:`jaxaccum.linear_cross_entropy`, at trace time."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import _validation

REDUCTIONS = ("mean", "sum", "none", "weighted")


def _floating(entry: str, name: str, x: Any) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{entry}: {name} must be floating; got dtype {x.dtype}: pass "
                        f"{name}.astype(jnp.float32) (or bfloat16)")
    return x


def arrays(entry: str, hidden: Any, weight: Any, labels: Any, bias: Any, weights: Any,
           vocab_axis: Any) -> tuple[jax.Array, jax.Array, jax.Array, Any, Any]:
    """The arrays, checked for dtype and for shapes that fit together."""
    if vocab_axis not in (0, 1) or isinstance(vocab_axis, bool):
        raise ValueError(f"{entry}: vocab_axis must be 0 (weight of shape (V, D)) or 1 "
                         f"((D, V)); got {vocab_axis!r}")
    hidden, weight = _floating(entry, "hidden", hidden), _floating(entry, "weight", weight)
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{entry}: labels must be integers (class indices); got dtype "
                        f"{labels.dtype}: pass labels.astype(jnp.int32)")
    if hidden.ndim < 1 or weight.ndim != 2 or labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"{entry}: expected hidden (..., D), weight 2-D and labels of shape "
            f"hidden.shape[:-1]; got hidden {hidden.shape}, weight {weight.shape}, labels "
            f"{labels.shape}")
    width = hidden.shape[-1]
    if weight.shape[1 - vocab_axis] != width:
        fits = (f"; weight {weight.shape} fits with vocab_axis={1 - vocab_axis}"
                if weight.shape[vocab_axis] == width else "")
        raise ValueError(
            f"{entry}: weight {weight.shape} with vocab_axis={vocab_axis} needs D = "
            f"{weight.shape[1 - vocab_axis]} on hidden's last axis; got hidden "
            f"{hidden.shape}{fits}")
    vocab = weight.shape[vocab_axis]
    if bias is not None:
        bias = _floating(entry, "bias", bias)
        if bias.shape != (vocab,):
            raise ValueError(f"{entry}: bias must have shape (V,) = ({vocab},); got {bias.shape}")
    if weights is not None:
        weights = jnp.asarray(weights)
        if weights.shape != labels.shape:
            raise ValueError(f"{entry}: weights must have the shape of labels {labels.shape}; "
                             f"got {weights.shape}")
    if vocab == 0:
        raise ValueError(f"{entry}: the vocabulary is empty (weight {weight.shape})")
    return hidden, weight, labels, bias, weights


def _explicitly_sharded(x: jax.Array) -> bool:
    """Whether ``x``'s type is sharded over an Explicit mesh axis."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return False
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                if t == jax.sharding.AxisType.Explicit}
    used: set[Any] = set()
    spec = getattr(sharding, "spec", None)
    for part in getattr(spec, "partitions", ()):
        used.update(part if isinstance(part, tuple) else (part,))
    return bool(explicit & used)


def not_explicit(entry: str, *arrays: Any) -> None:
    """Refuses arrays sharded over Explicit mesh axes (not supported yet)."""
    if any(a is not None and _explicitly_sharded(a) for a in arrays):
        raise NotImplementedError(
            f"{entry}: arrays sharded over Explicit mesh axes are not supported yet; use a "
            "mesh of AxisType.Auto axes (jax.make_mesh(..., axis_types=(AxisType.Auto, ...))),"
            " or call it outside the mesh")


def chunk(entry: str, value: Any, name: str) -> int:
    """A chunk size: a positive int."""
    return _validation.positive_int(value, name, entry)


def coefficients(entry: str, label_smoothing: Any, z_loss: Any) -> tuple[float, float]:
    """The loss's coefficients as Python floats, in range."""
    values = []
    for name, value, low, high in (("label_smoothing", label_smoothing, 0.0, 1.0),
                                   ("z_loss", z_loss, 0.0, np.inf)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
            raise TypeError(f"{entry}: {name} must be a Python float (it decides the program); "
                            f"got {value!r} of type {type(value).__name__}")
        if not low <= value < high:
            raise ValueError(f"{entry}: {name} must be in [{low}, {high}); got {value}")
        values.append(float(value))
    return values[0], values[1]


def reduction(entry: str, value: Any) -> None:
    if value not in REDUCTIONS:
        raise ValueError(f"{entry}: reduction must be one of {REDUCTIONS}; got {value!r}")


def axis(entry: str, name: Any) -> tuple[str | None, bool]:
    """The vocabulary's mesh axis (None or an axis name), and whether this call must split the
    vocabulary over it itself (the axis is one of the context mesh's, not yet manual) rather than
    being inside a ``jax.shard_map`` over it already."""
    if name is None:
        return None, False
    if not isinstance(name, str):
        raise TypeError(f"{entry}: axis_name must be a mesh axis name (a str) or None; got "
                        f"{name!r}")
    mesh = jax.sharding.get_abstract_mesh()
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True)) if not mesh.empty else {}
    if types.get(name) == jax.sharding.AxisType.Explicit:
        raise NotImplementedError(
            f"{entry}: axis_name={name!r} is an Explicit axis of the mesh in context; a "
            "vocabulary split over Explicit axes is not supported yet: make the mesh's axes "
            "AxisType.Auto (jax.make_mesh(..., axis_types=(AxisType.Auto, ...)))")
    if types.get(name) == jax.sharding.AxisType.Auto:
        return name, True
    try:
        jax.lax.axis_index(name)
    except NameError:
        raise ValueError(f"{entry}: axis_name={name!r} is neither an axis of the mesh in "
                         "context nor of a jax.shard_map this is called in: call it under "
                         "jax.set_mesh(mesh) (or in a jaxaccum step on that mesh) whose mesh has "
                         "that axis, with the weight's vocabulary sharded over it") from None
    return name, False


def divides(entry: str, vocab: int, name: str) -> None:
    """The vocabulary splits evenly over the axis ``name`` of the context mesh."""
    size = jax.sharding.get_abstract_mesh().shape[name]
    if vocab % size:
        raise ValueError(f"{entry}: the vocabulary ({vocab}) must split evenly over axis_name="
                         f"{name!r} of size {size}; pad the weight's vocabulary axis to a "
                         f"multiple of {size} (labels never reach the padding)")
