"""``linear_cross_entropy``: the cross-entropy of ``hidden @ weight`` without the logits."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxaccum import _sink
from jaxaccum._cross_entropy import _checks, _split
from jaxaccum._cross_entropy._vjp import Config

Reduction = Literal["mean", "sum", "none", "weighted"]


def linear_cross_entropy(
    hidden: ArrayLike,
    weight: ArrayLike,
    labels: ArrayLike,
    *,
    bias: ArrayLike | None = None,
    weights: ArrayLike | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    vocab_axis: int = 0,
    axis_name: str | None = None,
    token_chunk: int = 2048,
    vocab_chunk: int = 2048,
) -> Any:
    """The cross-entropy of the logits ``hidden @ weight (+ bias)``, chunk by chunk: the
    ``tokens x vocabulary`` logits never exist, in the forward pass or the backward.

    Tokens are taken ``token_chunk`` at a time and the vocabulary ``vocab_chunk`` at a time;
    the largest buffer is one block of ``token_chunk x vocab_chunk`` float32 logits. The
    backward pass recomputes each block's logits instead of keeping them. Every sum (over the
    vocabulary, the tokens and the chunks) is in float32. The logits' products are in the
    inputs' dtype, summed in float32; the backward pass multiplies the logits' gradient in
    float32, unrounded. Any vocabulary size works: a size that the chunk
    does not divide is masked, not padded. A token chunk whose labels are all
    ``ignore_index`` costs no matmul.

    For gradient accumulation, return ``reduction="weighted"`` from the loss function with
    ``weighted=True``: the pair ``(mean over the micro-batch's tokens, their weight)`` makes the
    accumulated loss and gradient the exact token mean of the whole batch, however the ignored
    tokens fall into micro-batches. For packed sequences, pass ``reduction="none"`` to
    :func:`jaxaccum.packing.token_mean` or :func:`jaxaccum.packing.sequence_mean`.

    Args:
      hidden: ``(..., D)`` floating: the last hidden states, one row a token.
      weight: the output layer: ``(V, D)`` with ``vocab_axis=0`` (an embedding table, a
        PyTorch ``Linear``), ``(D, V)`` with ``vocab_axis=1`` (a Flax ``Dense`` kernel).
      labels: integers of shape ``hidden.shape[:-1]``, in ``[0, V)`` or ``ignore_index``. A
        label outside both gives a NaN loss.
      bias: ``(V,)`` or ``None``.
      weights: per-token weights of the shape of ``labels`` (default 1): each token's loss is
        multiplied by its weight, and ``"mean"`` divides by the weights' sum.
      ignore_index: the label of tokens that have no target (loss 0, weight 0).
      reduction: ``"mean"``: ``sum(w * loss) / sum(w)`` over the tokens not ignored (0 with
        none); ``"sum"``: ``sum(w * loss)``; ``"none"``: ``w * loss`` per token, of the shape
        of ``labels`` (0 where ignored); ``"weighted"``: the pair ``("mean", sum(w))``, what a
        loss returns with ``weighted=True``.
      label_smoothing: ``eps`` in ``[0, 1)``: the target puts ``1 - eps`` on the label and
        ``eps / V`` on every class.
      z_loss: the coefficient of the auxiliary ``log(sum(exp(logits)))**2`` term (PaLM's
        z-loss), added to each token's loss.
      vocab_axis: 0 or 1: the axis of ``weight`` that runs over the vocabulary.
      axis_name: the mesh axis the vocabulary is split over (tensor parallelism), or None.
        Under a mesh that has that axis (``jax.set_mesh``, or a jaxaccum step on that mesh),
        pass the whole sharded ``weight``: the loss splits the vocabulary over the axis itself
        (on Auto axes inside jaxaccum's micro-batch loop each device adds its slice's gradient
        into its slice of the accumulator; on a mesh of Explicit axes each array is split as
        its type says, and a weight typed as split needs its ``axis_name``). Inside a
        ``jax.shard_map`` over the axis, each device passes its slice of ``weight`` (and
        ``bias``), in the axis's order. Either way every device passes the same ``hidden`` and
        ``labels`` (global ids), computes its slice's log-sum-exp, and the slices are combined
        over the axis; the weight is never gathered. V must split evenly over the axis, and
        it is never a data axis (one the tokens are split over).
      token_chunk: tokens a chunk holds (at most; the last chunk may overlap the one before).
      vocab_chunk: vocabulary entries a chunk holds (at most).

    Returns:
      A float32 scalar (``"mean"``, ``"sum"``), a float32 array of the shape of ``labels``
      (``"none"``), or a pair of float32 scalars (``"weighted"``). The gradients have the dtypes
      of ``hidden``, ``weight`` and ``bias``.

    Raises:
      TypeError: if ``hidden``, ``weight``, ``bias`` or ``weights`` is not floating, ``labels``
        not integer, or an option not of its type.
      ValueError: for shapes that do not fit together (the message says which
        ``vocab_axis`` fits), an unknown ``reduction``, an option out of its range, an
        ``axis_name`` of no mesh in context or ``shard_map``, a data axis as ``axis_name``, a
        V that does not split evenly over it, or (on Explicit axes) a weight, bias or hidden
        split otherwise than described under ``axis_name``.
      NotImplementedError: for arrays sharded over the Explicit axes of a mesh whose axes are
        not all Explicit.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxaccum
      >>> h = jax.random.normal(jax.random.key(0), (6, 8))
      >>> w = jax.random.normal(jax.random.key(1), (50, 8))
      >>> y = jnp.array([3, 7, -100, 49, 0, 12])
      >>> loss = jaxaccum.linear_cross_entropy(h, w, y, vocab_chunk=16, token_chunk=4)
      >>> dense = optax.softmax_cross_entropy_with_integer_labels(h @ w.T, jnp.maximum(y, 0))
      >>> bool(jnp.allclose(loss, jnp.sum(jnp.where(y >= 0, dense, 0)) / 5, rtol=1e-5))
      True
    """
    entry = "jaxaccum.linear_cross_entropy"
    param = weight  # as passed: inside jaxaccum's loop its accumulator is found by identity
    hidden, weight, labels, bias, weights = _checks.arrays(entry, hidden, weight, labels, bias,
                                                           weights, vocab_axis)
    axis_name, where = _checks.where(entry, axis_name, hidden, weight, bias)
    config = Config(vocab_axis, _checks.chunk(entry, token_chunk, "token_chunk"),
                    _checks.chunk(entry, vocab_chunk, "vocab_chunk"),
                    *_checks.coefficients(entry, label_smoothing, z_loss), axis_name)
    _checks.reduction(entry, reduction)
    vocab_size = weight.shape[vocab_axis]
    if where != "here" and axis_name is not None:
        _checks.divides(entry, vocab_size, axis_name)
    elif axis_name is not None:  # inside shard_map: this device holds one slice
        _checks.tokens_whole(entry, axis_name, _checks.token_axes(hidden, labels))
        vocab_size = vocab_size * jax.lax.psum(1, axis_name)
    shape, flat = labels.shape, labels.reshape(-1)
    active = flat != ignore_index
    in_range = (flat >= 0) & (flat < vocab_size)
    with jax.named_scope("linear_cross_entropy"):
        loss = jnp.zeros(flat.shape, jnp.float32)
        if flat.size:
            tap = _sink.tap_for(param)  # the weight's accumulator, or None
            run = {"here": _split.losses, "axis": _split.over_axis, "mesh": _split.over_mesh}
            loss = run[where](
                config, hidden.reshape(-1, hidden.shape[-1]), weight,
                None if bias is None else jnp.asarray(bias),
                jnp.where(in_range, flat, 0), active & in_range, tap)
        # a label neither in range nor ignored: NaN, never a silently wrong loss
        loss = jnp.where(active, jnp.where(in_range, loss, jnp.nan), 0.0)
        w = jnp.ones(flat.shape, jnp.float32) if weights is None else (
            jnp.asarray(weights).reshape(-1).astype(jnp.float32))
        w = jnp.where(active, w, 0.0)
        return _reduce(reduction, (w * loss).reshape(shape), jnp.sum(w))


def _reduce(reduction: str, weighted_loss: jax.Array, weight: jax.Array) -> Any:
    if reduction == "none":
        return weighted_loss
    total = jnp.sum(weighted_loss)
    if reduction == "sum":
        return total
    mean = total / jnp.where(weight == 0, 1.0, weight)
    return mean if reduction == "mean" else (mean, weight)


__all__ = ["linear_cross_entropy"]
