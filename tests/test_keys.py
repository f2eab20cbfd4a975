"""jaxaccum.per_example_keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_keys_are_fold_in_of_index(make_key):
    key = make_key(3)
    keys = jax.jit(jaxaccum.per_example_keys, static_argnums=1)(key, 5)
    for i in range(5):
        np.testing.assert_array_equal(
            jax.random.key_data(keys[i]), jax.random.key_data(jax.random.fold_in(key, i))
        )
    draws = jax.vmap(lambda k: jax.random.uniform(k))(keys)
    assert len(set(np.asarray(draws).tolist())) == 5


def test_split_keys_are_a_prefix():
    """The keys of a micro-batch are the same whatever the batch was split into."""
    key = jax.random.key(0)
    whole = jaxaccum.per_example_keys(key, 64)
    np.testing.assert_array_equal(
        jax.random.key_data(whole.reshape(8, 8)[3]), jax.random.key_data(whole[24:32])
    )
    assert jnp.all(whole[:16] == jaxaccum.per_example_keys(key, 16))


@pytest.mark.parametrize(("bad", "error"), [(0, ValueError), (-3, ValueError), (2.5, TypeError)])
def test_bad_batch_size(bad, error):
    with pytest.raises(error, match=rf"batch_size must be .*{bad}"):
        jaxaccum.per_example_keys(jax.random.key(0), bad)
