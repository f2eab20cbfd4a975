"""The chunk geometry of the chunked linear cross-entropy, and one chunk's logits.

Tokens and vocabulary are cut into chunks of a fixed size, so that every chunk is a static
shape. A size that divides neither is handled without copying (padding a weight of V x D would
be one more weight-sized buffer): the last chunk starts at ``total - size`` instead, overlapping
the one before, and the rows or columns it repeats are masked.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Chunks(NamedTuple):
    """Chunks of ``size`` over ``total`` items (``size <= total``).

    Attributes:
      total: the number of items.
      size: the items a chunk holds.
    """

    total: int
    size: int

    @property
    def number(self) -> int:
        """How many chunks cover the items: ceil(total / size)."""
        return -(-self.total // self.size)

    def start(self, i: jax.Array) -> jax.Array:
        """Chunk i's first item; the last chunk is pulled back to end at ``total``."""
        return jnp.minimum(i * self.size, self.total - self.size)

    @property
    def overlaps(self) -> bool:
        """Whether the last chunk overlaps the one before (``size`` does not divide ``total``)."""
        return self.total % self.size != 0

    def new(self, i: jax.Array) -> jax.Array:
        """A bool ``(size,)``: the chunk's items no earlier chunk holds (all but the overlap)."""
        return self.start(i) + jnp.arange(self.size) >= i * self.size


def chunks(total: int, size: int) -> Chunks:
    """``total`` items in chunks of at most ``size`` (one chunk of all when ``size >= total``)."""
    return Chunks(total, max(1, min(size, total)))


class Head(NamedTuple):
    """The output layer ``hidden @ weight (+ bias)`` and how to cut its vocabulary.

    Attributes:
      weight: ``(V, D)`` when ``vocab_axis == 0``, ``(D, V)`` when it is 1.
      bias: ``(V,)`` or ``None``.
      vocab_axis: which axis of ``weight`` runs over the vocabulary.
      vocab: the vocabulary's chunks.
    """

    weight: jax.Array
    bias: jax.Array | None
    vocab_axis: int
    vocab: Chunks

    def weight_chunk(self, start: jax.Array) -> jax.Array:
        """The weight's columns (or rows) of one vocabulary chunk, in the weight's layout."""
        return lax.dynamic_slice_in_dim(self.weight, start, self.vocab.size, self.vocab_axis)

    def logits(self, h: jax.Array, w: jax.Array, start: jax.Array) -> jax.Array:
        """``(tokens, vocab chunk)`` float32 logits of ``h`` against the chunk ``w``; the
        product is taken in the inputs' dtype and summed in float32 (as a GPU does)."""
        d = 1 - self.vocab_axis  # the weight's axis of width D
        z = lax.dot_general(h, w, (((1,), (d,)), ((), ())), preferred_element_type=jnp.float32)
        if self.bias is not None:
            b = lax.dynamic_slice_in_dim(self.bias, start, self.vocab.size)
            z = z + b.astype(jnp.float32)
        return z

    def hidden_grad(self, dz: jax.Array, w: jax.Array) -> jax.Array:
        """``dz @ w`` back to the tokens: ``(tokens, D)`` in float32. ``dz`` stays float32 (a
        bfloat16 ``dz`` would round every logit's gradient: 2^-9 of each term)."""
        return lax.dot_general(dz, w.astype(jnp.float32), (((1,), (self.vocab_axis,)), ((), ())),
                               preferred_element_type=jnp.float32)

    def weight_grad(self, dz: jax.Array, h: jax.Array) -> jax.Array:
        """The chunk's weight gradient ``dz.T @ h`` in the weight's layout, in float32."""
        h = h.astype(jnp.float32)
        if self.vocab_axis == 0:
            return lax.dot_general(dz, h, (((0,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        return lax.dot_general(h, dz, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
