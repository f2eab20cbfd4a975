"""A traced number of micro-batches: a stack of at most ``max_microbatches``, ``count`` real.

One program serves every count: the micro-batch loop's trip count is the runtime ``count``
(a ``lax.fori_loop`` with a traced bound lowers to a ``while`` loop), so the padded micro-
batches cost nothing, and the result is the mean over the real ones. The stack is turned into
the pipeline's own strided layout (micro-batch ``i`` is ``data[i]``), so every placement and
front end runs it unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import _validation
from jaxaccum._arguments import Accumulation


class Microbatches(NamedTuple):
    """A batch given as a stack of micro-batches, of which the first ``count`` are real.

    Pass it where the batch goes, to a function or step built with ``max_microbatches=K``:
    every leaf of ``data`` has shape ``(K, m, ...)``, micro-batch ``i`` being ``data[i]``. One
    compiled program serves every ``count`` from 0 to K; micro-batches ``count, ..., K - 1``
    are never evaluated (fill them with anything of the right shape, zeros say). The result is
    the (weighted) mean over the real micro-batches, as if the batch held only them; a step
    with ``count == 0`` makes no update. A count outside ``0..K`` given as a Python, NumPy or
    jax integer raises a ``ValueError``; a traced one (inside your own ``jax.jit``) cannot be
    checked and is clipped to ``0..K``. On a mesh, shard the micro-batch axis ``m`` (axis 1)
    over the data axes.

    Attributes:
      data: the stacked micro-batches, a pytree of ``(K, m, ...)`` arrays.
      count: the number of real micro-batches, an int32 scalar (traced or not).

    Examples:
      >>> import jax.numpy as jnp, jaxaccum
      >>> def loss(w, x):
      ...     return jnp.mean((x @ w) ** 2)
      >>> grad = jaxaccum.value_and_grad(loss, max_microbatches=4)
      >>> stack = jnp.ones((4, 2, 3)).at[2:].set(100.0)  # micro-batches 2 and 3 are padding
      >>> value, g = grad(jnp.ones(3), jaxaccum.Microbatches(stack, 2))
      >>> float(value)
      9.0
    """

    data: Any
    count: Any


def microbatches(batch: Any, *, microbatch_size: int, max_microbatches: int) -> Microbatches:
    """Host side: a flat batch of ``n`` examples as a :class:`Microbatches` stack, ``n /
    microbatch_size`` real micro-batches of consecutive examples padded with zeros to
    ``max_microbatches`` (the last, short batch of an epoch, in the same compiled step).

    Args:
      batch: a pytree of arrays with a leading axis of ``n`` examples.
      microbatch_size: ``m``, the examples per micro-batch; it must divide ``n``.
      max_microbatches: ``K``, the stack's length (the step's compiled maximum).

    Returns:
      ``Microbatches(data, count)`` with ``data`` leaves ``(K, m, ...)`` (numpy arrays) and
      ``count = n / m``.

    Raises:
      ValueError: the leaves' leading axes differ (or one is a scalar), ``m`` does not
        divide ``n`` (``m`` < 1 included), ``n / m > K``, or ``K`` < 1.
      TypeError: ``m`` or ``K`` not an int.

    Examples:
      >>> import numpy as np, jaxaccum
      >>> mb = jaxaccum.microbatches(np.arange(6.0), microbatch_size=2, max_microbatches=4)
      >>> mb.data.shape, int(mb.count)
      ((4, 2), 3)
    """
    entry = "jaxaccum.microbatches"
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, (int, np.integer)):
        raise TypeError(
            f"{entry}: microbatch_size must be an int (the examples per micro-batch); got "
            f"{microbatch_size!r} of type {type(microbatch_size).__name__}"
        )
    max_microbatches = _validation.positive_int(max_microbatches, "max_microbatches", entry)
    leaves = jax.tree.leaves(batch)
    sizes = sorted({np.shape(x)[0] if np.ndim(x) else -1 for x in leaves})
    if len(sizes) > 1 or sizes == [-1]:
        shapes = [np.shape(x) for x in leaves]
        raise ValueError(
            f"{entry}: every leaf of batch must have the same leading axis of n examples; "
            f"got leaves of shapes {shapes}; give per-example arrays only (keep per-batch "
            "values out of batch)"
        )
    n = sizes[0] if leaves else 0
    if microbatch_size < 1 or n % microbatch_size:
        raise ValueError(
            f"{entry}: microbatch_size={microbatch_size} must divide the batch's {n} examples; "
            "pad the batch (and use weighted=True) or choose a divisor"
        )
    count = n // microbatch_size
    if count > max_microbatches:
        raise ValueError(
            f"{entry}: the batch holds {count} micro-batches of {microbatch_size}, more than "
            f"max_microbatches={max_microbatches}; split it over several steps or raise "
            "max_microbatches"
        )

    def stack(x: Any) -> np.ndarray:
        x = np.asarray(x)
        out = np.zeros((max_microbatches, microbatch_size, *x.shape[1:]), x.dtype)
        out[:count] = x.reshape(count, microbatch_size, *x.shape[1:])
        return out

    return Microbatches(jax.tree.map(stack, batch), np.asarray(count, np.int32))


def unstack(
    acc: Accumulation, args: tuple[Any, ...]
) -> tuple[tuple[Any, ...], int, jax.Array] | None:
    """With ``max_microbatches``: the arguments with each batch argument's stack ``data``
    (``(K, m, ...)`` leaves, read where they lie: no copy), ``K`` and the traced count. None
    without the option."""
    k = acc.options.max_microbatches
    if k is None:
        for i in acc.split:
            if isinstance(args[i], Microbatches):
                raise TypeError(
                    f"{acc.entry}: argument {i} is a jaxaccum.Microbatches; build the function "
                    "with max_microbatches=K (not num_microbatches/microbatch_size) to take a "
                    "stack of micro-batches with a runtime count"
                )
        return None
    counts, out = [], list(args)
    for i in acc.split:
        stack = args[i]
        if not isinstance(stack, Microbatches):
            raise TypeError(
                f"{acc.entry}: with max_microbatches={k}, batch argument {i} must be a "
                f"jaxaccum.Microbatches(data, count) (data leaves shaped (K, m, ...)); got "
                f"{type(stack).__name__} (use jaxaccum.microbatches(batch, microbatch_size=m, "
                f"max_microbatches={k}) to build one)"
            )
        sizes = set()
        for path, x in jax.tree_util.tree_flatten_with_path(stack.data)[0]:
            if np.ndim(x) < 2 or np.shape(x)[0] != k:
                raise ValueError(
                    f"{acc.entry}: with max_microbatches={k}, every leaf of Microbatches.data "
                    f"needs the shape (K={k}, m, ...); argument {i}"
                    f"{jax.tree_util.keystr(path)} has the shape {np.shape(x)}"
                )
            sizes.add(np.shape(x)[1])
        if not sizes:
            raise ValueError(
                f"{acc.entry}: Microbatches.data of argument {i} holds no arrays; give it the "
                "batch's arrays stacked as (K, m, ...)"
            )
        if len(sizes) > 1:
            raise ValueError(
                f"{acc.entry}: every leaf of Microbatches.data needs the same micro-batch size m "
                f"(axis 1); argument {i} has the sizes {sorted(sizes)}"
            )
        if np.shape(stack.count) != () or not jnp.issubdtype(jnp.result_type(stack.count),
                                                             jnp.integer):
            raise TypeError(
                f"{acc.entry}: Microbatches.count must be an integer scalar (the number of "
                f"real micro-batches, 0..{k}); got {stack.count!r}"
            )
        check_count(acc.entry, stack.count, k)
        counts.append(jnp.clip(jnp.asarray(stack.count, jnp.int32), 0, k))
        out[i] = stack.data
    return tuple(out), k, counts[0]


def check_count(entry: str, count: Any, k: int) -> None:
    """A concrete count must lie in ``0..k`` (a traced one is clipped there)."""
    if isinstance(count, jax.core.Tracer):
        return
    value = int(np.asarray(count))
    if not 0 <= value <= k:
        raise ValueError(
            f"{entry}: Microbatches.count must be between 0 and max_microbatches={k}; got "
            f"{value} (split the batch over several steps, or build the step with a larger "
            "max_microbatches)"
        )


def canonical(batch: Any, entry: str, k: int | None) -> Any:
    """A :class:`Microbatches` with its count checked (``0..k``) and made an int32 jax array
    (a jitted step compiles anew for a Python int, a NumPy scalar or a jax array of another
    dtype), so that every count hits the same compiled program; anything else as is."""
    if isinstance(batch, Microbatches) and not isinstance(batch.count, jax.core.Tracer):
        if k is not None and np.shape(batch.count) == ():
            check_count(entry, batch.count, k)
        return batch._replace(count=jnp.asarray(batch.count, jnp.int32))
    return batch
