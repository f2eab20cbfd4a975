"""The per-token loss of the chunked linear cross-entropy, with its own backward pass.

Forward: for each token chunk, a streaming log-sum-exp over the vocabulary chunks (one
``tokens x vocab chunk`` block of logits at a time), plus the label's logit and, for label
smoothing, the sum of the logits. Backward: the logits are recomputed block by block, vocabulary
chunk outermost, so that each chunk's weight gradient is summed over every token in float32 and
written once (cast to the weight's dtype once: no rounding per token chunk), while the hidden
gradient is summed over the vocabulary chunks in one float32 ``tokens x D`` buffer. No
``tokens x V`` array exists in either pass.

With ``lse`` the log-sum-exp, ``z_y`` the label's logit, ``eps`` the label smoothing and ``zeta``
the z-loss, a token's loss is ``lse - (1 - eps) z_y - eps mean_v(z_v) + zeta lse^2`` and its
gradient with respect to the logits ``(1 + 2 zeta lse) softmax(z) - (1 - eps) onehot(y) -
eps / V``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum._cross_entropy._chunks import Chunks, Head, chunks
from jaxaccum.contrastive import _tiles


class Config(NamedTuple):
    """The static choices of one call (hashable: ``custom_vjp``'s non-differentiable part).

    Attributes:
      vocab_axis: the weight's vocabulary axis (0: ``(V, D)``, 1: ``(D, V)``).
      token_chunk, vocab_chunk: the largest chunk sizes.
      label_smoothing, z_loss: the loss's coefficients (Python floats).
      axis_name: inside ``jax.shard_map``, the mesh axis the vocabulary is split over (each
        device holds its slice of the weight, in order); None: the whole vocabulary here.
    """

    vocab_axis: int
    token_chunk: int
    vocab_chunk: int
    label_smoothing: float
    z_loss: float
    axis_name: str | None = None


def _head(config: Config, weight: jax.Array, bias: jax.Array | None) -> Head:
    vocab = chunks(weight.shape[config.vocab_axis], config.vocab_chunk)
    return Head(weight, bias, config.vocab_axis, vocab)


class Shard(NamedTuple):
    """This device's slice of the vocabulary (the whole of it without an axis).

    Attributes:
      offset: the global id of the slice's first entry.
      total: the whole vocabulary's size.
      axes: the manual mesh axes the inputs vary over: a loop's carry updated from them
        must be typed varying from the start.
    """

    offset: Any
    total: Any
    axes: tuple[str, ...]


def _shard(config: Config, head: Head, *arrays: Any) -> Shard:
    axes = _tiles.varying([a for a in arrays if a is not None])
    if config.axis_name is None:
        return Shard(0, head.vocab.total, axes)
    size = lax.psum(1, config.axis_name)
    return Shard(lax.axis_index(config.axis_name) * head.vocab.total,
                 head.vocab.total * size, axes)


def _combined(config: Config, lse: jax.Array, label: jax.Array,
              everything: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each device's log-sum-exp, label logit and logit sum over its slice, combined over the
    vocabulary's axis: a log-sum-exp of the log-sum-exps, and sums."""
    if config.axis_name is None:
        return lse, label, everything
    name = config.axis_name
    top = lax.pmax(lse, name)
    lse = top + jnp.log(lax.psum(jnp.exp(lse - top), name))
    return lse, lax.psum(label, name), lax.psum(everything, name)


def _token_block(tokens: Chunks, i: jax.Array, *arrays: jax.Array) -> list[jax.Array]:
    """Token chunk i of each array (tokens on axis 0)."""
    return [lax.dynamic_slice_in_dim(a, tokens.start(i), tokens.size) for a in arrays]


def _statistics(config: Config, head: Head, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token chunk's log-sum-exp and logit sum over the whole vocabulary."""
    vocab = head.vocab

    def step(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        top, total, everything = carry
        start = vocab.start(j)
        z = head.logits(h, head.weight_chunk(start), start)
        if vocab.overlaps:  # the overlap of the last chunk is counted once
            z = jnp.where(vocab.new(j)[None, :], z, -jnp.inf)
        if config.label_smoothing:
            everything = everything + jnp.sum(jnp.where(z > -jnp.inf, z, 0.0), axis=1)
        # streaming log-sum-exp: rescale the running sum to the new running maximum
        new_top = jnp.maximum(top, jnp.max(z, axis=1))
        total = total * jnp.exp(top - new_top) + jnp.sum(jnp.exp(z - new_top[:, None]), axis=1)
        return new_top, total, everything

    zeros = jnp.zeros(h.shape[0], jnp.float32)
    axes = _tiles.varying([x for x in (h, head.weight, head.bias) if x is not None])
    top, total, everything = lax.fori_loop(
        0, vocab.number, step, _tiles.vary(axes, (jnp.full_like(zeros, -jnp.inf), zeros, zeros)))
    return top + jnp.log(total), everything


def _label_logit(head: Head, h: jax.Array, y: jax.Array) -> jax.Array:
    """Each token's logit of its label, from the label's row of the weight (no logits)."""
    w = jnp.take(head.weight, y, axis=head.vocab_axis)
    w = w if head.vocab_axis == 0 else w.T
    # a batched dot, not a float32 cast: XLA would move a cast of the gathered rows before
    # the gather and convert the whole weight (a float32 weight-sized buffer)
    z = jnp.einsum("td,td->t", h, w, preferred_element_type=jnp.float32)
    return z if head.bias is None else z + head.bias[y].astype(jnp.float32)


def _forward(config: Config, hidden: jax.Array, weight: jax.Array, bias: jax.Array | None,
             labels: jax.Array, active: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The per-token loss and log-sum-exp, ``(T,)`` float32 each (0 on chunks of no active
    token, whose matmuls are skipped)."""
    head, tokens = _head(config, weight, bias), chunks(hidden.shape[0], config.token_chunk)
    shard = _shard(config, head, hidden, weight, bias)
    local = labels - shard.offset  # a label in another device's slice matches no column here
    mine = (local >= 0) & (local < head.vocab.total)

    def step(i: jax.Array, out: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        h, y, m, a = _token_block(tokens, i, hidden, local, mine, active)

        def compute() -> tuple[jax.Array, ...]:
            lse, everything = _statistics(config, head, h)
            label = jnp.where(m, _label_logit(head, h, jnp.where(m, y, 0)), 0.0)
            return _tiles.vary(shard.axes, (lse, label, everything))

        zeros = _tiles.vary(shard.axes, (jnp.zeros(tokens.size, jnp.float32),) * 3)
        block = lax.cond(jnp.any(a), compute, lambda: zeros)
        # the last chunk's overlap is written again with the same values
        return tuple(lax.dynamic_update_slice_in_dim(o, b, tokens.start(i), 0)
                     for o, b in zip(out, block, strict=True))

    init = _tiles.vary(shard.axes, (jnp.zeros(hidden.shape[0], jnp.float32),) * 3)
    lse, label, everything = _combined(config, *lax.fori_loop(0, tokens.number, step, init))
    eps = config.label_smoothing
    loss = lse - (1 - eps) * label + config.z_loss * lse**2 - eps / shard.total * everything
    return loss, lse


def _logit_grad(config: Config, head: Head, z: jax.Array, start: jax.Array, y: jax.Array,
                g: jax.Array, lse: jax.Array, rows: jax.Array, new: jax.Array | None,
                vocab_size: Any) -> jax.Array:
    """d(loss)/d(logits) of one block times the tokens' cotangents ``g``; 0 off ``rows`` (the
    chunk's active tokens no earlier chunk holds) and off ``new`` (its columns ditto)."""
    column = start + jnp.arange(head.vocab.size)
    eps = config.label_smoothing
    p = jnp.exp(z - lse[:, None])
    dz = (g * (1 + 2 * config.z_loss * lse))[:, None] * p
    dz = dz - jnp.where(column == y[:, None], (g * (1 - eps))[:, None], 0.0)
    if eps:
        dz = dz - (g * eps / vocab_size)[:, None]
    keep = rows[:, None] if new is None else rows[:, None] & new[None, :]
    return jnp.where(keep, dz, 0.0)


def _vocab_chunk_grads(config: Config, head: Head, tokens: Chunks, shard: Shard, j: jax.Array,
                       residuals: tuple[jax.Array, ...],
                       dh: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Vocabulary chunk j's weight and bias gradients (float32, summed over every token
    chunk), and ``dh`` with the chunk's part added."""
    hidden, labels, active, lse, g = residuals  # (active: tokens with a gradient)
    start = head.vocab.start(j)
    new = head.vocab.new(j) if head.vocab.overlaps else None
    w = head.weight_chunk(start)

    def step(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        dh, dw, db = carry
        h, y, a, lse_i, g_i = _token_block(tokens, i, hidden, labels, active, lse, g)
        rows = a & tokens.new(i) if tokens.overlaps else a  # the overlap is counted once

        def compute() -> tuple[jax.Array, ...]:
            dz = _logit_grad(config, head, head.logits(h, w, start), start, y, g_i, lse_i,
                             rows, new, shard.total)
            return _tiles.vary(shard.axes, (head.hidden_grad(dz, w), head.weight_grad(dz, h),
                                            jnp.sum(dz, axis=0)))

        skip = _tiles.vary(shard.axes, (jnp.zeros((tokens.size, hidden.shape[1]), jnp.float32),
                                        jnp.zeros(w.shape, jnp.float32),
                                        jnp.zeros(head.vocab.size, jnp.float32)))
        dh_i, dw_i, db_i = lax.cond(jnp.any(rows), compute, lambda: skip)
        old = lax.dynamic_slice_in_dim(dh, tokens.start(i), tokens.size)
        dh = lax.dynamic_update_slice_in_dim(dh, old + dh_i, tokens.start(i), 0)
        return dh, dw + dw_i, db + db_i

    init = _tiles.vary(shard.axes, (dh, jnp.zeros(w.shape, jnp.float32),
                                    jnp.zeros(head.vocab.size, jnp.float32)))
    dh, dw, db = lax.fori_loop(0, tokens.number, step, init)
    return dw, db, dh


def _write(full: jax.Array, part: jax.Array, start: jax.Array, new: jax.Array | None,
           axis: int, add: bool) -> jax.Array:
    """``part`` written into ``full`` at ``start`` along ``axis`` (added to it when ``add``),
    cast once; the overlap with an earlier chunk (``new`` False) keeps what that chunk wrote."""
    old = lax.dynamic_slice_in_dim(full, start, part.shape[axis], axis)
    value = (old + part.astype(full.dtype)) if add else part.astype(full.dtype)
    if new is not None:
        value = jnp.where(new.reshape([-1 if d == axis else 1 for d in range(part.ndim)]),
                          value, old)
    return lax.dynamic_update_slice_in_dim(full, value, start, axis)


def _grads(config: Config, residuals: tuple[Any, ...], g: jax.Array,
           into: jax.Array | None) -> tuple[jax.Array, jax.Array, Any]:
    """The gradients of hidden, weight (added into ``into`` when given) and bias."""
    hidden, weight, bias, labels, active, lse = residuals
    head, tokens = _head(config, weight, bias), chunks(hidden.shape[0], config.token_chunk)
    shard = _shard(config, head, hidden, weight, bias)
    g = jnp.where(active, g.astype(jnp.float32), 0.0)  # an inactive token has no gradient
    residual = (hidden, labels - shard.offset, active & (g != 0), lse, g)  # (a token of
    # cotangent 0 costs nothing: with every cotangent 0 no block is computed, and ``into``
    # comes back as it was; a label of another device's slice matches no column here)

    def step(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        dh, dweight, dbias = carry
        dw, db, dh = _vocab_chunk_grads(config, head, tokens, shard, j, residual, dh)
        start = head.vocab.start(j)
        new = head.vocab.new(j) if head.vocab.overlaps else None
        dweight = _write(dweight, dw, start, new, config.vocab_axis, add=into is not None)
        if dbias is not None:
            dbias = _write(dbias, db, start, new, 0, add=False)
        return dh, dweight, dbias

    init = _tiles.vary(shard.axes, (jnp.zeros(hidden.shape, jnp.float32),
                                    jnp.zeros_like(weight) if into is None else into,
                                    None if bias is None else jnp.zeros_like(bias)))
    dh, dweight, dbias = lax.fori_loop(0, head.vocab.number,
                                       step, init)
    if config.axis_name is not None:  # every device's slice adds to each token's gradient
        dh = lax.psum(dh, config.axis_name)
    return _tiles.cotangent_of(dh, hidden), dweight, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def per_token(config: Config, hidden: jax.Array, weight: jax.Array, bias: jax.Array | None,
              labels: jax.Array, active: jax.Array) -> jax.Array:
    """The loss per token, ``(T,)`` float32, of ``hidden (T, D)`` against the head ``weight``
    (and ``bias``); rows not ``active`` hold no meaningful value."""
    return _forward(config, hidden, weight, bias, labels, active)[0]


def _per_token_fwd(config: Config, hidden: jax.Array, weight: jax.Array, bias: jax.Array | None,
                   labels: jax.Array, active: jax.Array) -> tuple[Any, Any]:
    loss, lse = _forward(config, hidden, weight, bias, labels, active)
    return loss, (hidden, weight, bias, labels, active, lse)


def _per_token_bwd(config: Config, residuals: tuple[Any, ...], g: jax.Array) -> tuple[Any, ...]:
    dh, dweight, dbias = _grads(config, residuals, g, None)
    return dh, dweight, dbias, None, None


per_token.defvjp(_per_token_fwd, _per_token_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def per_token_into(config: Config, hidden: jax.Array, weight: jax.Array,
                   bias: jax.Array | None, labels: jax.Array, active: jax.Array,
                   tap: jax.Array) -> jax.Array:
    """:func:`per_token` whose weight gradient is added into the accumulator ``tap``
    (:mod:`jaxaccum._sink`): the cotangent of ``tap`` is ``tap`` plus the weight's gradient,
    in the tap's dtype, and the weight's own cotangent is 0."""
    return _forward(config, hidden, weight, bias, labels, active)[0]


def _per_token_into_fwd(config: Config, hidden: jax.Array, weight: jax.Array,
                        bias: jax.Array | None, labels: jax.Array, active: jax.Array,
                        tap: jax.Array) -> tuple[Any, Any]:
    loss, residuals = _per_token_fwd(config, hidden, weight, bias, labels, active)
    return loss, (residuals, tap)


def _per_token_into_bwd(config: Config, residuals: tuple[Any, ...],
                        g: jax.Array) -> tuple[Any, ...]:
    inner, tap = residuals
    dh, into, dbias = _grads(config, inner, g, tap)
    return dh, None, dbias, None, None, into  # (None: a symbolic zero, which XLA folds)


per_token_into.defvjp(_per_token_into_fwd, _per_token_into_bwd)
