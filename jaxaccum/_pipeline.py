"""The accumulation pipeline, written once: split -> micro-step -> accumulate -> reduce ->
finalize.

Each stage is a module-level function; :func:`run` chains them. What differs between one
device, Auto meshes and Explicit meshes (where parameters enter the loop, how the micro-step
function is wrapped, where accumulators live, how the sums are reduced over the data axes) is
a placement (:mod:`jaxaccum._placement`): it wraps :func:`per_device` and hands it the per-leaf
operations; what differs between front ends is only what they add around :func:`run`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _arguments, _microbatches, _noise, _reductions, _validation
from jaxaccum._arguments import Accumulation
from jaxaccum._placement.base import LeafOps, Placement
from jaxaccum._records import Result, Shapes, Sums
from jaxaccum._xla import conv_layout as _conv_layout

# --- split --------------------------------------------------------------------------------------


def split(acc: Accumulation, args: tuple[Any, ...], k: int) -> tuple[Any, ...]:
    """Each batch leaf viewed as ``(B/k, k, ...)`` (a reshape, no copy): micro-batch i is
    ``view[:, i]``, the **strided** examples i, i + k, i + 2k, ... A batch sharded over devices
    in contiguous blocks (of any size k divides) is split where it lies. A stack of
    micro-batches (``acc.stacked``) is its own view: micro-batch i is ``data[i]``."""

    def view(x: Any) -> jax.Array:
        x = jnp.asarray(x)
        if acc.stacked:
            return x
        return x.reshape((x.shape[0] // k, k, *x.shape[1:]))

    return tuple(jax.tree.map(view, b) for b in acc.batch(args))


def take(acc: Accumulation, views: tuple[Any, ...], i: Any) -> tuple[Any, ...]:
    """Micro-batch ``i`` of :func:`split`'s views, gathered inside the loop (``0 <= i < k``:
    no index wrapped around from the end)."""
    axis = acc.microbatch_axis
    return jax.tree.map(
        lambda v: jax.lax.dynamic_index_in_dim(v, i, axis=axis, keepdims=False,
                                               allow_negative_indices=False), views)


def shapes(acc: Accumulation, args: tuple[Any, ...], views: tuple[Any, ...]) -> Shapes:
    """Traces ``fun`` abstractly on one micro-batch; checks what it returns.

    The loss (and weight) must be scalars; every carried argument must come back with the
    structure, shapes and dtypes it came in with; ``"concat"`` aux leaves must be per example.
    """

    def first(v: tuple[Any, ...]) -> Any:  # indexing inside keeps sharding types
        return acc.fun(*acc.with_batch(args, take(acc, v, 0)))

    loss, weight, aux, new_carry = _arguments.split_output(acc, jax.eval_shape(first, views))
    _validation.scalar(loss, f"{acc.entry}: the loss returned by the loss function",
                       floating=True)
    if acc.options.weighted:
        _validation.scalar(weight, f"{acc.entry}: the weight returned by the loss function "
                           "(weighted=True)", floating=False)
    for i, old, new in zip(acc.carry, acc.carried(args), new_carry, strict=True):
        rule = f"{acc.state_rule}; " if acc.state_rule else ""
        _validation.same_structure(old, new, f"{acc.entry}: {rule}{acc.carried_name(i)}")
    plan: list[_reductions.AuxReduction] = []
    if acc.options.aux_spec is not None:
        plan = _reductions.aux_plan(acc.entry, acc.options.aux_spec, aux)
        size = jax.tree.leaves(views)[0].shape[1 - acc.microbatch_axis]
        _reductions.check_concat(acc.entry, plan, aux, size)
    return Shapes(loss, aux, plan)


# --- micro-step ---------------------------------------------------------------------------------


def init_sums(acc: Accumulation, args: tuple[Any, ...], out: Shapes, ops: LeafOps) -> Sums:
    """The accumulators before the first micro-batch."""
    aux = None
    if acc.options.aux_spec is not None:
        aux = [None if r.stacked else r.init(jnp.shape(x), _reductions.leaf_dtype(x))
               for r, x in zip(out.aux_plan, jax.tree.leaves(out.aux), strict=True)]
    dtype = acc.options.accumulator_dtype
    return Sums(
        loss=jnp.zeros((), _reductions.accumulator_dtype_for(out.loss.dtype, dtype)),
        grads=ops.zeros(acc.differentiated(args), dtype),
        weight=jnp.zeros((), jnp.float32),
        skipped=jnp.zeros((), jnp.int32),
        carry=tuple(jax.tree.map(jnp.asarray, c) for c in acc.carried(args)),
        aux=aux,
        sq_norms=(jnp.zeros((3,), jnp.float32) if acc.options.noise_scale else None),
    )


def micro_step(
    acc: Accumulation, args: tuple[Any, ...], sums: Sums, ops: LeafOps, out: Shapes,
) -> tuple[Sums, Any]:
    """``fun`` and its gradient on one micro-batch (``args`` holds it), added into ``sums``.

    The carried arguments come from ``sums.carry`` and their new values go back into it (a
    skipped micro-batch's are dropped). Returns the new sums and the aux leaves the scan stacks.
    """
    opts = acc.options

    def with_weight(*a: Any) -> tuple[jax.Array, tuple[Any, Any, Any]]:
        loss, weight, aux, new_carry = _arguments.split_output(acc, acc.fun(*a))
        return loss, (weight, aux, new_carry)

    # XLA:CPU canonicalises convolution layouts only in the entry computation: in this loop
    # body autodiff's gradient convolutions would run as naive loops (see _conv_layout).
    grad_fun = _conv_layout.canonical_convs(
        jax.value_and_grad(with_weight, argnums=acc.argnums, has_aux=True)
    )
    args = acc.with_carry(args, sums.carry)
    if acc.pin_in_loop:
        pinned, sums = jax.lax.optimization_barrier((acc.differentiated(args), sums))
        args = acc.replace_differentiated(args, pinned)
    (loss, (weight, aux, new_carry)), grads = grad_fun(*args)
    loss = loss.astype(sums.loss.dtype)
    w = jnp.ones((), jnp.float32) if weight is None else jax.lax.stop_gradient(weight)
    w = jnp.asarray(w).astype(jnp.float32)
    skipped, bad = sums.skipped, None
    if opts.skip_nonfinite:
        finite, grads = ops.finite(loss, grads)
        w, bad = _reductions.skip_if_nonfinite(w, finite)
        skipped = skipped + bad.astype(jnp.int32)
        new_carry = jax.tree.map(lambda old, new: jnp.where(bad, old, new), sums.carry, new_carry)
    plain = weight is None and not opts.skip_nonfinite  # every weight 1: no NaN to mask
    new = Sums(
        loss=sums.loss + loss if plain else _reductions.weighted_add(sums.loss, loss, w),
        grads=jax.tree.map(lambda a, g: ops.add(a, g, None if plain else w), sums.grads,
                           grads),
        weight=sums.weight + 1 if plain else _reductions.add_weight(sums.weight, w),
        skipped=skipped,
        carry=jax.tree.map(lambda old, n: jnp.asarray(n).astype(old.dtype), sums.carry,
                           tuple(new_carry)),
        aux=sums.aux,
        sq_norms=None if sums.sq_norms is None else sums.sq_norms + _noise.microbatch_term(
            grads, w if weight is not None else _microbatch_size(acc, args), bad),
    )
    if opts.aux_spec is None:
        return new, None
    plan = out.aux_plan
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(aux)]
    stacked = [x if r.stacked else None for r, x in zip(plan, leaves, strict=True)]
    accs = [a if r.stacked else r.update(a, x, w)
            for r, a, x in zip(plan, sums.aux, leaves, strict=True)]
    if bad is not None:  # a skipped micro-batch adds nothing to the reduced aux either
        accs = [new_acc if r.stacked else jnp.where(bad, old, new_acc)
                for r, old, new_acc in zip(plan, sums.aux, accs, strict=True)]
    return new._replace(aux=accs), stacked


def _microbatch_size(acc: Accumulation, args: tuple[Any, ...]) -> jax.Array:
    """The examples in the micro-batch ``args`` holds (its batch leaves' leading axis)."""
    return jnp.asarray(jax.tree.leaves(acc.batch(args))[0].shape[0], jnp.float32)


# --- accumulate ---------------------------------------------------------------------------------


def accumulate(
    acc: Accumulation, args: tuple[Any, ...], views: tuple[Any, ...], start: Sums, k: int,
    ops: LeafOps, out: Shapes, count: jax.Array | None = None,
) -> tuple[Sums, Any]:
    """Runs :func:`micro_step` over the ``k`` micro-batches in one ``lax.scan`` (rolled unless
    the ``unroll`` option says otherwise; each micro-batch gathered from the views inside the
    loop); no scan when ``k == 1``. With a traced ``count`` (``max_microbatches``) only the
    first ``count`` run, in a loop whose trip count is ``count``; the values the scan would
    stack go into buffers of length ``k`` (zeros past ``count``)."""

    def body(sums: Sums, i: Any) -> tuple[Sums, Any]:
        return micro_step(acc, acc.with_batch(args, take(acc, views, i)), sums, ops, out)

    if count is not None:
        def step(i: Any, state: tuple[Sums, Any]) -> tuple[Sums, Any]:
            sums, y = body(state[0], i)
            return sums, jax.tree.map(
                lambda buf, v: jax.lax.dynamic_update_index_in_dim(buf, v, i, 0), state[1], y)

        shapes = jax.eval_shape(lambda s: body(s, 0)[1], start)
        ys = jax.tree.map(lambda s: jnp.broadcast_to(jnp.zeros_like(s)[None], (k, *s.shape)),
                          shapes)  # zeros_like keeps a sharding type (Explicit axes)
        return jax.lax.fori_loop(0, count, step, (start, ys))  # type: ignore[no-any-return]
    if k == 1:
        sums, ys = body(start, 0)
        return sums, jax.tree.map(lambda y: jnp.expand_dims(y, 0), ys)
    # "concat" leaves of strided micro-batches are written in batch order as the loop goes
    # (micro-batch i's values at [:, i]): no transposed copy of them after the loop
    in_order = concat_in_order(acc, out)
    bufs: list[Any] = [None] * len(in_order)
    if any(in_order):
        shapes = jax.eval_shape(lambda s: body(s, 0)[1], start)
        bufs = [jnp.broadcast_to(jnp.zeros_like(s)[:, None], (s.shape[0], k, *s.shape[1:]))
                if keep else None for keep, s in zip(in_order, shapes, strict=True)]

    def counted(state: tuple[Sums, jax.Array, list[Any]], _: None) -> tuple[Any, Any]:
        sums, i, bufs = state  # the index is the loop's own counter
        # (body's call, written out: one frame fewer between the step and the loss)
        sums, ys = micro_step(acc, acc.with_batch(args, take(acc, views, i)), sums, ops, out)
        if any(in_order):  # the in-order leaves go to their buffers, the scan stacks the rest
            bufs = [None if b is None else jax.lax.dynamic_update_index_in_dim(b, y, i, 1)
                    for b, y in zip(bufs, ys, strict=True)]
            ys = [y if b is None else None for b, y in zip(bufs, ys, strict=True)]
        return (sums, i + 1, bufs), ys

    (sums, _, bufs), ys = jax.lax.scan(counted, (start, jnp.zeros((), jnp.int32), bufs), None,
                                       length=k, unroll=acc.options.unroll)
    if any(in_order):
        ys = [y if b is None else b for b, y in zip(bufs, ys, strict=True)]
    return sums, ys


def concat_in_order(acc: Accumulation, out: Shapes) -> list[bool]:
    """Per aux leaf: a ``"concat"`` leaf of strided micro-batches in a loop of fixed length,
    which :func:`accumulate` writes in batch order ``(m, k, ...)`` as it goes."""
    if acc.options.aux_spec is None:
        return []
    concat = _reductions.AUX_REDUCTIONS["concat"]
    return [r is concat and not acc.stacked for r in out.aux_plan]


# --- finalize -----------------------------------------------------------------------------------


def divide(acc: Accumulation, sums: Any, weight: jax.Array, like: Any) -> Any:
    """The gradient: the reduced sums divided by the total weight (zeros for a total of 0
    where it can be 0), in the dtypes of ``like`` (the differentiated arguments)."""
    if acc.options.divides_safely:
        grads = _reductions.safe_divide(sums, weight)
    else:
        grads = _reductions.divide(sums, weight)
    return _reductions.cast_like(grads, like)


def finalize(
    acc: Accumulation, sums: Sums, ys: Any, args: tuple[Any, ...], out: Shapes, count: Any,
    scanned: bool = False,
) -> tuple[jax.Array, Any, Any]:
    """Divides the (reduced) sums by the total weight once, casts the gradients to their
    arguments' dtypes, and finishes the aux leaves (``count`` micro-batches evaluated, of
    which the skipped ones are left out of every reduced aux; ``scanned``: the fixed-length
    loop ran, which wrote :func:`concat_in_order`'s leaves in batch order)."""
    if acc.options.divides_safely:
        loss = _reductions.safe_divide(sums.loss, sums.weight)
    else:
        loss = sums.loss / sums.weight
    like = acc.differentiated(args)
    grads = sums.grads if acc.divide_later else divide(acc, sums.grads, sums.weight, like)
    aux = None
    if acc.options.aux_spec is not None:
        plan = out.aux_plan
        kept = count - sums.skipped  # skipped micro-batches add nothing to a reduced aux
        concat = _reductions.AUX_REDUCTIONS["concat"]
        in_order = concat_in_order(acc, out) if scanned else [False] * len(plan)
        leaves = [y if acc.stacked and r is concat  # a stack's own layout (K, m, ...)
                  else y.reshape((-1, *y.shape[2:])) if written  # (m, k, ...): batch order
                  else r.finalize(y if r.stacked else a, sums.weight, kept)
                  for r, written, a, y in zip(plan, in_order, sums.aux, ys, strict=True)]
        aux = jax.tree.unflatten(jax.tree.structure(out.aux), leaves)
    return loss.astype(out.loss.dtype), grads, aux


# --- the whole pipeline -------------------------------------------------------------------------


def per_device(
    acc: Accumulation, args: tuple[Any, ...], k: int, count: jax.Array | None, ops: LeafOps
) -> Result:
    """The pipeline on the arguments one placement sees: split -> micro-steps -> accumulate ->
    reduce -> finalize. On an Auto mesh this runs inside the placement's ``shard_map``.
    ``count``: the traced number of real micro-batches (``max_microbatches``), else all ``k``;
    ``ops``: the placement's per-leaf operations."""
    with jax.named_scope("jaxaccum.split"):
        views = split(acc, args, k)
        out = shapes(acc, args, views)
    start = init_sums(acc, args, out, ops)
    with jax.named_scope("jaxaccum.accumulate"):
        sums, ys = accumulate(acc, args, views, start, k, ops, out, count)
    with jax.named_scope("jaxaccum.reduce"):
        sums = ops.reduce(sums, out)
    with jax.named_scope("jaxaccum.finalize"):
        total = ops.loops * (k if count is None else count)
        loss, grads, aux = finalize(acc, sums, ys, args, out, total, count is None and k > 1)
    return Result(loss, grads, aux, sums.weight, sums.skipped, total, sums.carry, sums.sq_norms,
                  out.aux_plan)


def run(acc: Accumulation, args: tuple[Any, ...], placement: Placement) -> Result:
    """The whole pipeline on positional ``args``, placed by ``placement``."""
    stacked = _microbatches.unstack(acc, args)
    _validation.floating_leaves(
        acc.differentiated(args), f"{acc.entry}: argnums",
        "gradients need floating (or complex) leaves: cast them to a float dtype, or pass "
        "them as an argument outside argnums",
    )
    opts = acc.options
    if stacked is not None:  # micro-batches of m examples, read where they lie
        args, k, count = stacked
        acc = dataclasses.replace(acc, stacked=True)
        size = jax.tree.leaves(acc.batch(args))[0].shape[1]
        placement.local_batch_size(acc, size)  # m splits over the data-parallel devices
        res = placement.wrap(per_device)(acc, args, k, count)
    else:
        batch_size = _validation.leading_batch_size(args, acc.split, acc.entry)
        local = placement.local_batch_size(acc, batch_size)
        k = _validation.resolve_num_microbatches(
            local, opts.num_microbatches, opts.microbatch_size, acc.entry, placement.devices,
            acc.takes_weights)
        if opts.noise_scale and k * placement.devices < 2:
            raise ValueError(
                f"{acc.entry}: noise_scale=True compares micro-batch gradients with the step's: "
                f"it needs at least 2 micro-batches (over all devices); got k={k} on "
                f"{placement.devices} device(s)"
            )
        res = placement.wrap(per_device)(acc, args, k, None)
    if opts.noise_scale:
        grads = res.grads
        if acc.divide_later:
            grads = divide(acc, grads, res.weight, acc.differentiated(args))
        res = res._replace(noise=_noise.estimate(res.noise, grads))
    return res
