"""What a micro-step adds into: gradient and weight sums, and the final division.

Shared by the scan path (:mod:`jaxaccum._pipeline`) and the per-call path
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
from typing import Any, Literal, NamedTuple

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


def divide(tree: Any, total: jax.Array) -> Any:
    """``tree / total`` as a multiply by the scalar ``1 / total``: XLA fuses a multiply into
    every consumer (the optimizer's update reads the gradient in several fusions) where it
    would materialise a division, an expensive op it does not duplicate: the difference is one
    gradient-sized buffer. Within 1 ulp of the division (exact when ``total`` is a power of 2).
    """
    return jax.tree.map(lambda x: x * (1 / total).astype(x.dtype), tree)


def safe_divide(tree: Any, total: jax.Array) -> Any:
    """``tree / total`` (as :func:`divide`), or zeros where ``total`` is 0 (a window with no
    valid example). A NaN total (an invalid weight was added) gives NaN, never a silent zero.
    """
    nonzero = total != 0
    inverse = 1 / jnp.where(nonzero, total, 1)
    return jax.tree.map(lambda x: jnp.where(nonzero, x * inverse.astype(x.dtype), 0), tree)


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
    if np.any(value < 0) or not np.all(np.isfinite(value)):
        raise ValueError(
            f"{what} must be a finite count of valid items >= 0; got {what}={value.tolist()!r}; "
            "pass the micro-batch's count of valid items (0 leaves it out)"
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
    total: jax.Array, step: Callable[[Any], Any], old: Any, *, donated: bool,
    may_be_empty: bool = True,
) -> Any:
    """``step(old)``, or ``old`` where the total weight is 0: :func:`unless_empty`'s rule, the
    one every train step (jaxaccum's, NNX's, linen's) applies: a step of total weight 0
    changes nothing. ``may_be_empty`` False (no weights, no skipping, no runtime count: every
    total is nonzero) is ``step(old)`` with no test at all.

    With donated inputs it is a ``lax.cond``: a select between the old and the new state would
    keep both alive (one more parameter- and optimizer-state-sized buffer), a conditional
    computes only the branch taken. Without donation it is the select: the new state is
    written straight to the outputs, while a conditional's results would need buffers of
    their own.
    """
    if not may_be_empty:
        return step(old)
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


class AuxReduction(NamedTuple):
    """How one aux leaf is combined across micro-batches (one record per name).

    Attributes:
      stacked: the scan stacks the leaf (a new leading axis of length k) instead of carrying
        an accumulator.
      init: ``(shape, dtype) -> accumulator`` before the first micro-batch.
      update: ``(accumulator, value, weight) -> accumulator``.
      combine: ``(accumulator, axes) -> accumulator`` across data-parallel devices (inside a
        ``shard_map`` manual over ``axes``).
      finalize: ``(accumulator or stacked values, total weight, kept) -> value``; ``kept`` is
        the number of micro-batches evaluated and not skipped (0 gives 0 for a mean).
      per_example: the leaf holds one value per example, given back in the batch's order:
        a stacked leaf kept ``(m, k, ...)`` (micro-batch i's values at ``[:, i]``, strided
        micro-batches) or, for a stack of micro-batches, ``(K, m, ...)`` as it lies.
    """

    stacked: bool
    init: Callable[[Any, Any], Any]
    update: Callable[[Any, Any, jax.Array], Any]
    combine: Callable[[Any, Any], Any]
    finalize: Callable[[Any, jax.Array, int], Any]
    per_example: bool = False


def _extreme(dtype: Any, largest: bool) -> Any:
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.inf if largest else -jnp.inf
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return info.max if largest else info.min
    return largest


def _wide(dtype: Any) -> Any:
    """Sums of floating aux values in at least float32; integers and bools as they are."""
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.inexact) else dtype


def _concat(ys: Any, total: jax.Array, count: int) -> Any:
    """Per-example values of strided micro-batches, kept ``(m, k, ...)`` (micro-batch i holds
    examples i, i + k, ..., so example ``j * k + i`` is ``ys[j, i]``): the batch's order is a
    reshape."""
    return ys.reshape((-1, *ys.shape[2:]))


def _last_device(acc: Any, axes: Any) -> Any:
    """The accumulator of the last device along ``axes`` (it holds the batch's last examples)."""
    n = jax.lax.psum(1, axes)
    return jax.lax.psum(jnp.where(jax.lax.axis_index(axes) == n - 1, acc, 0), axes)


def _extremum(largest: bool) -> AuxReduction:
    """``"max"`` or ``"min"``: starts at the other end of the dtype's range (-inf for max); a
    NaN wins, across micro-batches and across devices (an all-reduce max would drop it)."""
    pick = jnp.maximum if largest else jnp.minimum
    reduce = jax.lax.pmax if largest else jax.lax.pmin

    def combine(acc: Any, axes: Any) -> Any:
        if not jnp.issubdtype(acc.dtype, jnp.inexact):
            return reduce(acc, axes)
        nan = jax.lax.psum(jnp.isnan(acc).astype(jnp.int32), axes) > 0
        return jnp.where(nan, jnp.nan, reduce(acc, axes)).astype(acc.dtype)

    return AuxReduction(
        False,
        lambda shape, dtype: jnp.full(shape, _extreme(dtype, largest=not largest), dtype),
        lambda acc, x, w: pick(acc, x),
        combine,
        _same,
    )


def _none(*_: Any) -> Any:
    return None


def _same(acc: Any, *_: Any) -> Any:
    return acc


# The names ``has_aux`` takes, each implemented once below (tests check the two agree).
AuxReductionName = Literal["stack", "concat", "sum", "mean", "weighted_mean", "max", "min",
                           "last"]
AUX_REDUCTIONS: dict[AuxReductionName, AuxReduction] = {
    "stack": AuxReduction(True, _none, _none, _same, _same),
    "concat": AuxReduction(True, _none, _none, _same, _concat, per_example=True),
    "sum": AuxReduction(
        False,
        lambda shape, dtype: jnp.zeros(shape, _wide(dtype)),
        lambda acc, x, w: acc + x.astype(acc.dtype),
        jax.lax.psum,
        _same,
    ),
    "mean": AuxReduction(
        False,
        lambda shape, dtype: jnp.zeros(shape, jnp.promote_types(dtype, jnp.float32)),
        lambda acc, x, w: acc + x.astype(acc.dtype),
        jax.lax.psum,
        lambda acc, total, kept: safe_divide(acc, jnp.asarray(kept, acc.dtype)),
    ),
    "weighted_mean": AuxReduction(
        False,
        lambda shape, dtype: jnp.zeros(shape, jnp.promote_types(dtype, jnp.float32)),
        lambda acc, x, w: weighted_add(acc, x, w),
        jax.lax.psum,
        lambda acc, total, count: safe_divide(acc, total),
    ),
    "max": _extremum(largest=True),
    "min": _extremum(largest=False),
    "last": AuxReduction(
        False,
        lambda shape, dtype: jnp.zeros(shape, dtype),
        lambda acc, x, w: x.astype(acc.dtype),
        _last_device,
        _same,
    ),
}


def _is_name(x: Any) -> bool:
    return isinstance(x, str)


def check_aux_spec(entry: str, spec: Any) -> None:
    """Checks the reduction names of a ``has_aux`` spec (its structure is checked at trace)."""
    names = jax.tree.leaves(spec, is_leaf=_is_name)
    bad = sorted({n for n in names if not _is_name(n) or n not in AUX_REDUCTIONS}, key=str)
    if bad or not names:
        raise ValueError(
            f"{entry}: has_aux must be a bool, one of {tuple(AUX_REDUCTIONS)}, or a pytree "
            f"prefix of the aux value with those names as leaves; got unknown {bad or spec!r}"
        )


def aux_plan(entry: str, spec: Any, aux: Any) -> list[AuxReduction]:
    """One :class:`AuxReduction` per leaf of ``aux`` (flattened), from ``has_aux``'s spec: a
    name for every leaf, or a pytree prefix of ``aux`` whose leaves are names."""
    try:
        per_leaf = jax.tree.map(
            lambda name, sub: jax.tree.map(lambda _: name, sub), spec, aux, is_leaf=_is_name
        )
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{entry}: has_aux={spec!r} must be one of {tuple(AUX_REDUCTIONS)} or a pytree "
            f"prefix of the aux value {jax.tree.structure(aux)} with those names as leaves: "
            f"{error}"
        ) from None
    check_aux_spec(entry, spec)
    return [AUX_REDUCTIONS[n] for n in jax.tree.leaves(per_leaf, is_leaf=_is_name)]


def check_concat(entry: str, plan: list[AuxReduction], aux: Any, microbatch_size: int) -> None:
    """``"concat"`` needs per-example leaves: a leading axis of the micro-batch's size."""
    paths = jax.tree_util.tree_flatten_with_path(aux)[0]
    for record, (path, leaf) in zip(plan, paths, strict=True):
        shape = jnp.shape(leaf)
        if record.per_example and (not shape or shape[0] != microbatch_size):
            raise ValueError(
                f"{entry}: has_aux 'concat' puts per-example values back in batch order, so "
                f"each such aux leaf needs a leading axis of the micro-batch size "
                f"{microbatch_size}; the leaf {jax.tree_util.keystr(path) or 'aux'} has shape "
                f"{shape}: give it 'stack', 'mean' or 'sum' instead (a tree such as "
                "{'logits': 'concat', 'loss': 'mean'})"
            )
