"""Contrastive losses over in-batch negatives, tile by tile: memory linear in the batch.

``import jaxaccum.contrastive``. A contrastive loss scores every example of one side against
every example of the other: written plainly it materialises the ``B x B`` similarity matrix,
and its cotangent, which bounds the batch long before the encoders do (at ``B = 65,536`` the
logits alone are 17 GB in float32). These losses compute the same values tile by tile: a
``tile x tile`` block of scores at a time, forward and backward (a custom VJP recomputes each
block's scores in the backward pass, as flash attention does), so no array of two dimensions
of size ``B`` exists. Their value and gradients (with respect to both sides and the learnable
scale and bias) are those of the plain formula, within float32 rounding.

Use them as the ``loss`` of :func:`jaxaccum.coupled_value_and_grad` or
:func:`jaxaccum.coupled_train_step`, whose representations then are the only batch-sized
arrays (the encoders run micro-batch by micro-batch):

- :func:`clip_loss`: symmetric InfoNCE (CLIP), with a learnable logit scale;
- :func:`siglip_loss`: SigLIP's pairwise sigmoid loss, with a learnable scale and bias;
- :func:`pairwise_logsumexp` and :func:`pairwise_sum`: the building blocks, for a score of
  your own (ColBERT's max-sim over token embeddings, say).

A ``mask`` leaves examples out (padding of a last, short batch): a left-out example is neither
an anchor nor a negative, and the means are over the examples kept.

Across devices: called with ``axis_name`` inside ``jax.shard_map`` over the data axis, each
device keeps its own rows of both sides and the other side's blocks travel around a ring
(``lax.ppermute``), forward and backward: no device gathers the batch's representations, and
the loss and gradients are the whole batch's (tested equal to one device on 8 devices, Auto
and Explicit meshes, and inside :func:`jaxaccum.coupled_value_and_grad`). The building blocks
take no ``axis_name``: called per device inside ``jax.shard_map`` (this device's rows of ``a``
against a replicated ``b``; ``psum`` a :func:`pairwise_sum` yourself), their value and
gradients are one device's, a replicated input's gradient summed over the devices once.

Precision: the scores of the two losses are float32 dot products of the representations
(``preferred_element_type``), every sum over tiles is float32, the value is float32 and each
gradient comes back in its input's dtype (bfloat16 representations: bfloat16 gradients).

Examples:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> from jaxaccum.contrastive import clip_loss
  >>> mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> ring = jax.shard_map(lambda a, b: clip_loss(a, b, 2.0, tile=16, axis_name="data"),
  ...                      mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
  >>> a, b = jax.random.normal(jax.random.key(0), (2, 64, 8))
  >>> bool(jnp.allclose(ring(a, b), clip_loss(a, b, 2.0), rtol=1e-5))
  True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxaccum.contrastive import _ring, _tiles

__all__ = ["clip_loss", "pairwise_logsumexp", "pairwise_sum", "siglip_loss"]

TILE = 512
"""The default tile: 512 x 512 float32 scores (1 MiB) at a time."""


def _check_tile(entry: str, tile: Any) -> int:
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"{entry}: tile must be an int >= 1 (the rows and columns of a block "
                         f"of scores); got tile={tile!r}")
    return tile


def _rows(entry: str, name: str, tree: Any) -> int:
    leaves = jax.tree.leaves(tree)
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if not leaves or len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"{entry}: {name} must be an array (or a pytree of arrays) with a leading axis of "
            f"examples, one size for every leaf; got shapes "
            f"{[jnp.shape(x) for x in leaves]}"
        )
    (size,) = sizes
    return int(size or 0)


def _weights(entry: str, name: str, mask: ArrayLike | None, n: int) -> jax.Array:
    if mask is None:
        return jnp.ones((n,), jnp.float32)
    m = jnp.asarray(mask)
    if m.shape != (n,) or m.dtype != jnp.bool_:
        raise ValueError(
            f"{entry}: {name} must be a boolean array of shape ({n},), one flag per example "
            f"(True: kept); got {m.dtype}{list(m.shape)}"
        )
    return m.astype(jnp.float32)


def _pair(entry: str, a: ArrayLike, b: ArrayLike) -> tuple[jax.Array, jax.Array]:
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(
            f"{entry}: a and b must be (batch, dim) arrays of one shape, the representations "
            f"of the two sides (row i of each: a matching pair); got {a.shape} and {b.shape}"
        )
    return a, b


def _scalar(entry: str, name: str, value: ArrayLike) -> jax.Array:
    x = jnp.asarray(value, jnp.float32)
    if x.ndim:
        raise ValueError(
            f"{entry}: {name} must be a scalar (one learnable value for every pair); got shape "
            f"{tuple(x.shape)}; pass a 0-d array, e.g. jnp.asarray(jnp.log(10.0))"
        )
    return x


def _check_block(entry: str, name: str, fn: Callable[..., Any], params: Any, a: Any, b: Any,
                 ta: int, tb: int, *extra: Any) -> None:
    """``fn(params, a's first ta examples, b's first tb, *extra)`` must give one float per
    pair of that tile."""
    head = lambda tree, n: jax.tree.map(lambda x: x[:n], tree)  # noqa: E731
    out = jax.eval_shape(fn, params, head(a, ta), head(b, tb), *extra)
    shape = getattr(out, "shape", None)
    if shape != (ta, tb):
        raise ValueError(
            f"{entry}: {name} must return one value per pair of a tile, shape (len(x), len(y)) "
            f"= ({ta}, {tb}) for tiles of {ta} and {tb} examples; got "
            f"{shape if shape is not None else type(out).__name__}; reduce over every axis "
            "but the two example axes"
        )


def _float32_params(params: Any) -> Any:
    """Floating leaves narrower than float32 (bf16, float16) as float32: the score sees them so
    in every tile, forward and backward, and their gradient is summed over the tiles in float32
    and rounded to their dtype once (JAX's pullback of a bf16 input is bf16: taken per tile,
    each tile's share would be rounded before the sum)."""
    def one(x: Any) -> Any:
        dtype = jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
            return jnp.asarray(x).astype(jnp.float32)
        return x
    return jax.tree.map(one, params)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum("id,jd->ij", a, b, preferred_element_type=jnp.float32)


def clip_loss(a: ArrayLike, b: ArrayLike, logit_scale: ArrayLike, *, tile: int = TILE,
              mask: ArrayLike | None = None, axis_name: str | None = None) -> jax.Array:
    """Symmetric InfoNCE (CLIP) over in-batch negatives, tile by tile.

    With scores ``s_ij = exp(logit_scale) * a_i . b_j``, the mean over the examples kept of
    the cross-entropy of each ``a_i`` against every ``b_j`` (its match ``b_i`` the label),
    and of each ``b_j`` against every ``a_i``, averaged:
    ``(mean_i [logsumexp_j s_ij - s_ii] + mean_j [logsumexp_i s_ij - s_jj]) / 2``.

    Args:
      a: ``(B, d)``, one side's representations (normalise them yourself if you want cosine
        similarities, as CLIP does).
      b: ``(B, d)``, the other side's; row ``i`` matches ``a``'s row ``i``.
      logit_scale: a scalar, the log of the multiplier of the dot products (CLIP's learnable
        ``logit_scale``, initialised to ``log(1 / 0.07)``).
      tile: the rows and columns of a block of scores computed at once (default 512: a
        512 x 512 float32 block, 1 MiB).
      mask: ``(B,)`` booleans, False for examples left out (padding).
      axis_name: inside ``jax.shard_map``, the mesh axis the batch is split over: ``a``,
        ``b`` and ``mask`` are then this device's rows, and the loss is the whole batch's
        (the same on every device), computed by a ring of ``lax.ppermute`` hops (the
        module's docstring says how).

    Returns:
      A float32 scalar.

    Raises:
      ValueError: ``a`` and ``b`` not ``(B, d)`` of one shape, a bad ``mask`` or ``tile``,
        a ``logit_scale`` that is not a scalar.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from jaxaccum.contrastive import clip_loss
      >>> a, b = jax.random.normal(jax.random.key(0), (2, 100, 8))
      >>> logits = a @ b.T * 2.0
      >>> labels = jnp.arange(100)
      >>> plain = (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      ...          + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2
      >>> bool(jnp.allclose(clip_loss(a, b, jnp.log(2.0), tile=32), plain, rtol=1e-5))
      True
    """
    entry = "jaxaccum.contrastive.clip_loss"
    a, b = _pair(entry, a, b)
    tile = _check_tile(entry, tile)
    w = _weights(entry, "mask", mask, a.shape[0])
    scale = _scalar(entry, "logit_scale", logit_scale)

    def score(log_scale: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.exp(log_scale) * _dot(x, y)

    if axis_name is None:
        rows, cols = _tiles.logsumexp(score, tile, True, scale, a, b, w, w)
    else:
        rows, cols = _ring.logsumexp(score, tile, axis_name, scale, a, b, w, w)
    matched = jnp.exp(scale) * jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32), axis=1)
    both = jnp.where(w > 0, rows + cols - 2 * matched, 0.0)
    return _mean(jnp.sum(both), jnp.sum(w), axis_name) / 2


def _mean(total: jax.Array, kept: jax.Array, axis_name: str | None) -> jax.Array:
    """``total / kept``, both summed over the devices of ``axis_name`` first if given."""
    if axis_name is not None:
        total, kept = jax.lax.psum((total, kept), axis_name)
    return total / kept


def siglip_loss(a: ArrayLike, b: ArrayLike, logit_scale: ArrayLike, logit_bias: ArrayLike, *,
                tile: int = TILE, mask: ArrayLike | None = None,
                axis_name: str | None = None) -> jax.Array:
    """SigLIP's pairwise sigmoid loss over in-batch negatives, tile by tile.

    With logits ``x_ij = exp(logit_scale) * a_i . b_j + logit_bias`` and labels ``z_ij = 1``
    for a matching pair (``i == j``), ``-1`` otherwise: ``-sum_ij log sigmoid(z_ij x_ij) / n``
    over the pairs of kept examples, ``n`` the examples kept (Zhai et al. 2023, who normalise by
    the batch size).

    Args:
      a: ``(B, d)``, one side's representations.
      b: ``(B, d)``, the other side's; row ``i`` matches ``a``'s row ``i``.
      logit_scale: a scalar, the log of the multiplier (SigLIP's ``t'``, initialised to
        ``log 10``).
      logit_bias: a scalar added to every logit (initialised to -10 in SigLIP).
      tile: the rows and columns of a block of logits computed at once (default 512: a
        512 x 512 float32 block, 1 MiB).
      mask: ``(B,)`` booleans, False for examples left out (padding).
      axis_name: inside ``jax.shard_map``, the mesh axis the batch is split over (as for
        :func:`clip_loss`): the loss is the whole batch's, by a ring.

    Returns:
      A float32 scalar.

    Raises:
      ValueError: ``a`` and ``b`` not ``(B, d)`` of one shape, a bad ``mask`` or ``tile``,
        a ``logit_scale`` or ``logit_bias`` that is not a scalar.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxaccum.contrastive import siglip_loss
      >>> a, b = jax.random.normal(jax.random.key(0), (2, 50, 8))
      >>> x = a @ b.T * 3.0 - 1.0
      >>> z = 2 * jnp.eye(50) - 1
      >>> plain = -jnp.sum(jax.nn.log_sigmoid(z * x)) / 50
      >>> bool(jnp.allclose(siglip_loss(a, b, jnp.log(3.0), -1.0, tile=16), plain, rtol=1e-5))
      True
    """
    entry = "jaxaccum.contrastive.siglip_loss"
    a, b = _pair(entry, a, b)
    tile = _check_tile(entry, tile)
    w = _weights(entry, "mask", mask, a.shape[0])
    params = (_scalar(entry, "logit_scale", logit_scale),
              _scalar(entry, "logit_bias", logit_bias))

    def term(p: tuple[jax.Array, jax.Array], x: jax.Array, y: jax.Array,
             positive: jax.Array) -> jax.Array:
        logits = jnp.exp(p[0]) * _dot(x, y) + p[1]
        return -jax.nn.log_sigmoid(jnp.where(positive, logits, -logits))

    if axis_name is None:
        return _tiles.total(term, tile, params, a, b, w, w) / jnp.sum(w)
    return _ring.total(term, tile, axis_name, params, a, b, w, w) / jax.lax.psum(
        jnp.sum(w), axis_name)


def pairwise_logsumexp(score: Callable[[Any, Any, Any], jax.Array], params: Any, a: Any,
                       b: Any, *, tile: int = TILE, mask: ArrayLike | None = None) -> jax.Array:
    """For every example ``a_i``, ``log sum_j exp(score_ij)`` over the examples ``b_j``, tile by
    tile: the denominator of an InfoNCE loss with a score of your own.

    Args:
      score: ``score(params, x, y)``: the ``(len(x), len(y))`` float scores of a tile of
        ``a``'s examples against a tile of ``b``'s (e.g. ColBERT's max-sim of token
        embeddings). It must be differentiable and treat examples independently.
      params: a pytree the score depends on (differentiated: a temperature, say); ``None`` if
        none. Leaves of a 16-bit float dtype reach ``score`` as float32 (their gradient comes
        back in their dtype, summed over the tiles in float32).
      a: an array or pytree of arrays whose leaves share a leading axis of ``n_a`` examples.
      b: the same for ``n_b`` examples.
      tile: the examples of each side in a tile (default 512: 512 x 512 float32 scores,
        1 MiB, at a time).
      mask: ``(n_b,)`` booleans, False for the examples of ``b`` left out of the sum.

    Returns:
      ``(n_a,)`` float32; ``-inf`` where no example of ``b`` is kept (every row when ``b``
      has none).

    Raises:
      ValueError: leaves of ``a`` or ``b`` without one leading size, a bad ``mask`` or
        ``tile``, a ``score`` that does not give one value per pair of a tile.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxaccum.contrastive import pairwise_logsumexp
      >>> q, d = jax.random.normal(jax.random.key(0), (2, 40, 5, 8))  # 40 examples, 5 tokens
      >>> def max_sim(p, x, y):  # ColBERT: each query token's best match, summed
      ...     return p * jnp.einsum("itd,jsd->ijts", x, y).max(-1).sum(-1)
      >>> plain = jax.nn.logsumexp(max_sim(0.5, q, d), axis=1)
      >>> bool(jnp.allclose(pairwise_logsumexp(max_sim, 0.5, q, d, tile=16), plain, rtol=1e-5))
      True
    """
    entry = "jaxaccum.contrastive.pairwise_logsumexp"
    tile = _check_tile(entry, tile)
    n_a, n_b = _rows(entry, "a", a), _rows(entry, "b", b)
    _check_block(entry, "score", score, params, a, b, min(tile, n_a), min(tile, n_b))
    wb = _weights(entry, "mask", mask, n_b)
    if n_a == 0 or n_b == 0:  # a sum over nothing: log 0 = -inf for every row, no tile
        return jnp.full((n_a,), -jnp.inf, jnp.float32)
    return _tiles.logsumexp(score, tile, False, _float32_params(params), a, b,
                            jnp.ones((n_a,), jnp.float32), wb)[0]


def pairwise_sum(term: Callable[[Any, Any, Any, jax.Array], jax.Array], params: Any, a: Any,
                 b: Any, *, tile: int = TILE, mask_a: ArrayLike | None = None,
                 mask_b: ArrayLike | None = None) -> jax.Array:
    """``sum_ij term_ij`` over every pair of examples ``(a_i, b_j)``, tile by tile.

    Args:
      term: ``term(params, x, y, positive)``: the ``(len(x), len(y))`` float values of a tile
        of pairs; ``positive`` is the tile's boolean matrix of ``i == j`` (the matching pairs
        when ``a`` and ``b`` are the two sides of one batch).
      params: a pytree the term depends on (differentiated); ``None`` if none. Leaves of a
        16-bit float dtype reach ``term`` as float32 (their gradient comes back in their
        dtype, summed over the tiles in float32).
      a: an array or pytree of arrays whose leaves share a leading axis of ``n_a`` examples.
      b: the same for ``n_b`` examples.
      tile: the examples of each side in a tile (default 512: 512 x 512 float32 scores,
        1 MiB, at a time).
      mask_a: ``(n_a,)`` booleans, False for examples of ``a`` left out.
      mask_b: ``(n_b,)`` booleans, False for examples of ``b`` left out.

    Returns:
      A float32 scalar (0 when a side has no example).

    Raises:
      ValueError: leaves of ``a`` or ``b`` without one leading size, a bad mask or ``tile``,
        a ``term`` that does not give one value per pair of a tile.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxaccum.contrastive import pairwise_sum
      >>> a, b = jnp.arange(6.0).reshape(3, 2), jnp.ones((4, 2))
      >>> float(pairwise_sum(lambda p, x, y, pos: x @ y.T, None, a, b, tile=2))
      60.0
    """
    entry = "jaxaccum.contrastive.pairwise_sum"
    tile = _check_tile(entry, tile)
    n_a, n_b = _rows(entry, "a", a), _rows(entry, "b", b)
    ta, tb = min(tile, n_a), min(tile, n_b)
    _check_block(entry, "term", term, params, a, b, ta, tb, jnp.eye(ta, tb, dtype=bool))
    wa, wb = _weights(entry, "mask_a", mask_a, n_a), _weights(entry, "mask_b", mask_b, n_b)
    if n_a == 0 or n_b == 0:  # a sum over no pair, no tile
        return jnp.zeros((), jnp.float32)
    return _tiles.total(term, tile, _float32_params(params), a, b, wa, wb)
