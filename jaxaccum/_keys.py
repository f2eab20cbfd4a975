"""Per-example PRNG keys, so that randomness does not depend on how a batch is split."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxaccum import _validation


def per_example_keys(key: jax.Array, batch_size: int) -> jax.Array:
    """Returns one PRNG key per example: ``fold_in(key, i)`` for ``i`` in ``range(batch_size)``.

    Put the keys in the batch. They are split into micro-batches with the data, so a dropout
    mask drawn for each example from its own key is the same whatever the number of
    micro-batches; a single key per (micro-)batch would draw different masks for each k.

    Args:
      key: a PRNG key (typed, from ``jax.random.key``, or raw, from ``jax.random.PRNGKey``).
      batch_size: the number of examples, an int >= 1.

    Returns:
      An array of ``batch_size`` keys of the same kind as ``key``.

    Raises:
      TypeError: if ``batch_size`` is not an int.
      ValueError: if ``batch_size`` < 1.

    Example:
      >>> import jax, jaxaccum
      >>> keys = jaxaccum.per_example_keys(jax.random.key(0), 4)
      >>> keys.shape
      (4,)
      >>> bool(keys[2] == jax.random.fold_in(jax.random.key(0), 2))
      True
    """
    n = _validation.positive_int(batch_size, "batch_size")
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n, dtype=jnp.uint32))
