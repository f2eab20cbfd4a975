"""The tile engine of the contrastive losses: pairwise reductions of ``score(params, a, b)``
over every pair ``(a_i, b_j)``, tile by tile, with a custom VJP that recomputes each tile's
scores in the backward pass (as flash attention does), so that no ``(n_a, n_b)`` array exists
in the forward or the backward pass.

Two reductions: :func:`logsumexp` (per row ``i``, a streaming log-sum-exp over the valid
columns ``j``) and :func:`total` (the sum of a per-pair term over the valid pairs). Inputs are
pytrees whose leaves share a leading axis (the examples); they are padded to whole tiles, and
the padding is masked out with the validity weights.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

Score = Callable[[Any, Any, Any], jax.Array]
Term = Callable[[Any, Any, Any, jax.Array], jax.Array]


class Grid(NamedTuple):
    """The tiling of ``n_a`` rows by ``n_b`` columns: tiles of ``ta`` by ``tb``, ``rows`` by
    ``cols`` of them (the inputs padded to ``rows * ta`` and ``cols * tb``)."""

    n_a: int
    n_b: int
    ta: int
    tb: int
    rows: int
    cols: int


def grid(n_a: int, n_b: int, tile: int) -> Grid:
    ta, tb = max(1, min(tile, n_a)), max(1, min(tile, n_b))
    return Grid(n_a, n_b, ta, tb, -(-n_a // ta), -(-n_b // tb))


def pad(tree: Any, size: int) -> Any:
    """Each leaf padded with zeros along its leading axis to ``size``."""
    def one(x: jax.Array) -> jax.Array:
        return jnp.pad(x, [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    return jax.tree.map(one, tree)


def take(tree: Any, start: jax.Array, size: int) -> Any:
    return jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, start, size), tree)


def put_add(tree: Any, start: jax.Array, part: Any) -> Any:
    """``tree[start:start + len(part)] += part``, leaf by leaf, in place in a loop."""
    def one(x: jax.Array, p: jax.Array) -> jax.Array:
        size = p.shape[0]
        return lax.dynamic_update_slice_in_dim(
            x, lax.dynamic_slice_in_dim(x, start, size) + p.astype(x.dtype), start, 0)
    return jax.tree.map(one, tree, part)


def varying(*trees: Any) -> tuple[str, ...]:
    """The mesh axes any leaf of ``trees`` varies over (inside ``jax.shard_map``; none
    outside it), sorted."""
    axes: set[str] = set()
    for x in jax.tree.leaves(trees):
        axes |= set(jax.typeof(x).manual_axis_type.varying)
    return tuple(sorted(axes))


def vary(axes: tuple[str, ...], tree: Any) -> Any:
    """Each leaf of ``tree`` typed as varying over ``axes`` (those it does not yet vary
    over). A loop's carry must keep its type, and a carry updated from device-varying inputs
    (this device's rows, say) becomes varying: its initial value (zeros, -inf) must be typed
    so from the start."""
    def one(x: Any) -> Any:
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(one, tree)


def _zeros_like(tree: Any) -> Any:
    """Float32 accumulators for the cotangents of ``tree``'s leaves (summed over many tiles)."""
    return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), tree)


def cast_like(tree: Any, like: Any) -> Any:
    return jax.tree.map(lambda x, y: x.astype(jnp.result_type(y)), tree, like)


def cotangent_of(tree: Any, like: Any) -> Any:
    """Float32 cotangent sums as the cotangents of the primal ``like``: each leaf summed over
    the mesh axes it varies over and its primal does not (an input the same on every device,
    whose per-device uses all contribute: the transpose of its implicit ``pcast`` to varying
    is this ``psum``), in float32, then cast to the primal's dtype."""
    def one(x: jax.Array, y: Any) -> jax.Array:
        have = set(jax.typeof(y).manual_axis_type.varying)
        extra = tuple(ax for ax in varying(x) if ax not in have)
        return (lax.psum(x, extra) if extra else x).astype(jnp.result_type(y))
    return jax.tree.map(one, tree, like)


def inputs(g: Grid, a: Any, b: Any, wa: jax.Array, wb: jax.Array) -> tuple[Any, ...]:
    return (pad(a, g.rows * g.ta), pad(b, g.cols * g.tb), pad(wa, g.rows * g.ta),
            pad(wb, g.cols * g.tb))


def _lse(score: Score, g: Grid, both: bool, params: Any, a: Any, b: Any, wa: jax.Array,
         wb: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The padded forward: for every row, log sum_j exp(score_ij) over the columns of weight
    > 0; with ``both``, for every column too, over the rows of weight > 0 (else zeros)."""
    rows, cols = lse_stats(score, g, both, params, a, b, wa, wb, empty_stats(g.rows * g.ta),
                           empty_stats(g.cols * g.tb if both else 1))
    return finish(*rows), finish(*cols) if both else jnp.zeros((g.cols * g.tb,))


def empty_stats(n: int) -> tuple[jax.Array, jax.Array]:
    """The running maximum and sum of a streaming log-sum-exp over nothing yet."""
    return jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32)


def lse_stats(score: Score, g: Grid, both: bool, params: Any, a: Any, b: Any, wa: jax.Array,
              wb: jax.Array, rows: tuple[jax.Array, jax.Array],
              cols: tuple[jax.Array, jax.Array]) -> tuple[Any, Any]:
    """The streaming log-sum-exp statistics ``(max, sum)`` of every row (over the columns of
    weight > 0) and, with ``both``, of every column (over the rows of weight > 0), updated
    from ``rows`` and ``cols`` with the scores of ``a`` (padded) against ``b`` (padded)."""
    # the carries vary over every axis the scores can (inside shard_map)
    axes = varying(params, a, b, wa, wb, rows, cols)
    rows, cols = vary(axes, rows), vary(axes, cols)

    def row_tile(cols: tuple[jax.Array, jax.Array], r: jax.Array) -> tuple[Any, Any]:
        x, row_ok = take(a, r * g.ta, g.ta), take(wa, r * g.ta, g.ta) > 0

        def col_tile(carry: tuple[jax.Array, ...], c: jax.Array) -> tuple[Any, None]:
            m, s, cm, cs = carry
            y, col_ok = take(b, c * g.tb, g.tb), take(wb, c * g.tb, g.tb) > 0
            z = score(params, x, y).astype(jnp.float32)
            m, s = _stream(m, s, jnp.where(col_ok[None, :], z, -jnp.inf), axis=1)
            if both:
                seg_m, seg_s = _stream(take(cm, c * g.tb, g.tb), take(cs, c * g.tb, g.tb),
                                       jnp.where(row_ok[:, None], z, -jnp.inf), axis=0)
                cm = lax.dynamic_update_slice_in_dim(cm, seg_m, c * g.tb, 0)
                cs = lax.dynamic_update_slice_in_dim(cs, seg_s, c * g.tb, 0)
            return (m, s, cm, cs), None

        start = (take(rows[0], r * g.ta, g.ta), take(rows[1], r * g.ta, g.ta))
        (m, s, cm, cs), _ = lax.scan(col_tile, (*start, *cols), jnp.arange(g.cols))
        return (cm, cs), (m, s)

    cols, (m, s) = lax.scan(row_tile, cols, jnp.arange(g.rows))
    return (m.reshape(-1), s.reshape(-1)), cols


def _stream(m: jax.Array, s: jax.Array, z: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """A streaming log-sum-exp step: the running maximum ``m`` and the sum ``s`` of
    ``exp(. - m)``, updated with the scores ``z`` reduced along ``axis``."""
    new = jnp.maximum(m, jnp.max(z, axis=axis))
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    return new, s * jnp.exp(m - safe) + jnp.sum(jnp.exp(z - jnp.expand_dims(safe, axis)),
                                                axis=axis)


def finish(m: jax.Array, s: jax.Array) -> jax.Array:
    """``m + log s``, -inf where nothing was summed."""
    return jnp.where(s > 0, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(s), -jnp.inf)


def pullback(tile_ct: Callable[..., tuple[Any, ...]], g: Grid, params: Any, a: Any,
             b: Any, *context: Any) -> tuple[Any, Any, Any]:
    """Sums, over every tile, the cotangents ``tile_ct(r, c, x, y)`` returns for ``(params,
    a rows, b cols)``: the backward pass, one tile live at a time. ``context``: the other
    arrays ``tile_ct`` reads (weights, statistics, the cotangent); the accumulators' zeros are
    typed as varying over every mesh axis these and ``params``, ``a``, ``b`` vary over (the
    carries they become, inside ``jax.shard_map``). Returns the float32 sums."""
    axes = varying(params, a, b, context)

    def row_tile(carry: tuple[Any, Any], r: jax.Array) -> tuple[Any, Any]:
        dp, db = carry
        x = take(a, r * g.ta, g.ta)

        def col_tile(inner: tuple[Any, Any, Any], c: jax.Array) -> tuple[Any, None]:
            dp, dx, db = inner
            y = take(b, c * g.tb, g.tb)
            tp, tx, ty = tile_ct(r, c, x, y)
            add = functools.partial(jax.tree.map, lambda s, t: s + t.astype(s.dtype))
            return (add(dp, tp), add(dx, tx), put_add(db, c * g.tb, ty)), None

        (dp, dx, db), _ = lax.scan(col_tile, (dp, vary(axes, _zeros_like(x)), db),
                                   jnp.arange(g.cols))
        return (dp, db), dx

    (dp, db), da = lax.scan(row_tile, vary(axes, (_zeros_like(params), _zeros_like(b))),
                            jnp.arange(g.rows))
    da = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), da)
    return dp, da, db  # float32: the caller sums more of them (a ring) or casts them


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def logsumexp(score: Score, tile: int, both: bool, params: Any, a: Any, b: Any, wa: jax.Array,
              wb: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(rows, cols)``: ``rows_i = log sum_j exp(score(params, a, b)_ij)`` over the columns
    ``j`` of weight ``wb_j > 0`` (``-inf`` for a row with none), float32 ``(n_a,)``; with
    ``both``, ``cols_j`` likewise over the rows ``i`` of weight ``wa_i > 0`` (else zeros),
    ``(n_b,)``. Computed tile by tile, both from the same tiles. ``score(params, x, y)`` gets
    row and column tiles and returns their ``(len(x), len(y))`` scores."""
    return _lse_forward(score, tile, both, params, a, b, wa, wb)[0]


def sizes(a: Any, b: Any) -> tuple[int, int]:
    return jax.tree.leaves(a)[0].shape[0], jax.tree.leaves(b)[0].shape[0]


def _lse_forward(score: Score, tile: int, both: bool, params: Any, a: Any, b: Any,
                 wa: jax.Array, wb: jax.Array) -> tuple[tuple[jax.Array, jax.Array], Any]:
    n_a, n_b = sizes(a, b)
    g = grid(n_a, n_b, tile)
    rows, cols = _lse(score, g, both, params, *inputs(g, a, b, wa, wb))
    return (rows[:n_a], cols[:n_b]), (params, a, b, wa, wb, rows, cols)


def lse_weights(lse: jax.Array, ct: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """A log-sum-exp and its cotangent, padded to ``size``, with 0 for both where nothing was
    summed (a row with no valid column contributes no gradient)."""
    finite = jnp.isfinite(lse)
    return jnp.where(finite, lse, 0.0), jnp.where(finite, pad(ct.astype(jnp.float32), size), 0.0)


def lse_tile_ct(score: Score, g: Grid, params: Any, rows: tuple[jax.Array, jax.Array],
                cols: tuple[jax.Array, jax.Array] | None, pwa: jax.Array,
                pwb: jax.Array) -> Callable[..., tuple[Any, ...]]:
    """The cotangents of one tile of the log-sum-exps (``rows`` and, if given, ``cols``: each
    :func:`lse_weights`' pair, padded): ``ct_i softmax_j + ct_j softmax_i`` pulled back
    through the tile's scores, for :func:`pullback`."""

    def tile_ct(r: jax.Array, c: jax.Array, x: Any, y: Any) -> tuple[Any, ...]:
        z, pull = jax.vjp(lambda p, u, v: score(p, u, v).astype(jnp.float32), params, x, y)
        row_ok, col_ok = take(pwa, r * g.ta, g.ta) > 0, take(pwb, c * g.tb, g.tb) > 0
        lse_r, ct_r = take(rows[0], r * g.ta, g.ta), take(rows[1], r * g.ta, g.ta)
        grad = jnp.where(col_ok[None, :], ct_r[:, None] * jnp.exp(z - lse_r[:, None]), 0.0)
        if cols is not None:
            lse_c, ct_c = take(cols[0], c * g.tb, g.tb), take(cols[1], c * g.tb, g.tb)
            grad += jnp.where(row_ok[:, None], ct_c[None, :] * jnp.exp(z - lse_c[None, :]), 0.0)
        return pull(grad.astype(z.dtype))

    return tile_ct


def _lse_backward(score: Score, tile: int, both: bool, res: Any,
                  ct: tuple[jax.Array, jax.Array]) -> tuple[Any, ...]:
    params, a, b, wa, wb, rows, cols = res
    n_a, n_b = sizes(a, b)
    g = grid(n_a, n_b, tile)
    pa, pb, pwa, pwb = inputs(g, a, b, wa, wb)
    # inside shard_map: differentiated as varying, so that each tile's pullback gives this
    # device's share (not a psum per tile); summed once, in cotangents
    pv, pa, pb = vary(varying(params, a, b, wa, wb, rows, cols, ct), (params, pa, pb))
    rows_w = lse_weights(rows, ct[0], g.rows * g.ta)
    cols_w = lse_weights(cols, ct[1], g.cols * g.tb) if both else None
    tile_ct = lse_tile_ct(score, g, pv, rows_w, cols_w, pwa, pwb)
    dp, da, db = pullback(tile_ct, g, pv, pa, pb, rows_w, cols_w, pwa, pwb)
    return cotangents(params, a, b, wa, wb, dp, da, db)


def cotangents(params: Any, a: Any, b: Any, wa: jax.Array, wb: jax.Array, dp: Any, da: Any,
               db: Any) -> tuple[Any, ...]:
    """The backward's results from :func:`pullback`'s padded float32 sums: cut to ``n_a``
    and ``n_b`` rows, typed and cast as the primals (:func:`cotangent_of`); the weights get
    zeros."""
    n_a, n_b = sizes(a, b)
    da, db = jax.tree.map(lambda x: x[:n_a], da), jax.tree.map(lambda x: x[:n_b], db)
    return (cotangent_of(dp, params), cotangent_of(da, a), cotangent_of(db, b),
            jnp.zeros_like(wa), jnp.zeros_like(wb))


logsumexp.defvjp(_lse_forward, _lse_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def total(term: Term, tile: int, params: Any, a: Any, b: Any, wa: jax.Array,
          wb: jax.Array) -> jax.Array:
    """``sum_ij term(params, a, b, positive)_ij`` over the pairs whose weights ``wa_i`` and
    ``wb_j`` are both > 0, tile by tile (float32). ``positive`` is the tile's ``(len(x),
    len(y))`` boolean matrix of ``i == j`` (the matching pairs)."""
    return _total_forward(term, tile, params, a, b, wa, wb)[0]


def tile_term(term: Term, g: Grid, params: Any, x: Any, y: Any, r: jax.Array, c: jax.Array,
               pwa: jax.Array, pwb: jax.Array, shift: Any = 0) -> jax.Array:
    """The tile's sum of ``term`` over its valid pairs; ``positive`` where the row's index
    plus ``shift`` is the column's (their global indices, on a ring)."""
    rows, cols = r * g.ta + jnp.arange(g.ta) + shift, c * g.tb + jnp.arange(g.tb)
    valid = (take(pwa, r * g.ta, g.ta) > 0)[:, None] & (take(pwb, c * g.tb, g.tb) > 0)[None, :]
    value = term(params, x, y, rows[:, None] == cols[None, :]).astype(jnp.float32)
    return jnp.sum(jnp.where(valid, value, 0.0))


def total_tiles(term: Term, g: Grid, params: Any, pa: Any, pb: Any, pwa: jax.Array,
                pwb: jax.Array, start: jax.Array, shift: Any = 0) -> jax.Array:
    """``start`` plus the sum of :func:`tile_term` over every tile of ``pa`` (padded rows)
    against ``pb`` (padded columns)."""
    # the sum varies over every axis its terms can (inside shard_map)
    start = vary(varying(params, pa, pb, pwa, pwb, start, shift), start)

    def row_tile(acc: jax.Array, r: jax.Array) -> tuple[jax.Array, None]:
        x = take(pa, r * g.ta, g.ta)

        def col_tile(acc: jax.Array, c: jax.Array) -> tuple[jax.Array, None]:
            y = take(pb, c * g.tb, g.tb)
            return acc + tile_term(term, g, params, x, y, r, c, pwa, pwb, shift), None

        return lax.scan(col_tile, acc, jnp.arange(g.cols))[0], None

    return lax.scan(row_tile, start, jnp.arange(g.rows))[0]


def total_tile_ct(term: Term, g: Grid, params: Any, pwa: jax.Array, pwb: jax.Array,
                  ct: jax.Array, shift: Any = 0) -> Callable[..., tuple[Any, ...]]:
    """The cotangents of one tile of :func:`total` (its cotangent ``ct``), for
    :func:`pullback`."""

    def tile_ct(r: jax.Array, c: jax.Array, x: Any, y: Any) -> tuple[Any, ...]:
        value, pull = jax.vjp(
            lambda p, u, v: tile_term(term, g, p, u, v, r, c, pwa, pwb, shift), params, x, y)
        return pull(ct.astype(value.dtype))

    return tile_ct


def _total_forward(term: Term, tile: int, params: Any, a: Any, b: Any, wa: jax.Array,
                   wb: jax.Array) -> tuple[jax.Array, Any]:
    g = grid(*sizes(a, b), tile)
    pa, pb, pwa, pwb = inputs(g, a, b, wa, wb)
    value = total_tiles(term, g, params, pa, pb, pwa, pwb, jnp.zeros((), jnp.float32))
    return value, (params, a, b, wa, wb)


def _total_backward(term: Term, tile: int, res: Any, ct: jax.Array) -> tuple[Any, ...]:
    params, a, b, wa, wb = res
    n_a, n_b = sizes(a, b)
    g = grid(n_a, n_b, tile)
    pa, pb, pwa, pwb = inputs(g, a, b, wa, wb)
    # inside shard_map: differentiated as varying (this device's share per tile), summed once
    pv, pa, pb = vary(varying(params, a, b, wa, wb, ct), (params, pa, pb))
    dp, da, db = pullback(total_tile_ct(term, g, pv, pwa, pwb, ct), g, pv, pa, pb, pwa, pwb,
                          ct)
    return cotangents(params, a, b, wa, wb, dp, da, db)


total.defvjp(_total_forward, _total_backward)
