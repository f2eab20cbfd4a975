"""Argument checks of :func:`jaxaccum.linear_cross_entropy`, at trace time."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxaccum import _context, _validation
from jaxaccum.contrastive import _tiles

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


Where = Literal["here", "axis", "mesh"]


def where(entry: str, name: Any, *arrays: Any) -> tuple[str | None, Where]:
    """The vocabulary's mesh axis (None or an axis name), and where the loss runs:

    - ``"here"``: as called (no mesh; or inside a ``jax.shard_map`` over the axis already);
    - ``"axis"``: in a ``shard_map`` over the axis, one of the context mesh's Auto axes;
    - ``"mesh"``: in a ``shard_map`` over every axis of the context mesh, whose axes are all
      Explicit, each array split as its type says.
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{entry}: axis_name must be a mesh axis name (a str) or None; got "
                        f"{name!r}")
    mesh = jax.sharding.get_abstract_mesh()
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True)) if not mesh.empty else {}
    explicit = jax.sharding.AxisType.Explicit
    if types.get(name) == explicit or any(a is not None and _explicitly_sharded(a)
                                          for a in arrays):
        if types and all(t == explicit for t in types.values()):
            return name, "mesh"
        raise NotImplementedError(
            f"{entry}: arrays sharded over Explicit axes of a mesh whose other axes are not "
            f"all Explicit ({dict((n, str(t)) for n, t in types.items())}) are not supported "
            "yet; make every axis of the mesh Explicit, or every one AxisType.Auto")
    if name is None:
        return None, "here"
    if types.get(name) == jax.sharding.AxisType.Auto:
        return name, "axis"
    try:
        jax.lax.axis_index(name)
    except NameError:
        raise ValueError(f"{entry}: axis_name={name!r} is neither an axis of the mesh in "
                         "context nor of a jax.shard_map this is called in: call it under "
                         "jax.set_mesh(mesh) (or in a jaxaccum step on that mesh) whose mesh has "
                         "that axis, with the weight's vocabulary sharded over it") from None
    return name, "here"


def token_axes(hidden: jax.Array, labels: jax.Array) -> set[str]:
    """The mesh axes the tokens are split over, as far as can be seen from inside a
    ``shard_map``: the running step's data axes (its ``shard_map`` does not type them) and the
    axes ``hidden`` or ``labels`` are typed varying over."""
    return {*_context.split_data_axes(), *_tiles.varying(hidden, labels)}


def tokens_whole(entry: str, name: str | None, axes: set[str]) -> None:
    """The tokens are not split over the vocabulary's axis ``name`` (``axes``: those they are
    split over): every device of it needs the same tokens, and a data axis named by mistake
    would split a vocabulary that every device holds whole."""
    if name is not None and name in axes:
        raise ValueError(
            f"{entry}: the tokens are split over axis_name={name!r}: it names the axis the "
            "vocabulary is split over (each device holding its slice of the weight and the "
            "same tokens), not a data axis; pass the vocabulary's axis, or None")


def layout(entry: str, name: str | None, vocab_axis: int, specs: dict[str, Any]) -> None:
    """On an Explicit mesh: the tokens not split over ``name``, the weight (and bias) split
    over ``name`` along the vocabulary only, and the hidden states' width not split."""
    def parts(spec: Any, ndim: int) -> tuple[Any, ...]:
        return (*spec.partitions, *(None,) * (ndim - len(spec.partitions)))

    hidden = parts(specs["hidden"], 2)
    tokens_whole(entry, name, {a for part in (hidden[0], *specs["labels"].partitions)
                               if part is not None
                               for a in (part if isinstance(part, tuple) else (part,))})
    weight = parts(specs["weight"], 2)
    shown = {k: P(*v.partitions) for k, v in specs.items()}  # (without jaxaccum's reduced)
    if name is None and weight != (None, None):
        raise ValueError(f"{entry}: on an Explicit mesh the weight's type says it is split "
                         f"({shown['weight']}): pass axis_name=<the axis its vocabulary is split "
                         "over>, or replicate it")
    if weight[vocab_axis] != name or weight[1 - vocab_axis] is not None:
        fix = (name, None) if vocab_axis == 0 else (None, name)
        raise ValueError(f"{entry}: on an Explicit mesh the weight (vocab_axis={vocab_axis}) "
                         f"must be split over axis_name={name!r} along its vocabulary only; its "
                         f"type says {shown['weight']}: shard it with PartitionSpec{fix}")
    if "bias" in specs and parts(specs["bias"], 1) != (name,):
        raise ValueError(f"{entry}: on an Explicit mesh the bias must be split as the weight's "
                         f"vocabulary, over {name!r}; its type says {shown['bias']}")
    if hidden[1] is not None:
        raise ValueError(f"{entry}: hidden's last axis (D) must not be split; its type says "
                         f"{shown['hidden']}: reshard it to PartitionSpec({hidden[0]!r}, None)")


def divides(entry: str, vocab: int, name: str) -> None:
    """The vocabulary splits evenly over the axis ``name`` of the context mesh."""
    size = jax.sharding.get_abstract_mesh().shape[name]
    if vocab % size:
        raise ValueError(f"{entry}: the vocabulary ({vocab}) must split evenly over axis_name="
                         f"{name!r} of size {size}; pad the weight's vocabulary axis to a "
                         f"multiple of {size} (labels never reach the padding)")
