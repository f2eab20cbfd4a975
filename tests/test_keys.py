"""jaxaccum.per_example_keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import refuses

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
    with refuses(error, match=rf"batch_size must be .*{bad}"):
        jaxaccum.per_example_keys(jax.random.key(0), bad)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
@pytest.mark.parametrize("raw", [False, True])
def test_masks_do_not_depend_on_the_microbatch_under_any_prng(impl, raw):
    """rbg/unsafe_rbg draw vmapped keys' bits together: each example's mask would depend on the
    examples beside it. The per-example keys must give every example the mask it gets alone."""
    key = jax.random.key(5, impl=impl)
    if raw:
        with jax.default_prng_impl(impl):
            keys = jaxaccum.per_example_keys(jax.random.key_data(key), 8)
    else:
        keys = jaxaccum.per_example_keys(key, 8)
    masks = jax.jit(jax.vmap(lambda k: jax.random.bernoulli(k, 0.5, (64,))))
    whole = masks(keys)
    # micro-batches of a strided split (k = 2, 4) and each example alone
    for k in (2, 4, 8):
        for i in range(k):
            np.testing.assert_array_equal(whole[i::k], masks(keys[i::k]))
    assert 0.3 < float(whole.mean()) < 0.7
    assert len({tuple(np.asarray(m).tolist()) for m in whole}) == 8


def test_other_prng_keys_fold_in_all_their_bits():
    a = jax.random.wrap_key_data(jnp.array([1, 2, 3, 4], jnp.uint32), impl="rbg")
    b = jax.random.wrap_key_data(jnp.array([1, 2, 3, 5], jnp.uint32), impl="rbg")
    ka, kb = jaxaccum.per_example_keys(a, 4), jaxaccum.per_example_keys(b, 4)
    assert not np.any(np.all(jax.random.key_data(ka) == jax.random.key_data(kb), axis=-1))


def test_key_array_rejected():
    with refuses(ValueError, match=r"key must be a single PRNG key.*shape \(3,\)"):
        jaxaccum.per_example_keys(jax.random.split(jax.random.key(0), 3), 4)
