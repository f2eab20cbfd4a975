"""The gradient noise scale from the micro-batch gradients an accumulated step already holds.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A: with
``|G_small|^2`` the mean squared norm of gradients of ``b`` examples and ``|G_big|^2`` the
squared norm of the gradient of ``B`` examples,

    |G|^2 ~ (B |G_big|^2 - b |G_small|^2) / (B - b)
    tr(S) ~ (|G_small|^2 - |G_big|^2) / (1/b - 1/B)

are unbiased estimates of the true gradient's squared norm and of the trace of the per-example
gradient covariance; ``B_simple = tr(S) / |G|^2``. The small batches are the micro-batches as
each device sees them (on a mesh, its share of a micro-batch), measured before the one
reduction; the big batch is the whole step's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class NoiseScale(NamedTuple):
    """One step's estimates for the simple gradient noise scale (McCandlish et al., app. A).

    Each step's ratio is noisy; average ``trace`` and ``gradient_sq`` over steps (an EMA)
    before dividing, as the paper does, rather than averaging ``simple``.

    Attributes:
      gradient_sq: unbiased estimate of ``|G|^2``, the true gradient's squared norm.
      trace: unbiased estimate of ``tr(Sigma)``, the per-example gradient covariance's trace.
      small_batch: float32, ``b``: the examples behind one micro-batch gradient (per device).
      big_batch: float32, ``B``: the examples of the whole step.
    """

    gradient_sq: jax.Array
    trace: jax.Array
    small_batch: jax.Array
    big_batch: jax.Array

    @property
    def simple(self) -> jax.Array:
        """``B_simple = trace / gradient_sq`` of this step alone."""
        return self.trace / self.gradient_sq


def squared_norm(tree: Any) -> jax.Array:
    """``sum |x|^2`` over the leaves, in float32."""
    return sum((jnp.sum(jnp.square(jnp.abs(x).astype(jnp.float32)))
                for x in jax.tree.leaves(tree)), jnp.zeros((), jnp.float32))


def estimate(small_sq_sum: jax.Array, count: Any, small: int, grads: Any) -> NoiseScale:
    """The estimates from the sum of ``count`` micro-batch gradients' squared norms (each of
    ``small`` examples) and the step's gradient ``grads`` (of ``count * small`` examples)."""
    n = jnp.asarray(count, jnp.float32)
    b, big = jnp.asarray(small, jnp.float32), n * small
    g_small = small_sq_sum / jnp.maximum(n, 1.0)
    g_big = squared_norm(grads)
    gradient_sq = (big * g_big - b * g_small) / (big - b)
    trace = (g_small - g_big) / (1.0 / b - 1.0 / big)
    return NoiseScale(gradient_sq, trace, b, big)
