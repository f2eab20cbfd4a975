"""What a micro-step adds into: gradient and weight sums, and the final division.

Shared by the scan path (:mod:`jaxaccum._accumulate`) and the per-call path
(:mod:`jaxaccum._multi_steps`), so both define a weighted mean, a skipped micro-batch and an
invalid weight the same way:

- a micro-batch with weight 0 adds nothing, not even a NaN from 0/0;
- a negative weight is invalid: a concrete one is rejected with a ``ValueError`` where it can be
  seen; a traced one makes the micro-batch's contribution NaN (never a silent wrong answer), so
  with ``skip_nonfinite`` it is left out and counted like any other non-finite micro-batch;
- a window whose total weight is 0 yields zeros (and the callers skip the optimizer step).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike


def leaf_dtype(x: Any) -> Any:
    """The dtype of an array, a ShapeDtypeStruct or a Python scalar (as JAX would make it)."""
    dtype = getattr(x, "dtype", None)
    return jnp.dtype(dtype) if dtype is not None else jnp.result_type(x)


def accumulator_dtype_for(dtype: DTypeLike, accumulator_dtype: DTypeLike | None) -> Any:
    """The dtype a gradient leaf of ``dtype`` is summed in: never narrower than the leaf."""
    if accumulator_dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
        return jnp.dtype(dtype)
    return jnp.promote_types(dtype, accumulator_dtype)


def zeros_accumulator(tree: Any, accumulator_dtype: DTypeLike | None) -> Any:
    """Zeros shaped like ``tree`` (arrays, ShapeDtypeStructs or Python scalars)."""
    return jax.tree.map(
        lambda x: jnp.zeros(jnp.shape(x), accumulator_dtype_for(leaf_dtype(x), accumulator_dtype)),
        tree,
    )


def cast_like(tree: Any, like: Any) -> Any:
    """Casts every leaf of ``tree`` to the dtype of the matching leaf of ``like``."""
    return jax.tree.map(lambda x, y: jnp.asarray(x).astype(leaf_dtype(y)), tree, like)


def safe_divide(tree: Any, total: jax.Array) -> Any:
    """``tree / total``, or zeros where ``total`` is 0 (a window with no valid example).

    A NaN total (an invalid weight was added) gives NaN, never a silent zero.
    """
    nonzero = total != 0
    denom = jnp.where(nonzero, total, 1)
    return jax.tree.map(lambda x: jnp.where(nonzero, x / denom.astype(x.dtype), 0), tree)


def all_finite(tree: Any) -> jax.Array:
    """A boolean scalar: whether every element of every leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def check_weight(weight: ArrayLike, what: str) -> None:
    """Rejects a concrete negative or non-finite weight (traced weights are checked on device)."""
    try:
        value = np.asarray(weight)
    except (TypeError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return  # traced: see valid_weight
    if value.dtype == object:
        return
    if np.any(value < 0) or not np.all(np.isfinite(value)):
        raise ValueError(
            f"{what} must be a finite count of valid items >= 0; got {what}={value.tolist()!r}"
        )


def valid_weight(weight: jax.Array) -> jax.Array:
    """The weight, or NaN where it is negative: an invalid weight poisons its micro-batch."""
    return jnp.where(weight >= 0, weight, jnp.nan)


def weighted_add(acc: jax.Array, g: ArrayLike, weight: jax.Array) -> jax.Array:
    """``acc + weight * g``, adding nothing (not even a NaN from 0/0) where ``weight`` is 0.

    A negative (invalid) weight adds NaN; see the module docstring.
    """
    term = jnp.where(weight == 0, 0, valid_weight(weight).astype(acc.dtype) * g)
    return (acc + term).astype(acc.dtype)


def add_weight(total: jax.Array, weight: jax.Array) -> jax.Array:
    """``total + weight``, NaN for an invalid (negative) weight, in ``total``'s dtype."""
    return (total + valid_weight(weight).astype(total.dtype)).astype(total.dtype)


def skip_if_nonfinite(weight: jax.Array, finite: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For ``skip_nonfinite``: the weight to use and whether the micro-batch is skipped.

    A micro-batch is skipped (weight 0, counted) when its weight is invalid (negative or NaN),
    or when it has a nonzero weight and a non-finite loss or gradient. A weight-0 micro-batch
    contributes nothing whatever its values (a 0/0 loss included) and is not counted.
    """
    skipped = jnp.logical_and(weight != 0, jnp.logical_not(jnp.logical_and(finite, weight > 0)))
    return jnp.where(skipped, jnp.zeros_like(weight), weight), skipped
