"""The losses over packed micro-batches that keep accumulation exact, and the masks packed
rows need."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp


def _loss_and_segments(entry: str, per_token_loss: Any, segment_ids: Any) -> tuple[Any, Any]:
    loss, seg = jnp.asarray(per_token_loss), jnp.asarray(segment_ids)
    if loss.shape != seg.shape or loss.ndim < 1:
        raise ValueError(
            f"{entry}: per_token_loss and segment_ids must have one shape (..., length), a "
            f"loss per token; got per_token_loss {loss.shape} and segment_ids {seg.shape}"
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            f"{entry}: per_token_loss must have a floating dtype; got {loss.dtype}"
        )
    if not jnp.issubdtype(seg.dtype, jnp.integer):
        raise TypeError(
            f"{entry}: segment_ids must have an integer dtype (as jaxaccum.packing.pack "
            f"returns); got {seg.dtype}"
        )
    return loss, seg


def _sum_dtype(dtype: Any) -> Any:
    """Sums and counts in float32 at least (a bfloat16 count is exact only to 256)."""
    return jnp.promote_types(dtype, jnp.float32)


def token_mean(per_token_loss: Any, segment_ids: Any) -> tuple[jax.Array, jax.Array]:
    """The mean loss over the real tokens of a packed micro-batch, and their number.

    With the accumulation's ``weighted=True``, returning this pair from the loss function
    makes the result the exact mean over every real token of the whole batch: micro-batch i
    with ``n_i`` real tokens whose losses sum to ``S_i`` gives ``(S_i / n_i, n_i)``, and the
    accumulation computes ``sum_i (S_i / n_i) n_i / sum_i n_i = sum_i S_i / sum_i n_i``, the
    same mean one unpacked batch of every sequence gives (up to float rounding), however the
    tokens fall into micro-batches. The mean of the per-micro-batch means,
    ``(1/M) sum_i S_i / n_i``, is not: it weights the tokens of sparse micro-batches more.

    An all-padding micro-batch gives ``(0, 0)``: it adds nothing (no NaN, no gradient). For a
    next-token loss, pass as ``segment_ids`` those of the positions that have a target (the
    last token of each sequence predicts nothing), so that they are the ones counted.

    Args:
      per_token_loss: a floating ``(..., length)`` array, a loss per token; its values in
        padding are ignored (they must be finite for a finite gradient).
      segment_ids: the integer ``(..., length)`` segment ids, 0 in padding (as
        :func:`pack` returns them for the micro-batch).

    Returns:
      ``(value, weight)``: the mean over the real tokens (0 with none) and their number,
      both in float32 (float64 for a float64 loss): a bfloat16 loss's mean is not rounded
      to bfloat16 before the accumulation weights it.

    Raises:
      ValueError: the two shapes differ, or are scalars.
      TypeError: a loss that is not floating or segment ids that are not integers.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxaccum.packing import token_mean
      >>> seg = jnp.array([[1, 1, 2, 0], [1, 1, 1, 1]])
      >>> loss = jnp.array([[1.0, 2.0, 3.0, 99.0], [4.0, 5.0, 6.0, 7.0]])
      >>> value, weight = token_mean(loss, seg)
      >>> float(value), float(weight)  # (1 + 2 + ... + 7) / 7
      (4.0, 7.0)
    """
    loss, seg = _loss_and_segments("jaxaccum.packing.token_mean", per_token_loss, segment_ids)
    acc = _sum_dtype(loss.dtype)
    real = seg > 0
    count = jnp.sum(real, dtype=acc)
    total = jnp.sum(jnp.where(real, loss, 0), dtype=acc)
    # the mean stays in the sum's dtype: rounded to a 16-bit loss here, each micro-batch's
    # mean would lose half an ulp before it is weighted
    return total / jnp.maximum(count, 1), count


def sequence_mean(per_token_loss: Any, segment_ids: Any) -> tuple[jax.Array, jax.Array]:
    """The mean over the sequences of a packed micro-batch of each one's token-mean loss, and
    the number of sequences.

    A sequence is a (row, segment id) pair: every leading axis of ``segment_ids`` counts as
    rows, and a packed sequence lives in one row. The per-sequence sums and token counts come
    from one ``jax.ops.segment_sum`` over ``row * (length + 1) + segment id`` (static shapes);
    the sequences present are those with at least one real token.

    With ``weighted=True`` the result is exact: micro-batch i holding ``c_i`` sequences whose
    token-means are ``m_j`` gives ``(sum_j m_j / c_i, c_i)``, and the accumulation computes
    ``sum_i (sum_j m_j / c_i) c_i / sum_i c_i``, the mean of ``m_j`` over every sequence of the
    batch: what each sequence run alone and averaged gives. It needs each sequence whole in
    one micro-batch, which :func:`pack` guarantees (it never splits one).

    Args:
      per_token_loss: a floating ``(..., length)`` array, a loss per token; padding ignored.
      segment_ids: the integer ``(..., length)`` segment ids, 0 in padding, each in
        ``0 .. length`` (as :func:`pack` returns them). For a next-token loss pass those of the
        positions that have a target; a sequence of one token then has none and is not
        counted.

    Returns:
      ``(value, weight)``: the mean of the per-sequence means (0 with none) and the number
      of sequences present, both in float32 (float64 for a float64 loss).

    Raises:
      ValueError: the two shapes differ, or are scalars.
      TypeError: a loss that is not floating or segment ids that are not integers.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxaccum.packing import sequence_mean
      >>> seg = jnp.array([[1, 1, 2, 0], [1, 1, 1, 1]])
      >>> loss = jnp.array([[1.0, 2.0, 2.0, 99.0], [4.0, 5.0, 6.0, 7.0]])
      >>> value, weight = sequence_mean(loss, seg)
      >>> float(value), float(weight)  # the mean of 1.5, 2.0 and 5.5
      (3.0, 3.0)
    """
    loss, seg = _loss_and_segments("jaxaccum.packing.sequence_mean", per_token_loss, segment_ids)
    acc = _sum_dtype(loss.dtype)
    length = seg.shape[-1]
    num_rows = math.prod(seg.shape[:-1])
    real = seg > 0
    ids = (jnp.arange(num_rows)[:, None] * (length + 1) + seg.reshape(num_rows, length))
    ids = ids.reshape(-1)
    slots = num_rows * (length + 1)
    sums = jax.ops.segment_sum(jnp.where(real, loss, 0).reshape(-1).astype(acc), ids, slots)
    counts = jax.ops.segment_sum(real.reshape(-1).astype(acc), ids, slots)
    present = counts > 0  # padding (segment 0) is never counted
    means = sums / jnp.maximum(counts, 1)
    number = jnp.sum(present, dtype=acc)
    total = jnp.sum(jnp.where(present, means, 0))
    return total / jnp.maximum(number, 1), number  # in the sums' dtype, as token_mean


def next_token_segments(segment_ids: Any) -> jax.Array:
    """The segment ids of the positions that have a next-token target, 0 elsewhere.

    Position t of a packed row predicts token t + 1 only when that token belongs to the same
    sequence: the last token of each sequence, padding and the row's last position have no
    target. Pass the result to :func:`token_mean` or :func:`sequence_mean` with a next-token
    loss, so that only real predictions are counted.

    Args:
      segment_ids: the integer ``(..., length)`` segment ids (0 in padding).

    Returns:
      An array like ``segment_ids``: its id where the next position is in the same segment,
      else 0.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxaccum.packing import next_token_segments
      >>> next_token_segments(jnp.array([[1, 1, 1, 2, 2, 0]])).tolist()
      [[1, 1, 0, 2, 0, 0]]
    """
    seg = jnp.asarray(segment_ids)
    following = jnp.concatenate([seg[..., 1:], jnp.zeros_like(seg[..., :1])], axis=-1)
    return jnp.where(following == seg, seg, 0)


def attention_mask(segment_ids: Any) -> jax.Array:
    """The attention mask of packed rows: causal, within a sequence, and not from padding.

    ``mask[..., q, k]`` is True where query position q may attend to key position k:
    ``k <= q``, both in the same segment, and that segment not padding. A padding query has
    no True entry: fill the masked scores with a large finite negative number (e.g.
    ``jnp.finfo(dtype).min``) rather than ``-inf``, or its softmax is 0/0; masked entries then
    get exactly 0 weight, so no sequence sees another's tokens.

    Args:
      segment_ids: integer ``(..., length)`` segment ids, 0 in padding.

    Returns:
      A bool array of shape ``(..., length, length)``.

    Raises:
      ValueError: ``segment_ids`` is a scalar (it has no length axis).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxaccum.packing import attention_mask
      >>> attention_mask(jnp.array([1, 1, 2, 0])).astype(int)
      Array([[1, 0, 0, 0],
             [1, 1, 0, 0],
             [0, 0, 1, 0],
             [0, 0, 0, 0]], dtype=int32)
    """
    seg = jnp.asarray(segment_ids)
    if seg.ndim < 1:
        raise ValueError(
            f"jaxaccum.packing.attention_mask: segment_ids must have shape (..., length); got "
            f"a scalar of shape {seg.shape}"
        )
    length = seg.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    query, key = seg[..., :, None], seg[..., None, :]
    return (query == key) & (query > 0) & causal

