"""The gradient noise scale from the micro-batch gradients an accumulated step already holds.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A: with
``|G_small|^2`` the mean squared norm of gradients of ``b`` examples and ``|G_big|^2`` the
squared norm of the gradient of ``B`` examples,

    |G|^2 ~ (B |G_big|^2 - b |G_small|^2) / (B - b)
    tr(S) ~ (|G_small|^2 - |G_big|^2) / (1/b - 1/B)

are unbiased estimates of the true gradient's squared norm and of the trace of the per-example
gradient covariance; ``B_simple = tr(S) / |G|^2``. The small batches are the micro-batches as
each device sees them (on a mesh, its share of a micro-batch), measured before the one
reduction; the big batch is the whole step's. With ``weighted`` losses the items are what the
weights count (tokens), and micro-batches of different sizes are allowed (:func:`estimate`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class NoiseScale(NamedTuple):
    """One step's estimates for the simple gradient noise scale (McCandlish et al., app. A).

    Each step's ratio is noisy; average ``trace`` and ``gradient_sq`` over steps (an EMA)
    before dividing, as the paper does, rather than averaging ``simple``. A step of one
    micro-batch (a runtime count of 1) has nothing to compare: its estimates are NaN.

    Attributes:
      gradient_sq: unbiased estimate of ``|G|^2``, the true gradient's squared norm.
      trace: unbiased estimate of ``tr(Sigma)``, the per-example gradient covariance's trace.
      small_batch: float32, ``b``: the items behind one micro-batch gradient (per device; the
        mean over the micro-batches, their weights with ``weighted``).
      big_batch: float32, ``B``: the items of the whole step (examples; the total weight with
        ``weighted``, e.g. tokens).
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


def microbatch_term(grads: Any, items: jax.Array, skipped: Any = None) -> jax.Array:
    """``(n |g|^2, n, 1)`` for a micro-batch gradient ``g`` of ``n`` items; zeros if skipped
    or empty (a weight-0 micro-batch is no sample of the small batch); NaN for an invalid
    (negative or NaN) count, which poisons the estimates as it poisons the gradient."""
    items = jnp.where(items >= 0, items, jnp.nan)
    term = jnp.stack([items * squared_norm(grads), items, jnp.ones((), jnp.float32)])
    keep = items != 0 if skipped is None else jnp.logical_and(items != 0,
                                                              jnp.logical_not(skipped))
    return jnp.where(keep, term, jnp.zeros_like(term))


def estimate(sums: jax.Array, grads: Any) -> NoiseScale:
    """The estimates from ``sums = (sum_i n_i |g_i|^2, N, m)`` over ``m`` micro-batch
    gradients ``g_i`` of ``n_i`` items (``N = sum_i n_i``) and the step's gradient ``grads``,
    the mean over those ``N`` items.

    With ``E|g_i|^2 = |G|^2 + tr(S) / n_i`` and ``E|grads|^2 = |G|^2 + tr(S) / N``:
    ``tr(S) = (sum_i n_i |g_i|^2 - N |grads|^2) / (m - 1)`` and ``|G|^2 = |grads|^2 -
    tr(S) / N``: the paper's two formulas when every ``n_i`` is the same ``b``, and unbiased
    for micro-batches of different sizes (``weighted``: packed tokens) too.
    """
    weighted_sq, big, m = sums[0], sums[1], sums[2]
    g_big = squared_norm(grads)
    trace = (weighted_sq - big * g_big) / (m - 1.0)
    trace = jnp.where(m > 1, trace, jnp.nan)  # one micro-batch: nothing to compare (a count of 1)
    return NoiseScale(g_big - trace / big, trace, big / m, big)
