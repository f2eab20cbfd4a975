"""jaxaccum.experiment.models: the experiment's MLPs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import refuses
from flax import nnx

import jaxaccum
from jaxaccum.experiment import models


def test_gist_mlp_weights():
    _, params = models.functional(models.GistMLP())
    w1, w2 = params["hidden"]["kernel"][...], params["out"]["kernel"][...]
    assert w1.shape == (784, 100) and w2.shape == (100, 10)
    for w in (w1, w2):
        assert float(jnp.max(jnp.abs(w))) <= 0.025
        assert float(jnp.std(w)) == pytest.approx(0.05 / np.sqrt(12), rel=0.05)
    assert float(jnp.max(jnp.abs(params["hidden"]["bias"][...]))) == 0.0
    np.testing.assert_array_equal(w1, models.gist_kernels(123456)[0])
    other = models.functional(models.GistMLP(seed=1))[1]
    assert not np.array_equal(other["hidden"]["kernel"][...], w1)


def test_gist_mlp_forward_matches_formula():
    model = models.GistMLP()
    x = jax.random.uniform(jax.random.key(0), (5, 784))
    w1, w2 = models.gist_kernels()
    expected = np.maximum(np.asarray(x) @ w1, 0) @ w2
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-6)


def test_mse_one_hot():
    out = jnp.array([[1.0, 0.0], [0.5, 0.5]])
    # (0 + 0 + 0.25 + 0.25) / 4
    assert float(models.mse_one_hot(out, jnp.array([0, 1]), num_classes=2)) == 0.125


def test_dropout_mlp_init_and_softmax():
    model = models.DropoutMLP(nnx.Rngs(0))
    w = model.layers[0].kernel[...]
    assert w.shape == (784, 512)
    assert float(jnp.max(jnp.abs(w))) <= 0.02 + 1e-7  # truncated at two standard deviations
    assert 0.007 < float(jnp.std(w)) < 0.0101
    probs = model(jnp.ones((4, 784)))
    np.testing.assert_allclose(probs.sum(-1), np.ones(4), rtol=1e-6)


def test_dropout_per_example_masks_independent_of_batch():
    model = models.DropoutMLP(nnx.Rngs(0))
    x = jax.random.uniform(jax.random.key(1), (8, 784))
    keys = jaxaccum.per_example_keys(jax.random.key(2), 8)
    together = model(x, keys)
    alone = jnp.concatenate([model(x[i : i + 1], keys[i : i + 1]) for i in range(8)])
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-7)
    assert not np.allclose(together, model(x), atol=1e-7)  # dropout is on with keys


def test_per_example_dropout_keep_rate_and_scale():
    x = jnp.ones((64, 1000))
    y = models.per_example_dropout(x, jaxaccum.per_example_keys(jax.random.key(0), 64), 0.8)
    kept = np.asarray(y > 0)
    assert abs(kept.mean() - 0.8) < 0.01
    np.testing.assert_allclose(np.asarray(y)[kept], 1.25)


def test_per_example_dropout_needs_one_key_per_example():
    with refuses(ValueError, match=r"x has 4 examples, keys shape \(3,\)"):
        models.per_example_dropout(
            jnp.ones((4, 2)), jaxaccum.per_example_keys(jax.random.key(0), 3), 0.8
        )


def test_dropout_keep_checked():
    with refuses(ValueError, match=r"keep must be in \(0, 1\]; got keep=0.0"):
        models.DropoutMLP(nnx.Rngs(0), keep=0.0)


def test_per_example_dropout_masks_same_in_float64():
    x = jax.random.uniform(jax.random.key(0), (16, 300)) + 0.5
    keys = jaxaccum.per_example_keys(jax.random.key(1), 16)
    masks32 = np.asarray(models.per_example_dropout(x, keys, 0.8, salt=1) > 0)
    with jax.enable_x64(True):
        y64 = models.per_example_dropout(jnp.asarray(x, jnp.float64), keys, 0.8, salt=1)
        assert y64.dtype == jnp.float64
        masks64 = np.asarray(y64 > 0)
    assert 0.7 < masks32.mean() < 0.9
    np.testing.assert_array_equal(masks64, masks32)


def test_functional_refuses_a_model_with_state():
    """A pure apply(params, ...) would freeze BatchNorm statistics: jaxaccum.nnx carries them."""
    from flax import nnx

    class WithBatchNorm(nnx.Module):
        def __init__(self):
            self.bn = nnx.BatchNorm(3, rngs=nnx.Rngs(0))

    with refuses(TypeError, match=r"WithBatchNorm has variables other than nnx.Param "
                       r"\(BatchStat\).*jaxaccum.nnx"):
        models.functional(WithBatchNorm())
