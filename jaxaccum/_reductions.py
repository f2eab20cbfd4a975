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

from collections.abc import Callable
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


def unless_empty(total: jax.Array, old: Any, new: Any) -> Any:
    """``new``, or ``old`` where the total weight is 0 (nothing to learn from: no step at all).

    A NaN total (an invalid weight) takes ``new``, so the NaN propagates: never a silent skip.
    The one rule for ``train_step`` and the Flax steps (``multi_steps`` makes it in its cond).
    """
    stepped = total != 0
    return jax.tree.map(lambda o, n: jnp.where(stepped, n, o), old, new)


def step_unless_empty(
    total: jax.Array, step: Callable[[Any], Any], old: Any, *, donated: bool
) -> Any:
    """``step(old)``, or ``old`` where the total weight is 0: :func:`unless_empty`'s rule.

    With donated inputs it is a ``lax.cond``: a select between the old and the new state would
    keep both alive (one more parameter- and optimizer-state-sized buffer), a conditional
    computes only the branch taken. Without donation it is the select: the new state is
    written straight to the outputs, while a conditional's results would need buffers of
    their own.
    """
    if donated:
        return jax.lax.cond(total != 0, step, lambda o: o, old)
    return unless_empty(total, old, step(old))


def skip_if_nonfinite(weight: jax.Array, finite: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For ``skip_nonfinite``: the weight to use and whether the micro-batch is skipped.

    A micro-batch is skipped (weight 0, counted) when its weight is invalid (negative or NaN),
    or when it has a nonzero weight and a non-finite loss or gradient. A weight-0 micro-batch
    contributes nothing whatever its values (a 0/0 loss included) and is not counted.
    """
    skipped = jnp.logical_and(weight != 0, jnp.logical_not(jnp.logical_and(finite, weight > 0)))
    return jnp.where(skipped, jnp.zeros_like(weight), weight), skipped


# --- aux values across micro-batches ------------------------------------------------------------

AUX_REDUCTIONS = ("stack", "sum", "mean", "weighted_mean", "max", "min", "last")


def aux_plan(aux_reduce: Any, aux: Any) -> list[str]:
    """One reduction name per leaf of ``aux`` (flattened), from a prefix tree of names.

    ``aux_reduce`` is a name from :data:`AUX_REDUCTIONS` for every leaf, or a pytree prefix
    of ``aux`` whose leaves are names (e.g. ``{"tokens": "sum", "logits": "stack"}``).
    """
    try:
        per_leaf = jax.tree.map(
            lambda name, sub: jax.tree.map(lambda _: name, sub),
            aux_reduce,
            aux,
            is_leaf=lambda x: isinstance(x, str),
        )
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"aux_reduce={aux_reduce!r} must be one of {AUX_REDUCTIONS} or a pytree prefix of "
            f"the aux value {jax.tree.structure(aux)} with those names as leaves: {error}"
        ) from None
    names = jax.tree.leaves(per_leaf, is_leaf=lambda x: isinstance(x, str))
    bad = sorted({n for n in names if n not in AUX_REDUCTIONS}, key=str)
    if bad:
        raise ValueError(
            f"aux_reduce: unknown reduction(s) {bad}; expected one of {AUX_REDUCTIONS}"
        )
    return names


def _extreme(dtype: Any, largest: bool) -> Any:
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.inf if largest else -jnp.inf
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return info.max if largest else info.min
    return largest


def aux_init(plan: list[str], leaves: list[Any]) -> list[Any]:
    """The accumulators of the reduced aux leaves (``None`` where a leaf is stacked)."""
    out: list[Any] = []
    for name, leaf in zip(plan, leaves, strict=True):
        shape, dtype = jnp.shape(leaf), leaf_dtype(leaf)
        if name == "stack":
            out.append(None)
        elif name in ("sum", "mean", "weighted_mean"):
            acc = jnp.promote_types(dtype, jnp.float32) if name != "sum" else dtype
            if name == "sum" and jnp.issubdtype(dtype, jnp.floating):
                acc = jnp.promote_types(dtype, jnp.float32)
            out.append(jnp.zeros(shape, acc))
        elif name == "max":
            out.append(jnp.full(shape, _extreme(dtype, largest=False), dtype))
        elif name == "min":
            out.append(jnp.full(shape, _extreme(dtype, largest=True), dtype))
        else:  # last
            out.append(jnp.zeros(shape, dtype))
    return out


def aux_update(
    plan: list[str], accs: list[Any], leaves: list[Any], weight: jax.Array
) -> tuple[list[Any], list[Any]]:
    """Adds one micro-batch's aux leaves: returns (new accumulators, the leaves to stack)."""
    new: list[Any] = []
    stacked: list[Any] = []
    for name, acc, x in zip(plan, accs, leaves, strict=True):
        x = jnp.asarray(x)
        stacked.append(x if name == "stack" else None)
        if name == "stack":
            new.append(None)
        elif name in ("sum", "mean"):
            new.append(acc + x.astype(acc.dtype))
        elif name == "weighted_mean":
            new.append(weighted_add(acc, x, weight))
        elif name == "max":
            new.append(jnp.maximum(acc, x))
        elif name == "min":
            new.append(jnp.minimum(acc, x))
        else:
            new.append(x.astype(acc.dtype))
    return new, stacked


def aux_finalize(
    plan: list[str], accs: list[Any], stacked: list[Any], leaves: list[Any], total: Any, k: int
) -> list[Any]:
    """The reduced (or stacked) aux leaves, cast back to the dtypes ``fun`` returned."""
    out = []
    for name, acc, ys, like in zip(plan, accs, stacked, leaves, strict=True):
        if name == "stack":
            out.append(ys)
        elif name == "mean":
            out.append((acc / k).astype(jnp.promote_types(leaf_dtype(like), jnp.float32)))
        elif name == "weighted_mean":
            out.append(safe_divide(acc, total))
        else:
            out.append(acc)
    return out
