"""The Flax (NNX) models of the experiment, and their mean-squared-error loss.

``GistMLP`` is the experiment's 784-100-10 ReLU network with kernels drawn once from a seeded
uniform(-0.025, 0.025); ``DropoutMLP`` the 784-512-512-10 network of its dropout question, whose
dropout masks are drawn per example from keys carried in the batch (see
:func:`jaxaccum.per_example_keys`), so they do not depend on how the batch is split.

:func:`functional` turns a model into ``(apply, params)`` for :func:`jaxaccum.value_and_grad`
and :func:`jaxaccum.train_step`, which differentiate plain pytrees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

GIST_WEIGHT_SEED = 123456
GIST_INIT_RANGE = 0.025


def _constant(value: np.ndarray) -> Callable[..., jax.Array]:
    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        del key
        if tuple(shape) != value.shape:
            raise ValueError(f"initializer for shape {value.shape} asked for shape {shape}")
        return jnp.asarray(value, dtype)

    return init


def gist_kernels(seed: int = GIST_WEIGHT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """The experiment's two kernels: uniform(-0.025, 0.025) from ``RandomState(seed)``."""
    rng = np.random.RandomState(seed)
    w1 = rng.uniform(-GIST_INIT_RANGE, GIST_INIT_RANGE, size=(784, 100)).astype(np.float32)
    w2 = rng.uniform(-GIST_INIT_RANGE, GIST_INIT_RANGE, size=(100, 10)).astype(np.float32)
    return w1, w2


class GistMLP(nnx.Module):
    """784 -> 100 (ReLU) -> 10, kernels from a seeded uniform(-0.025, 0.025), zero biases.

    Args:
      seed: the NumPy seed of the kernels (the experiment's 123456 by default); the same seed
        gives the same weights.

    Examples:
      >>> import jax.numpy as jnp
      >>> model = GistMLP()
      >>> model(jnp.zeros((2, 784))).shape
      (2, 10)
    """

    def __init__(self, seed: int = GIST_WEIGHT_SEED) -> None:
        w1, w2 = gist_kernels(seed)
        rngs = nnx.Rngs(0)  # unused: every initializer is fixed
        self.hidden = nnx.Linear(784, 100, kernel_init=_constant(w1), rngs=rngs)
        self.out = nnx.Linear(100, 10, kernel_init=_constant(w2), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.relu(self.hidden(x)))


class DropoutMLP(nnx.Module):
    """784 -> 512 -> 512 -> 10, ReLU, dropout (keep 0.8) after each hidden layer, softmax output.

    Kernels from truncated-normal(stddev 0.01), zero biases. Dropout is applied when per-example
    keys are given: example i's mask for hidden layer l is drawn from ``fold_in(keys[i], l)``.

    Args:
      rngs: the ``nnx.Rngs`` for the initial weights.
      keep: the probability of keeping a unit (0.8).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxaccum
      >>> model = DropoutMLP(nnx.Rngs(0))
      >>> keys = jaxaccum.per_example_keys(jax.random.key(1), 3)
      >>> probs = model(jnp.ones((3, 784)), keys)
      >>> bool(jnp.allclose(probs.sum(-1), 1.0))
      True
    """

    def __init__(self, rngs: nnx.Rngs, keep: float = 0.8) -> None:
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"keep must be in (0, 1]; got keep={keep}")
        init = nnx.initializers.truncated_normal(stddev=0.01)
        self.keep = keep
        self.layers = nnx.List(
            [
                nnx.Linear(784, 512, kernel_init=init, rngs=rngs),
                nnx.Linear(512, 512, kernel_init=init, rngs=rngs),
            ]
        )
        self.out = nnx.Linear(512, 10, kernel_init=init, rngs=rngs)

    def __call__(self, x: jax.Array, keys: jax.Array | None = None) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = jax.nn.relu(layer(x))
            if keys is not None:
                x = per_example_dropout(x, keys, self.keep, salt=i)
        return jax.nn.softmax(self.out(x))


def per_example_dropout(x: jax.Array, keys: jax.Array, keep: float, salt: int = 0) -> jax.Array:
    """Inverted dropout of ``x[i]`` with a mask drawn from ``fold_in(keys[i], salt)``.

    The masks depend only on the keys: the same in float32 and float64 (x64 enabled).
    """
    if keys.shape[:1] != x.shape[:1]:
        raise ValueError(
            f"keys must hold one key per example: x has {x.shape[0]} examples, keys shape "
            f"{keys.shape}"
        )
    # A float32 probability: bernoulli draws its uniforms in p's dtype, so a Python float would
    # give other masks (float64 draws) when x64 is enabled, as in the float64 reference runs.
    p = jnp.asarray(keep, jnp.float32)
    masks = jax.vmap(
        lambda k: jax.random.bernoulli(jax.random.fold_in(k, salt), p, x.shape[1:])
    )(keys)
    return jnp.where(masks, x / keep, 0.0)


def mse_one_hot(outputs: jax.Array, labels: jax.Array, num_classes: int = 10) -> jax.Array:
    """Mean squared error against one-hot targets: the mean over examples and classes."""
    return jnp.mean((outputs - jax.nn.one_hot(labels, num_classes, dtype=outputs.dtype)) ** 2)


def functional(model: nnx.Module) -> tuple[Callable[..., jax.Array], nnx.State]:
    """Splits a *stateless* model into a pure ``apply(params, *inputs)`` and its parameters.

    A model with variables other than ``nnx.Param`` (BatchNorm statistics, RNG counts) is
    refused: a pure ``apply(params, ...)`` would silently freeze them. Use
    ``jaxaccum.nnx.value_and_grad`` or ``jaxaccum.nnx.train_step``, which carry them through the
    micro-batches.

    Raises:
      TypeError: if the model has variables other than ``nnx.Param``.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    kinds = {
        type(v).__name__
        for v in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
    }
    if kinds:
        raise TypeError(
            f"functional: {type(model).__name__} has variables other than nnx.Param "
            f"({', '.join(sorted(kinds))}), which a pure apply(params, ...) would silently "
            "freeze; use jaxaccum.nnx.value_and_grad or jaxaccum.nnx.train_step, which carry "
            "them through the micro-batches"
        )

    def apply(params: nnx.State, *inputs: Any) -> jax.Array:
        return nnx.merge(graphdef, params, rest)(*inputs)

    return apply, params
