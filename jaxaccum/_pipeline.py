"""The accumulation pipeline, written once: split -> micro-step -> accumulate -> reduce ->
finalize.

Each stage is a module-level function; :func:`run` chains them. What differs between one
device, Auto meshes and Explicit meshes (where parameters enter the loop, how the micro-step
function is wrapped, where accumulators live, how the sums are reduced over the data axes) is
a placement (:mod:`jaxaccum._placement`): it wraps :func:`per_device` and hands it the per-leaf
operations; what differs between front ends is only what they add around :func:`run`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import (
    _arguments,
    _microbatches,
    _noise,
    _placement,
    _reductions,
    _sink,
    _validation,
)
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


def shapes(acc: Accumulation, args: tuple[Any, ...], views: tuple[Any, ...],
           ops: LeafOps) -> Shapes:
    """Traces ``fun`` abstractly on one micro-batch; checks what it returns.

    The loss (and weight) must be scalars; every carried argument must come back with the
    structure, shapes and dtypes it came in with; ``"concat"`` aux leaves must be per example.
    """

    def first(v: tuple[Any, ...]) -> Any:  # indexing inside keeps sharding types
        return ops.fun(acc.fun)(*acc.with_batch(args, take(acc, v, 0)))

    # one trace gives the shapes and whether fun holds a convolution (decided once, here)
    closed, shape = jax.make_jaxpr(first, return_shape=True)(views)
    loss, weight, aux, new_carry = _arguments.split_output(acc, shape)
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
    return Shapes(loss, aux, plan, _conv_layout.has_conv(closed))


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


def _sinks_allowed(acc: Accumulation, ops: LeafOps, out: Shapes) -> bool:
    """Whether an op may add its gradient straight into the accumulator (:mod:`jaxaccum._sink`):
    where the accumulation is a plain sum of the micro-batch gradients, in this loop."""
    return (ops.add is _placement.base.add and not ops.pin_in_loop and not out.convs
            and not acc.options.skip_nonfinite and not acc.options.noise_scale)


def _tapping(acc: Accumulation, fun: Any, args: tuple[Any, ...],
             sums: Sums) -> tuple[Any, tuple[Any, Any], Any]:
    """The micro-batch's loss as a function of the parameters and of their accumulators, each
    parameter registered with its accumulator as a tap while the loss is traced; its
    arguments; and ``finish``, which takes ``jax.vjp``'s result. When an op used a tap, the
    gradient is taken with the micro-batch's weight as the seed (the op adds ``weight *
    gradient`` into the tap itself) and returned as a flat list, with the tapped accumulators
    as the op left them (None elsewhere); when none was used, as ``jax.grad`` gives it, and
    None. (The caller calls ``jax.vjp``: no frame of this module between it and the loss.)"""
    params, tree = jax.tree.flatten(acc.differentiated(args))
    used: set[int] = set()

    def tapped(params: list[Any], accumulators: list[Any]) -> Any:
        with _sink.tapping(_sink.Taps(params, accumulators)) as taps:
            out = fun(*acc.replace_differentiated(args, jax.tree.unflatten(tree, params)))
        used.update(taps.used)
        loss, weight, aux, new_carry = _arguments.split_output(acc, out)
        return loss, (weight, aux, new_carry)

    def finish(loss: jax.Array, pullback: Any, rest: Any) -> tuple[Any, ...]:
        if not used:
            grads, _ = pullback(jnp.ones_like(loss))
            return loss, rest, jax.tree.unflatten(tree, grads), None
        w = jnp.ones((), jnp.float32) if rest[0] is None else (
            jnp.asarray(jax.lax.stop_gradient(rest[0])).astype(jnp.float32))
        # a weight of 0 seeds 0: the op then computes nothing and its tap comes back unchanged
        grads, accumulators = pullback(
            jnp.where(w == 0, 0, _reductions.valid_weight(w)).astype(loss.dtype))
        return loss, rest, grads, [a if i in used else None for i, a in enumerate(accumulators)]

    return tapped, (params, jax.tree.leaves(sums.grads)), finish


def _added(sums: Any, seeded: list[Any], into: list[Any], w: jax.Array | None) -> Any:
    """The accumulators after a tapped micro-batch: a tapped leaf's as the op left it, plus the
    rest of its gradient (from its other uses); every other leaf ``acc + g``, ``g`` already
    multiplied by the weight (0 where the weight is 0: not even a NaN)."""
    leaves, tree = jax.tree.flatten(sums)

    def add(a: jax.Array, g: jax.Array, tap: Any) -> jax.Array:
        g = g if w is None else jnp.where(w == 0, 0, g)
        return ((a if tap is None else tap) + g).astype(a.dtype)

    return jax.tree.unflatten(
        tree, [add(a, g, t) for a, g, t in zip(leaves, seeded, into, strict=True)])


def micro_step(
    acc: Accumulation, args: tuple[Any, ...], views: tuple[Any, ...], ops: LeafOps, out: Shapes,
    i: Any, state: tuple[Sums, list[Any]],
) -> tuple[Sums, list[Any]]:
    """``fun`` and its gradient on micro-batch ``i`` (gathered from the views here), added
    into the sums: the loop's body (``state``: the sums and the buffers of the aux leaves
    kept per micro-batch, :func:`buffers`).

    The carried arguments come from ``sums.carry`` and their new values go back into it (a
    skipped micro-batch's are dropped)."""
    sums, bufs = state
    opts, fun = acc.options, ops.fun(acc.fun)  # (one device: acc.fun itself)

    def with_weight(*a: Any) -> tuple[jax.Array, tuple[Any, Any, Any]]:
        loss, weight, aux, new_carry = _arguments.split_output(acc, fun(*a))
        return loss, (weight, aux, new_carry)

    args = acc.with_carry(acc.with_batch(args, take(acc, views, i)), sums.carry)
    if _sinks_allowed(acc, ops, out):
        tapped, primals, finish = _tapping(acc, fun, args, sums)
        loss, (weight, aux, new_carry), grads, into = finish(
            *jax.vjp(tapped, *primals, has_aux=True))
    else:
        into = None
        grad_fun = jax.value_and_grad(with_weight, argnums=acc.argnums, has_aux=True)
        if out.convs:  # XLA:CPU canonicalises convolution layouts only in the entry
            # computation: in this loop body autodiff's gradient convolutions would be naive loops
            grad_fun = _conv_layout.canonical_convs(grad_fun)
        if ops.pin_in_loop:
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
        grads=(jax.tree.map(lambda a, g: ops.add(a, g, None if plain else w), sums.grads,
                            grads) if into is None
               else _added(sums.grads, grads, into, None if plain else w)),
        weight=sums.weight + 1 if plain else _reductions.add_weight(sums.weight, w),
        skipped=skipped,
        carry=jax.tree.map(lambda old, n: jnp.asarray(n).astype(old.dtype), sums.carry,
                           tuple(new_carry)),
        aux=sums.aux,
        sq_norms=None if sums.sq_norms is None else sums.sq_norms + _noise.microbatch_term(
            grads, w if weight is not None else _microbatch_size(acc, args), bad),
    )
    if opts.aux_spec is None:
        return new, bufs
    plan, leaves = out.aux_plan, [jnp.asarray(x) for x in jax.tree.leaves(aux)]
    # kept per micro-batch: at [i] of its buffer, or at [:, i] (a "concat" leaf of strided
    # micro-batches, written in batch order as the loop goes: no transposed copy after it)
    bufs = [None if b is None else jax.lax.dynamic_update_index_in_dim(b, x, i, axis)
            for b, x, axis in zip(bufs, leaves, buffer_axes(acc, out), strict=True)]
    accs = [a if r.stacked else r.update(a, x, w)
            for r, a, x in zip(plan, sums.aux, leaves, strict=True)]
    if bad is not None:  # a skipped micro-batch adds nothing to the reduced aux either
        accs = [new_acc if r.stacked else jnp.where(bad, old, new_acc)
                for r, old, new_acc in zip(plan, sums.aux, accs, strict=True)]
    return new._replace(aux=accs), bufs


def _microbatch_size(acc: Accumulation, args: tuple[Any, ...]) -> jax.Array:
    """The examples in the micro-batch ``args`` holds (its batch leaves' leading axis)."""
    return jnp.asarray(jax.tree.leaves(acc.batch(args))[0].shape[0], jnp.float32)


# --- accumulate ---------------------------------------------------------------------------------


def buffers(acc: Accumulation, out: Shapes, k: int) -> list[Any]:
    """Per aux leaf the loop keeps per micro-batch (``r.stacked``), its buffer of zeros (past
    a runtime count they stay zeros): ``(k, ...)``, or ``(m, k, ...)`` for a "concat" leaf of
    strided micro-batches (:func:`buffer_axes`); None for a reduced leaf."""
    if acc.options.aux_spec is None:
        return []
    # (zeros_like keeps a sharding type: Explicit axes)
    return [None if not r.stacked else
            jnp.broadcast_to(jnp.zeros_like(s)[:, None], (s.shape[0], k, *s.shape[1:]))
            if axis == 1 else jnp.broadcast_to(jnp.zeros_like(s)[None], (k, *s.shape))
            for r, s, axis in zip(out.aux_plan, jax.tree.leaves(out.aux),
                                  buffer_axes(acc, out), strict=True)]


def buffer_axes(acc: Accumulation, out: Shapes) -> list[int]:
    """Per aux leaf, the axis of its buffer that counts micro-batches: 1 for a "concat"
    leaf of strided micro-batches (written in batch order), else 0."""
    return [1 if in_order else 0 for in_order in concat_in_order(acc, out)]


def concat_in_order(acc: Accumulation, out: Shapes) -> list[bool]:
    """Per aux leaf: a ``"concat"`` leaf of strided micro-batches, which :func:`micro_step`
    writes in batch order ``(m, k, ...)`` as the loop goes."""
    if acc.options.aux_spec is None:
        return []
    return [r.per_example and not acc.stacked for r in out.aux_plan]


# --- finalize -----------------------------------------------------------------------------------


def finalize(
    acc: Accumulation, sums: Sums, bufs: list[Any], out: Shapes, count: Any,
) -> tuple[jax.Array, Any]:
    """The mean loss (the one scalar divided here, where its dtype is known) and the aux
    leaves finished (``count`` micro-batches evaluated, of which the skipped ones are left
    out of every reduced aux). The gradient stays a sum: :meth:`Result.mean_grads`."""
    if acc.options.divides_safely:
        loss = _reductions.safe_divide(sums.loss, sums.weight)
    else:
        loss = sums.loss / sums.weight
    aux = None
    if acc.options.aux_spec is not None:
        plan = out.aux_plan
        kept = count - sums.skipped  # skipped micro-batches add nothing to a reduced aux
        leaves = [y if acc.stacked and r.per_example  # a stack's own layout (K, m, ...)
                  else r.finalize(y if r.stacked else a, sums.weight, kept)
                  for r, a, y in zip(plan, sums.aux, bufs, strict=True)]
        aux = jax.tree.unflatten(jax.tree.structure(out.aux), leaves)
    return loss.astype(out.loss.dtype), aux


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
        out = shapes(acc, args, views, ops)
    state = init_sums(acc, args, out, ops), buffers(acc, out, k)
    body = functools.partial(micro_step, acc, args, views, ops, out)  # (no frame of its own)
    with jax.named_scope("jaxaccum.accumulate"):
        if count is not None:  # a runtime count: a loop of `count` trips
            state = jax.lax.fori_loop(0, count, body, state)
        elif k == 1:  # no loop
            state = body(0, state)
        else:  # (static bounds: a scan, rolled unless `unroll` says otherwise)
            state = jax.lax.fori_loop(0, k, body, state, unroll=acc.options.unroll)
    sums, bufs = state
    with jax.named_scope("jaxaccum.reduce"):
        sums = ops.reduce(sums, out)
    with jax.named_scope("jaxaccum.finalize"):
        total = ops.loops * (k if count is None else count)
        loss, aux = finalize(acc, sums, bufs, out, total)
    return Result(loss, sums.grads, aux, sums.weight, sums.skipped, total, sums.carry,
                  sums.sq_norms, out.aux_plan, acc.differentiated(args),
                  acc.options.divides_safely)


def run(acc: Accumulation, args: tuple[Any, ...], hints: Any = None,
        placement: Placement | None = None) -> Result:
    """The whole pipeline on positional ``args``: the gradient source every front end calls.

    ``placement``: where it runs (default: the one ``acc.options`` names, built here);
    ``hints``: argument shardings read before tracing (Auto meshes), else those of
    ``DataParallel.param_shardings``."""
    acc, args = _arguments.filtered(acc, args)
    if placement is None:
        placement = _placement.for_call(acc, args, hints)
    stacked = _microbatches.unstack(acc, args)
    _validation.floating_leaves(
        acc.differentiated(args), f"{acc.entry}: argnums",
        "gradients need floating (or complex) leaves: cast them to a float dtype, or pass "
        "them as an argument outside argnums",
    )
    opts = acc.options
    if stacked is not None:  # micro-batches of m examples, read where they lie
        args, k, count = stacked
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
    if opts.noise_scale:  # |G|^2 of the float32 mean, before any cast to the parameters' dtype
        res = res._replace(noise=_noise.estimate(res.noise, res.mean_grads(cast=False)))
    return res
