"""Per-example PRNG keys, so that randomness does not depend on how a batch is split."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxaccum import _validation


def _threefry(key: jax.Array) -> jax.Array:
    """A typed threefry2x32 key holding all of ``key``'s bits (``key`` itself if threefry)."""
    if str(jax.random.key_impl(key)) == "threefry2x32":
        return key
    data = jax.random.key_data(key).reshape(-1)
    base = jax.random.wrap_key_data(data[:2], impl="threefry2x32")
    for i in range(2, data.shape[0]):
        base = jax.random.fold_in(base, data[i])
    return base


def per_example_keys(key: jax.Array, batch_size: int) -> jax.Array:
    """Returns one PRNG key per example: ``fold_in(key, i)`` for ``i`` in ``range(batch_size)``.

    Put the keys in the batch. They are split into micro-batches with the data, so a dropout
    mask drawn for each example from its own key is the same whatever the number of
    micro-batches; a single key per (micro-)batch would draw different masks for each k.

    The keys are threefry2x32 keys whatever ``key``'s implementation. Under ``vmap`` the
    ``rbg`` and ``unsafe_rbg`` implementations draw a batch of keys' bits together, so one
    example's mask would depend on which examples share its micro-batch (see ``jax.random``'s
    notes on them); threefry is counter based and draws each key's bits alone. A key of another
    implementation is first turned into a threefry key that folds in all of its bits.

    Args:
      key: a scalar PRNG key (typed, from ``jax.random.key``, or raw, from
        ``jax.random.PRNGKey``), of any implementation.
      batch_size: the number of examples, an int >= 1.

    Returns:
      An array of ``batch_size`` keys: raw ``uint32[batch_size, 2]`` if ``key`` is a raw
      threefry key, typed threefry2x32 keys otherwise.

    Raises:
      TypeError: if ``batch_size`` is not an int.
      ValueError: if ``batch_size`` < 1, or ``key`` is not a single key.

    Examples:
      >>> import jax, jaxaccum
      >>> keys = jaxaccum.per_example_keys(jax.random.key(0), 4)
      >>> keys.shape
      (4,)
      >>> bool(keys[2] == jax.random.fold_in(jax.random.key(0), 2))
      True
      >>> rbg = jaxaccum.per_example_keys(jax.random.key(0, impl="rbg"), 4)
      >>> str(jax.random.key_impl(rbg))
      'threefry2x32'
    """
    n = _validation.positive_int(batch_size, "batch_size")
    key = jnp.asarray(key)
    raw = not jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    typed = jax.random.wrap_key_data(key) if raw else key
    if typed.shape != ():
        raise ValueError(
            f"key must be a single PRNG key (a typed key of shape () or one raw key); got a "
            f"{'raw key array' if raw else 'key array'} of shape {key.shape}"
        )
    base = _threefry(typed)
    keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(n, dtype=jnp.uint32))
    return jax.random.key_data(keys) if raw and base is typed else keys
