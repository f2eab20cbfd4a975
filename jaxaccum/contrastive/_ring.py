"""The tiled pairwise reductions across the devices of a mesh axis, by a ring.

Inside ``jax.shard_map`` each device holds its own rows of both sides. The other side's
blocks travel around the ring (``lax.ppermute`` to the next device, N - 1 hops and one home):
at each step a device scores its rows against the block it holds, tile by tile
(:mod:`jaxaccum.contrastive._tiles`), and the block carries its own running statistics (the columns'
log-sum-exp in the forward pass; the columns' cotangent in the backward pass) until it is home
again. No device holds more than its rows and one visiting block of the representations, and
no ``B x B`` array exists anywhere. The backward pass is a second ring (a custom VJP).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum.contrastive import _tiles
from jaxaccum.contrastive._tiles import Score, Term


def _hop(axis: str, tree: Any) -> Any:
    """Every device's ``tree`` to the next device of the ring."""
    n = lax.axis_size(axis)
    return lax.ppermute(tree, axis, [(i, (i + 1) % n) for i in range(n)])


def _vary(axis: str) -> Any:
    """Types a pytree of arrays as varying over ``axis`` (the carries of the loops), those
    that are not yet."""
    def one(x: Any) -> Any:
        return x if axis in jax.typeof(x).manual_axis_type.varying else lax.pcast(
            x, (axis,), to="varying")

    return lambda tree: jax.tree.map(one, tree)


def _add(x: Any, y: Any) -> Any:
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), x, y)


def _f32_zeros(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def logsumexp(score: Score, tile: int, axis: str, params: Any, a: Any, b: Any, wa: jax.Array,
              wb: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`._tiles.logsumexp` (both directions) over the whole axis: this device's
    rows of ``a`` against every device's ``b`` (``rows``), and this device's columns of ``b``
    against every device's ``a`` (``cols``)."""
    return _forward(score, tile, axis, params, a, b, wa, wb)[0]


def _forward(score: Score, tile: int, axis: str, params: Any, a: Any, b: Any, wa: jax.Array,
             wb: jax.Array) -> tuple[tuple[jax.Array, jax.Array], Any]:
    n_a, n_b = _tiles.sizes(a, b)
    g = _tiles.grid(n_a, n_b, tile)
    pa, pb, pwa, pwb = _tiles.inputs(g, a, b, wa, wb)
    vary = _vary(axis)
    rows = vary(_tiles.empty_stats(g.rows * g.ta))
    block = vary((pb, pwb, _tiles.empty_stats(g.cols * g.tb)))

    def step(_: Any, carry: Any) -> Any:  # the block held now came from i - step
        rows, (y, wy, cols) = carry
        rows, cols = _tiles.lse_stats(score, g, True, params, pa, y, pwa, wy, rows, cols)
        return rows, _hop(axis, (y, wy, cols))

    # a loop, not unrolled: one block visits at a time (two buffers), whatever the ring's size
    rows, block = lax.fori_loop(0, lax.axis_size(axis), step, (rows, block))
    rows_lse, cols_lse = _tiles.finish(*rows), _tiles.finish(*block[2])  # the block is home
    return (rows_lse[:n_a], cols_lse[:n_b]), (params, a, b, wa, wb, rows_lse, cols_lse)


def _backward(score: Score, tile: int, axis: str, res: Any,
              ct: tuple[jax.Array, jax.Array]) -> tuple[Any, ...]:
    params, a, b, wa, wb, rows, cols = res
    n_a, n_b = _tiles.sizes(a, b)
    g = _tiles.grid(n_a, n_b, tile)
    pa, pb, pwa, pwb = _tiles.inputs(g, a, b, wa, wb)

    vary = _vary(axis)
    pv = vary(params)  # differentiated per device (no reduction per tile), summed once below
    rows_w = _tiles.lse_weights(rows, ct[0], g.rows * g.ta)
    block = vary((pb, pwb, _tiles.lse_weights(cols, ct[1], g.cols * g.tb), _f32_zeros(pb)))
    dp, da = vary(_f32_zeros(params)), vary(_f32_zeros(pa))

    def step(_: Any, carry: Any) -> Any:
        dp, da, (y, wy, cols_w, dy) = carry
        tile_ct = _tiles.lse_tile_ct(score, g, pv, rows_w, cols_w, pwa, wy)
        tp, tx, ty = _tiles.pullback(tile_ct, g, params, pa, y, pv, rows_w, cols_w, pwa, wy)
        dp, da, dy = _add(dp, tp), _add(da, tx), _add(dy, ty)
        return dp, da, _hop(axis, (y, wy, cols_w, dy))

    dp, da, block = lax.fori_loop(0, lax.axis_size(axis), step, (dp, da, block))
    db = block[3]  # home, with every device's contribution
    dp = lax.psum(dp, axis)  # the parameters are the same on every device
    cast = _tiles.cast_like
    return (cast(dp, params), jax.tree.map(lambda x: x[:n_a], cast(da, pa)),
            jax.tree.map(lambda x: x[:n_b], cast(db, pb)), jnp.zeros_like(wa),
            jnp.zeros_like(wb))


logsumexp.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def total(term: Term, tile: int, axis: str, params: Any, a: Any, b: Any, wa: jax.Array,
          wb: jax.Array) -> jax.Array:
    """:func:`._tiles.total` over every pair of the whole axis (every device's rows
    against every device's columns), the same on every device. The term's ``positive``
    compares global indices: row ``i`` of device ``d`` is ``d * n_a + i``."""
    return _total_forward(term, tile, axis, params, a, b, wa, wb)[0]


def _offset(axis: str, step: Any, n: int) -> jax.Array:
    """The global index of the first row of the block held at ``step`` (it came from device
    ``index - step``)."""
    size = lax.axis_size(axis)
    return ((lax.axis_index(axis) - step) % size) * n


def _total_forward(term: Term, tile: int, axis: str, params: Any, a: Any, b: Any,
                   wa: jax.Array, wb: jax.Array) -> tuple[jax.Array, Any]:
    n_a, n_b = _tiles.sizes(a, b)
    g = _tiles.grid(n_a, n_b, tile)
    pa, pb, pwa, pwb = _tiles.inputs(g, a, b, wa, wb)
    value = _vary(axis)(jnp.zeros((), jnp.float32))

    def step(i: jax.Array, carry: Any) -> Any:
        value, (y, wy) = carry
        shift = _offset(axis, 0, n_a) - _offset(axis, i, n_b)
        value = _tiles.total_tiles(term, g, params, pa, y, pwa, wy, value, shift)
        return value, _hop(axis, (y, wy))

    value, _ = lax.fori_loop(0, lax.axis_size(axis), step, (value, _vary(axis)((pb, pwb))))
    return lax.psum(value, axis), (params, a, b, wa, wb)


def _total_backward(term: Term, tile: int, axis: str, res: Any, ct: jax.Array) -> tuple[Any, ...]:
    params, a, b, wa, wb = res
    n_a, n_b = _tiles.sizes(a, b)
    g = _tiles.grid(n_a, n_b, tile)
    pa, pb, pwa, pwb = _tiles.inputs(g, a, b, wa, wb)
    vary = _vary(axis)
    block = vary((pb, pwb, _f32_zeros(pb)))
    dp, da = vary(_f32_zeros(params)), vary(_f32_zeros(pa))
    ct = vary(ct)  # the cotangent of every device's share of the sum
    pv = vary(params)  # differentiated per device (no reduction per tile), summed once below

    def step(i: jax.Array, carry: Any) -> Any:
        dp, da, (y, wy, dy) = carry
        shift = _offset(axis, 0, n_a) - _offset(axis, i, n_b)
        tile_ct = _tiles.total_tile_ct(term, g, pv, pwa, wy, ct, shift)
        tp, tx, ty = _tiles.pullback(tile_ct, g, params, pa, y, pv, pwa, wy, ct, shift)
        dp, da, dy = _add(dp, tp), _add(da, tx), _add(dy, ty)
        return dp, da, _hop(axis, (y, wy, dy))

    dp, da, block = lax.fori_loop(0, lax.axis_size(axis), step, (dp, da, block))
    dp = lax.psum(dp, axis)
    cast = _tiles.cast_like
    return (cast(dp, params), jax.tree.map(lambda x: x[:n_a], cast(da, pa)),
            jax.tree.map(lambda x: x[:n_b], cast(block[2], pb)), jnp.zeros_like(wa),
            jnp.zeros_like(wb))


total.defvjp(_total_forward, _total_backward)
