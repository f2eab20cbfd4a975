"""Micro-batched ``value_and_grad``: split -> scan (micro-step) -> reduce -> finalize.

Each stage is a module-level function a reader can find:

- :func:`split_microbatches` cuts the batch arguments into k strided micro-batches;
- :func:`micro_step` evaluates ``fun`` and its gradient on one micro-batch and adds the result
  into the running :class:`Sums` (the rules for weights live in :mod:`jaxaccum._reductions`);
- :func:`scan_microbatches` runs the micro-steps in one ``lax.scan`` (no scan when k == 1);
- the data axes of a mesh, if any, are handled by :mod:`jaxaccum._sharding`, which reduces the
  sums once per step;
- :func:`finalize` divides once and casts the gradients to their parameters' dtypes.

:func:`accumulate` chains them and returns an :class:`Accumulated`; :func:`value_and_grad` is
the public front end.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from jaxaccum import _conv_layout, _reductions, _validation

RematPolicy = Callable[..., bool]


class Sums(NamedTuple):
    """What one device accumulates before the final division.

    Attributes:
      loss: sum over micro-batches of ``weight_i * loss_i`` (unweighted: ``weight_i = 1``).
      grads: the matching sum of gradients, in the accumulator dtype.
      weight: float32, the sum of the weights (unweighted: the number of micro-batches).
      skipped: int32, micro-batches left out for a non-finite loss or gradient.
      carry: the carried arguments' current values (a tuple, one per ``carry_argnums``).
      aux: the accumulators of the aux leaves reduced across micro-batches (a list, None where
        a leaf is stacked), or None when every leaf is stacked.
    """

    loss: jax.Array
    grads: Any
    weight: jax.Array
    skipped: jax.Array
    carry: Any = ()
    aux: Any = None


class Accumulated(NamedTuple):
    """The result of :func:`accumulate`, before it is shaped into ``value_and_grad``'s output.

    Attributes:
      loss: the (weighted) mean loss over the batch, in the loss's dtype.
      grads: its gradient, with the dtypes of the differentiated arguments.
      aux: the aux values stacked along a leading axis of length k (None without ``has_aux``).
      weight: float32 scalar, the total weight (unweighted: the number of micro-batches kept).
      skipped: int32 scalar, micro-batches left out by ``skip_nonfinite``.
      num_microbatches: k, summed over the data-parallel devices (a Python int).
      carry: the carried arguments' final values (a tuple), ``()`` without ``carry_argnums``.
    """

    loss: jax.Array
    grads: Any
    aux: Any
    weight: jax.Array
    skipped: jax.Array
    num_microbatches: int
    carry: Any = ()


class Scanned(NamedTuple):
    """What :func:`scan_microbatches` returns.

    Attributes:
      sums: the accumulated :class:`Sums` (carry and aux accumulators included).
      ys: the per-micro-batch outputs of the scan: the stacked aux (all leaves stacked), or a
        list with the stacked leaves and None for the reduced ones.
      loss: the abstract loss (shape and dtype).
      aux: the abstract aux of one micro-batch.
    """

    sums: Sums
    ys: Any
    loss: Any
    aux: Any


@dataclasses.dataclass(frozen=True)
class Config:
    """What ``value_and_grad`` fixes at construction; shared by every stage."""

    fun: Callable[..., Any]
    argnums: int | tuple[int, ...]
    diff_argnums: tuple[int, ...]
    split_argnums: tuple[int, ...]
    has_aux: bool
    weighted: bool
    accumulator_dtype: DTypeLike | None
    unroll: int | bool
    skip_nonfinite: bool
    # Tie the differentiated arguments to the loop carry, so that work done on them inside
    # ``fun`` (a per-micro-batch all-gather, ZeRO-3) is not hoisted out of the loop by XLA.
    pin_in_loop: bool = False
    carry_argnums: tuple[int, ...] = ()
    aux_reduce: Any = "stack"

    def carried(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The carried arguments, as a tuple."""
        return tuple(args[i] for i in self.carry_argnums)

    def with_carry(self, args: tuple[Any, ...], carry: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` with the carried arguments replaced by ``carry``."""
        replaced = list(args)
        for i, value in zip(self.carry_argnums, carry, strict=True):
            replaced[i] = value
        return tuple(replaced)

    @property
    def stacks_all_aux(self) -> bool:
        return isinstance(self.aux_reduce, str) and self.aux_reduce == "stack"

    def differentiated(self, args: tuple[Any, ...]) -> Any:
        """The differentiated arguments, shaped as ``jax.grad`` returns their gradients."""
        if isinstance(self.argnums, int):
            return args[self.argnums]
        return tuple(args[i] for i in self.diff_argnums)

    @property
    def divides_safely(self) -> bool:
        """Whether the total weight can be 0 (weighted, or every micro-batch skipped)."""
        return self.weighted or self.skip_nonfinite


def _with_remat(fun: Callable[..., Any], remat: bool | RematPolicy | None) -> Callable[..., Any]:
    if remat is False or remat is None:
        return fun
    if remat is True:
        return jax.checkpoint(fun)
    if callable(remat):
        return jax.checkpoint(fun, policy=remat)
    raise TypeError(f"remat must be a bool or a jax.checkpoint policy; got {remat!r}")


def split_carry(cfg: Config, out: Any) -> tuple[Any, tuple[Any, ...]]:
    """With ``carry_argnums``, ``fun`` returns ``(output, new_carry)``: splits them."""
    if not cfg.carry_argnums:
        return out, ()
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            f"with carry_argnums={cfg.carry_argnums}, fun must return (output, new_carry); got "
            f"{type(out).__name__}: {out!r}"
        )
    new = out[1] if len(cfg.carry_argnums) > 1 else (out[1],)
    if not (isinstance(new, (tuple, list)) and len(new) == len(cfg.carry_argnums)):
        raise TypeError(
            f"with carry_argnums={cfg.carry_argnums}, new_carry must be a tuple of "
            f"{len(cfg.carry_argnums)} values; got {type(out[1]).__name__}"
        )
    return out[0], tuple(new)


def split_output(out: Any, *, has_aux: bool, weighted: bool) -> tuple[Any, Any, Any]:
    """Splits ``fun``'s output into ``(loss, weight, aux)`` after checking its structure."""
    expected = {
        (False, False): "loss",
        (True, False): "(loss, aux)",
        (False, True): "(loss, weight)",
        (True, True): "((loss, weight), aux)",
    }[has_aux, weighted]

    def pair(value: Any, what: str) -> tuple[Any, Any]:
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise TypeError(
                f"fun must return {expected} (has_aux={has_aux}, weighted={weighted}); "
                f"{what} is {type(value).__name__}: {value!r}"
            )
        return value[0], value[1]

    aux = None
    if has_aux:
        out, aux = pair(out, "its output")
    weight = None
    if weighted:
        out, weight = pair(out, "(loss, weight)")
    return out, weight, aux


# --- split ------------------------------------------------------------------------------------


def strided_views(cfg: Config, args: tuple[Any, ...], k: int) -> tuple[Any, ...]:
    """Each batch leaf viewed as ``(B/k, k, ...)`` (a bitcast, no copy): micro-batch i is
    ``view[:, i]``, examples i, i + k, i + 2k, ..."""

    def view(x: jax.Array) -> jax.Array:
        x = jnp.asarray(x)
        return x.reshape((x.shape[0] // k, k) + x.shape[1:])

    return tuple(jax.tree.map(view, args[i]) for i in cfg.split_argnums)


def take_microbatch(views: tuple[Any, ...], i: jax.Array) -> tuple[Any, ...]:
    """Micro-batch ``i`` of :func:`strided_views`: a gather of its B/k strided examples."""
    return jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, i, axis=1, keepdims=False), views)


def split_microbatches(cfg: Config, args: tuple[Any, ...], k: int) -> tuple[Any, ...]:
    """The batch arguments with a new leading micro-batch axis of length ``k`` (strided).

    Micro-batch i holds examples i, i + k, i + 2k, ...: a batch whose leading axis is sharded
    over devices in contiguous blocks (any block size divisible by k) is split where it lies,
    each device's share of micro-batch i being examples of its own block. This materialises a
    transposed copy of the batch; :func:`scan_microbatches` instead takes each micro-batch
    from :func:`strided_views` inside the loop.
    """
    return jax.tree.map(lambda v: jnp.swapaxes(v, 0, 1), strided_views(cfg, args, k))


def replace_differentiated(cfg: Config, args: tuple[Any, ...], new: Any) -> tuple[Any, ...]:
    """``args`` with the differentiated arguments replaced by ``new`` (shaped as
    :meth:`Config.differentiated` returns them)."""
    replaced = list(args)
    if isinstance(cfg.argnums, int):
        replaced[cfg.argnums] = new
    else:
        for i, value in zip(cfg.diff_argnums, new, strict=True):
            replaced[i] = value
    return tuple(replaced)


def with_microbatch(cfg: Config, args: tuple[Any, ...], batch: tuple[Any, ...]) -> tuple:
    """``args`` with the batch arguments replaced by one micro-batch."""
    return tuple(
        batch[cfg.split_argnums.index(i)] if i in cfg.split_argnums else a
        for i, a in enumerate(args)
    )


def check_output(
    cfg: Config, args: tuple[Any, ...], batch: tuple[Any, ...]
) -> tuple[Any, Any]:
    """Traces ``fun`` abstractly on one micro-batch; returns the abstract ``(loss, aux)``.

    Checks that the loss (and weight) are scalars and that every carried argument comes back
    with the structure, shapes and dtypes it came in with.
    """

    def first(b: tuple[Any, ...]) -> Any:  # indexing inside keeps sharding types
        return cfg.fun(*with_microbatch(cfg, args, jax.tree.map(lambda x: x[0], b)))

    out, new_carry = split_carry(cfg, jax.eval_shape(first, batch))
    loss, weight, aux = split_output(out, has_aux=cfg.has_aux, weighted=cfg.weighted)
    _validation.scalar(loss, "the loss returned by fun", floating=True)
    if cfg.weighted:
        _validation.scalar(weight, "the weight returned by fun (weighted=True)", floating=False)
    for i, old, new in zip(cfg.carry_argnums, cfg.carried(args), new_carry, strict=True):
        _validation.same_structure(old, new, f"carry_argnums: argument {i}")
    return loss, aux


# --- scan (micro-step) --------------------------------------------------------------------------


def zero_sums(cfg: Config, args: tuple[Any, ...], loss: Any, aux: Any = None) -> Sums:
    """The accumulator before the first micro-batch (``aux``: the abstract aux, if reduced)."""
    aux_accs = None
    if not cfg.stacks_all_aux:
        aux_accs = _reductions.aux_init(
            _reductions.aux_plan(cfg.aux_reduce, aux), jax.tree.leaves(aux)
        )
    return Sums(
        loss=jnp.zeros((), _reductions.accumulator_dtype_for(loss.dtype, cfg.accumulator_dtype)),
        grads=_reductions.zeros_accumulator(cfg.differentiated(args), cfg.accumulator_dtype),
        weight=jnp.zeros((), jnp.float32),
        skipped=jnp.zeros((), jnp.int32),
        carry=tuple(jax.tree.map(jnp.asarray, c) for c in cfg.carried(args)),
        aux=aux_accs,
    )


def micro_step(cfg: Config, args: tuple[Any, ...], sums: Sums) -> tuple[Sums, Any]:
    """Evaluates ``fun`` and its gradient on one micro-batch and adds them into ``sums``.

    The carried arguments in ``args`` are replaced by ``sums.carry``; their new values
    (dropped for a skipped micro-batch) go back into the returned sums. Returns the new sums
    and what the scan stacks (the aux, or its stacked leaves).
    """

    def with_weight(*a: Any) -> tuple[jax.Array, tuple[Any, Any, Any]]:
        out, new_carry = split_carry(cfg, cfg.fun(*a))
        loss, weight, aux = split_output(out, has_aux=cfg.has_aux, weighted=cfg.weighted)
        return loss, (weight, aux, new_carry)

    # XLA:CPU canonicalises convolution layouts only in the entry computation: in this loop
    # body autodiff's gradient convolutions would run as naive loops (see _conv_layout).
    grad_fun = _conv_layout.canonical_convs(
        jax.value_and_grad(with_weight, argnums=cfg.argnums, has_aux=True)
    )
    args = cfg.with_carry(args, sums.carry)
    if cfg.pin_in_loop:
        pinned, sums = jax.lax.optimization_barrier((cfg.differentiated(args), sums))
        args = replace_differentiated(cfg, args, pinned)
    (loss, (weight, aux, new_carry)), grads = grad_fun(*args)
    loss = loss.astype(sums.loss.dtype)
    if weight is None and not cfg.skip_nonfinite:  # unweighted: a plain sum, divided by k
        w = jnp.ones((), jnp.float32)
        new_sums = sums._replace(
            loss=sums.loss + loss,
            grads=jax.tree.map(lambda acc, g: (acc + g).astype(acc.dtype), sums.grads, grads),
            weight=sums.weight + 1,
        )
    else:
        w = jnp.ones((), jnp.float32) if weight is None else jax.lax.stop_gradient(weight)
        w = jnp.asarray(w).astype(jnp.float32)
        skipped = sums.skipped
        if cfg.skip_nonfinite:
            w, bad = _reductions.skip_if_nonfinite(w, _reductions.all_finite((loss, grads)))
            skipped = skipped + bad.astype(jnp.int32)
            new_carry = jax.tree.map(  # a skipped micro-batch's state update is dropped too
                lambda old, new: jnp.where(bad, old, new), sums.carry, new_carry
            )
        new_sums = sums._replace(
            loss=_reductions.weighted_add(sums.loss, loss, w),
            grads=jax.tree.map(lambda acc, g: _add_weighted(acc, g, w), sums.grads, grads),
            weight=_reductions.add_weight(sums.weight, w),
            skipped=skipped,
        )
    new_sums = new_sums._replace(
        carry=jax.tree.map(lambda old, new: jnp.asarray(new).astype(old.dtype), sums.carry,
                           tuple(new_carry))
    )
    if cfg.stacks_all_aux:
        return new_sums, aux
    leaves = jax.tree.leaves(aux)
    accs, stacked = _reductions.aux_update(
        _reductions.aux_plan(cfg.aux_reduce, aux), sums.aux, leaves, w
    )
    return new_sums._replace(aux=accs), stacked


def _add_weighted(acc: jax.Array, g: jax.Array, w: jax.Array) -> jax.Array:
    """``acc + w * g``; for an unreduced gradient (partial sums per device, on an Explicit
    mesh) only linear operations exist, so the weight is cast to reduced and no NaN of a
    weight-0 micro-batch can be masked (it propagates; it is never dropped silently)."""
    sharding = getattr(jax.typeof(g), "sharding", None)
    unreduced = getattr(getattr(sharding, "spec", None), "unreduced", None)
    if not unreduced:
        return _reductions.weighted_add(acc, g, w)
    w_reduced = jax.reshard(_reductions.valid_weight(w), P(reduced=set(unreduced)))
    return (acc + w_reduced.astype(g.dtype) * g).astype(acc.dtype)


def scan_microbatches(
    cfg: Config,
    args: tuple[Any, ...],
    k: int,
    sums: Sums | None = None,
    batches: tuple[Any, ...] | None = None,
) -> Scanned:
    """Runs :func:`micro_step` over ``k`` strided micro-batches in one ``lax.scan``.

    ``sums`` (the starting accumulator) and ``batches`` (already split) may be given by a
    caller that places them on a mesh. Otherwise the loop runs over ``arange(k)`` and each
    iteration gathers its micro-batch from :func:`strided_views` (a dynamic index on axis 1),
    so no transposed copy of the whole batch is made. With ``k == 1`` no scan is emitted: the
    cost is that of a plain ``jax.value_and_grad``.
    """
    views = None
    if batches is None and k > 1:
        views = strided_views(cfg, args, k)
        xs: Any = jnp.arange(k)
        abstract = split_microbatches(cfg, args, k)  # for check_output only: dead in the program
    else:
        if batches is None:
            batches = split_microbatches(cfg, args, k)
        xs = abstract = batches
    loss, aux = check_output(cfg, args, abstract)
    start = zero_sums(cfg, args, loss, aux) if sums is None else sums

    def body(sums: Sums, x: Any) -> tuple[Sums, Any]:
        batch = x if views is None else take_microbatch(views, x)
        return micro_step(cfg, with_microbatch(cfg, args, batch), sums)

    if k == 1:
        out, ys = body(start, jax.tree.map(lambda x: x[0], xs))
        ys = jax.tree.map(lambda x: jnp.expand_dims(jnp.asarray(x), 0), ys)
    else:
        out, ys = jax.lax.scan(body, start, xs, unroll=cfg.unroll)
    return Scanned(out, ys, loss, aux)


def finish_aux(cfg: Config, scanned: Scanned, total: jax.Array, k: int) -> Any:
    """The aux value: stacked, or each leaf reduced across the ``k`` micro-batches."""
    if cfg.stacks_all_aux:
        return scanned.ys
    plan = _reductions.aux_plan(cfg.aux_reduce, scanned.aux)
    leaves = jax.tree.leaves(scanned.aux)
    out = _reductions.aux_finalize(plan, scanned.sums.aux, scanned.ys, leaves, total, k)
    return jax.tree.unflatten(jax.tree.structure(scanned.aux), out)


# --- finalize -----------------------------------------------------------------------------------


def finalize(
    cfg: Config, sums: Sums, args: tuple[Any, ...], loss: Any
) -> tuple[jax.Array, Any]:
    """Divides the (reduced) sums by the total weight, once; casts to the arguments' dtypes."""
    if cfg.divides_safely:
        mean_loss = _reductions.safe_divide(sums.loss, sums.weight)
        grads = _reductions.safe_divide(sums.grads, sums.weight)
    else:
        mean_loss = sums.loss / sums.weight
        grads = jax.tree.map(lambda g: g / sums.weight.astype(g.dtype), sums.grads)
    return mean_loss.astype(loss.dtype), _reductions.cast_like(grads, cfg.differentiated(args))


def accumulate(
    cfg: Config,
    args: tuple[Any, ...],
    num_microbatches: int | None,
    microbatch_size: int | None,
    sharding: Any = None,
) -> Accumulated:
    """The whole pipeline on positional ``args``: split -> scan -> reduce -> finalize.

    ``sharding`` is a :class:`jaxaccum._sharding.DataParallel` (or None): then each device
    scans its own share of the batch and the sums are reduced over the data axes once.
    """
    batch_size = _validation.leading_batch_size(args, cfg.split_argnums)
    _validation.floating_leaves(
        cfg.differentiated(args), "argnums", "gradients need floating (or complex) leaves"
    )
    if sharding is not None:
        return sharding.accumulate(cfg, args, batch_size, num_microbatches, microbatch_size)
    k = _validation.resolve_num_microbatches(batch_size, num_microbatches, microbatch_size)
    scanned = scan_microbatches(cfg, args, k)
    sums = scanned.sums
    mean_loss, grads = finalize(cfg, sums, args, scanned.loss)
    aux = finish_aux(cfg, scanned, sums.weight, k)
    return Accumulated(mean_loss, grads, aux, sums.weight, sums.skipped, k, sums.carry)


def make_config(
    fun: Callable[..., Any],
    *,
    has_aux: bool,
    weighted: bool,
    argnums: int | tuple[int, ...],
    batch_argnums: int | tuple[int, ...],
    accumulator_dtype: DTypeLike | None,
    remat: bool | RematPolicy,
    unroll: int | bool,
    skip_nonfinite: bool,
    carry_argnums: int | tuple[int, ...] = (),
    aux_reduce: Any = "stack",
) -> Config:
    """Checks the construction arguments and fixes them in a :class:`Config`."""
    if not callable(fun):
        raise TypeError(f"fun must be callable; got {type(fun).__name__}: {fun!r}")
    diff_argnums = _validation.argnums_tuple(argnums, "argnums")
    split_argnums = _validation.argnums_tuple(batch_argnums, "batch_argnums")
    if set(diff_argnums) & set(split_argnums):
        raise ValueError(
            f"argnums={argnums!r} and batch_argnums={batch_argnums!r} overlap; the batch is split "
            "and cannot be differentiated as a whole"
        )
    carried = () if carry_argnums == () else _validation.argnums_tuple(
        carry_argnums, "carry_argnums"
    )
    clash = set(carried) & (set(diff_argnums) | set(split_argnums))
    if clash:
        raise ValueError(
            f"carry_argnums={carry_argnums!r} overlaps argnums={argnums!r} or "
            f"batch_argnums={batch_argnums!r} at {sorted(clash)}: a carried argument is "
            "threaded through the micro-batches, neither differentiated nor split"
        )
    if aux_reduce != "stack" and not has_aux:
        raise ValueError(f"aux_reduce={aux_reduce!r} was given without has_aux=True")
    if isinstance(aux_reduce, str):
        _reductions.aux_plan(aux_reduce, 0)  # checks the name now
    return Config(
        fun=_with_remat(fun, remat),
        argnums=argnums if isinstance(argnums, int) else diff_argnums,
        diff_argnums=diff_argnums,
        split_argnums=split_argnums,
        has_aux=has_aux,
        weighted=weighted,
        accumulator_dtype=accumulator_dtype,
        unroll=unroll,
        skip_nonfinite=skip_nonfinite,
        carry_argnums=carried,
        aux_reduce=aux_reduce,
    )


def bind_call(
    cfg: Config, args: tuple[Any, ...], kwargs: dict[str, Any], argnums: Any, batch_argnums: Any
) -> Config:
    """Checks the call's positional count; binds keyword arguments (passed whole, not split)."""
    needed = max(cfg.diff_argnums + cfg.split_argnums + cfg.carry_argnums) + 1
    if len(args) < needed:
        raise TypeError(
            f"argnums={argnums!r}, batch_argnums={batch_argnums!r} need at least {needed} "
            f"positional arguments; got {len(args)}"
        )
    if not kwargs:
        return cfg
    return dataclasses.replace(cfg, fun=functools.partial(cfg.fun, **kwargs))


def value_and_grad(
    fun: Callable[..., Any],
    *,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    has_aux: bool = False,
    weighted: bool = False,
    argnums: int | tuple[int, ...] = 0,
    batch_argnums: int | tuple[int, ...] = 1,
    accumulator_dtype: DTypeLike | None = jnp.float32,
    remat: bool | RematPolicy = False,
    unroll: int | bool = 1,
    mesh: jax.sharding.Mesh | None = None,
    data_axis: str | tuple[str, ...] | None = None,
    fsdp: str = "step",
    skip_nonfinite: bool = False,
    carry_argnums: int | tuple[int, ...] = (),
    aux_reduce: Any = "stack",
    param_shardings: Any = None,
) -> Callable[..., tuple[Any, Any]]:
    """Like ``jax.value_and_grad``, but the batch is processed as k micro-batches in one scan.

    The arguments named by ``batch_argnums`` (pytrees whose leaves share a leading batch axis)
    are split into ``k`` micro-batches of equal size, **strided**: micro-batch i holds examples
    i, i + k, i + 2k, ... (so a batch sharded over devices is split where it lies). ``fun`` and
    its gradient are evaluated on each inside one ``jax.lax.scan``, and the losses and gradients
    are summed in ``accumulator_dtype`` and divided once. Live activations therefore scale like
    ``1/k``; no parameter-sized state persists between calls. With ``k == 1`` no scan is emitted
    and the cost is that of ``jax.value_and_grad``.

    ``fun(*args, **kwargs)`` must return the **mean** loss over the examples it is given. Then
    the result equals ``jax.value_and_grad(fun, argnums, has_aux)(*args, **kwargs)`` on the full
    batch, up to float rounding. Keyword arguments are passed whole to every micro-batch: they
    are neither split nor differentiated (as ``jax.value_and_grad`` never differentiates them).

    With ``weighted=True`` ``fun`` returns ``(loss, weight)`` (with aux, ``((loss, weight),
    aux)``) where ``loss`` is the mean over the micro-batch's valid items and ``weight`` their
    number. The result is ``sum_i w_i * loss_i / sum_i w_i`` and its gradient: exactly the
    full-batch mean over valid items however unevenly they fall into micro-batches (a mean of
    micro-batch means would not be). A micro-batch with weight 0 contributes nothing, even if
    its loss is NaN (0/0); if every weight is 0 the loss and gradient are 0 (and
    :func:`jaxaccum.train_step` skips the optimizer step). A negative weight is invalid: it
    makes the result NaN (with ``skip_nonfinite``, its micro-batch is skipped and counted).

    Args:
      fun: the loss function. Its arguments in ``argnums`` are differentiated; those in
        ``batch_argnums`` are split; any other argument is passed whole to every micro-batch.
      num_microbatches: k, the number of micro-batches. Must divide the batch size.
      microbatch_size: the size of each micro-batch instead of k. Must divide the batch size.
      has_aux: whether ``fun`` returns ``(loss, aux)``. The aux values come back stacked along a
        new leading axis of length k (one entry per micro-batch).
      weighted: whether ``fun`` also returns the micro-batch's weight (see above).
      argnums: which positional arguments to differentiate, as in ``jax.grad``.
      batch_argnums: which positional arguments carry the batch.
      accumulator_dtype: the dtype gradients and losses are summed in; a wider leaf dtype (e.g.
        float64) is kept. ``None`` sums in each leaf's own dtype. The returned gradients have the
        dtypes of the differentiated arguments, as with ``jax.grad``.
      remat: ``True`` wraps ``fun`` in ``jax.checkpoint``; a ``jax.checkpoint_policies`` policy
        is passed on as ``policy``. Trades recomputation for activation memory.
      unroll: passed to ``jax.lax.scan``; unrolling a few iterations cuts loop overhead when
        micro-batches are tiny, at the price of compile time.
      mesh: data parallelism: a ``jax.sharding.Mesh``. The batch is split along ``data_axis``
        (it must divide the batch size). Each device scans over *its own* k micro-batches (so
        k and ``microbatch_size`` are per device), and the sums are reduced across the data
        axes once, after the scan; see :mod:`jaxaccum._sharding` for the parameter shardings
        that are kept. On a mesh with Explicit axes (``jax.make_mesh``'s default; call inside
        ``with jax.set_mesh(mesh):``) micro-batch i is one global array sharded over the data
        axes, and stacked aux has length k; on an Auto-axis mesh each device scans its own
        share, and stacked aux has length devices x k.
      data_axis: the mesh axis (or axes) the batch is split over; may be omitted for a
        one-axis mesh.
      fsdp: for parameters sharded over a data axis (FSDP/ZeRO): ``"step"`` gathers each once
        per step (one all-gather before the scan, one reduce-scatter after it; a transient full
        parameter and gradient per device); ``"microbatch"`` gathers it in every micro-batch
        and reduce-scatters every micro-batch's gradient into a sharded accumulator (ZeRO-3:
        less memory, k times the traffic).
      param_shardings: on a mesh with Auto axes, called under your own ``jax.jit``: the
        shardings (``NamedSharding`` or ``PartitionSpec`` leaves) of the differentiated
        arguments, a tree like ``params`` (a tuple of trees for a tuple ``argnums``). Traced
        arrays carry no sharding there, so without it a parameter sharded over a data axis
        (FSDP) is taken as replicated (correct, but gathered, and its gradient comes back
        replicated). Not needed on Explicit meshes, nor when called with concrete arrays
        outside ``jit``, nor with :func:`jaxaccum.train_step` (each reads the arrays'
        shardings).
      skip_nonfinite: leave out every micro-batch whose loss or gradient holds a NaN or an
        infinity, and renormalise: the result is the exact (weighted) mean over the remaining
        micro-batches, and 0 if none remains. The value then carries a count: it is
        ``(loss, {"aux": aux or None, "skipped": int32 count, "num_microbatches": k})``.
        Without it a NaN propagates to the result (nothing is masked silently).
      carry_argnums: positions of arguments that are *carried*: neither differentiated nor
        split, but threaded through the micro-batches, micro-batch i + 1 seeing the value
        micro-batch i returned, as k sequential forward passes would (BatchNorm running
        statistics, RNG counters, caches). ``fun`` then returns ``(output, new_value)`` (a
        tuple of new values for several carried arguments), each with the structure, shapes
        and dtypes it came in with (else a ``TypeError`` naming the argument and both
        structures). The value comes back as ``(value, carried)``. With ``skip_nonfinite`` a
        skipped micro-batch's update of the carried state is dropped too. With a mesh, its
        axes must be Explicit (every micro-batch is then one global array).
      aux_reduce: how the aux values are combined across micro-batches, per leaf: one of
        ``"stack"`` (default: a new leading axis of length k), ``"sum"``, ``"mean"``,
        ``"weighted_mean"`` (by the micro-batch weights), ``"max"``, ``"min"``, ``"last"``, or
        a pytree prefix of the aux with those names as leaves (e.g. ``{"tokens": "sum",
        "amax": "max", "logits": "stack"}``). Reduced leaves are accumulated in the scan's
        carry, not stacked.

    Returns:
      A function with the signature of ``fun`` returning ``(value, grads)``, where ``value`` is
      the loss, or ``(loss, aux)`` with ``has_aux``; with ``carry_argnums``, ``(that,
      carried)``.

    Raises:
      ValueError: at construction when both or neither of ``num_microbatches`` and
        ``microbatch_size`` are given or one is < 1; at trace time when k does not divide the
        batch size, when the batch leaves differ in leading size, or when the loss (or weight)
        is not a scalar.
      TypeError: when a count is not an int, or ``fun``'s output has the wrong structure.

    Example:
      >>> import jax, jax.numpy as jnp, jaxaccum
      >>> def loss(w, batch, scale=1.0):
      ...     x, y = batch
      ...     return scale * jnp.mean((x @ w - y) ** 2)
      >>> x = jnp.arange(24.0).reshape(8, 3) / 10
      >>> y = jnp.ones(8)
      >>> w = jnp.array([0.1, -0.2, 0.3])
      >>> full = jax.value_and_grad(loss)(w, (x, y), scale=2.0)
      >>> micro = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=4))(w, (x, y), scale=2.0)
      >>> bool(jnp.allclose(full[0], micro[0])), bool(jnp.allclose(full[1], micro[1]))
      (True, True)

    References:
      Goyal et al., "Accurate, Large Minibatch SGD", 2017 (https://arxiv.org/abs/1706.02677);
      the 2024 Hugging Face gradient-accumulation loss fix
      (https://huggingface.co/blog/gradient_accumulation).
    """
    from jaxaccum import _sharding  # the data axes; imported here to keep the cycle one-way

    _validation.exactly_one_count(num_microbatches, microbatch_size)
    cfg = make_config(
        fun,
        has_aux=has_aux,
        weighted=weighted,
        argnums=argnums,
        batch_argnums=batch_argnums,
        accumulator_dtype=accumulator_dtype,
        remat=remat,
        unroll=unroll,
        skip_nonfinite=skip_nonfinite,
        carry_argnums=carry_argnums,
        aux_reduce=aux_reduce,
    )
    sharding = _sharding.data_parallel(mesh, data_axis, fsdp)
    if param_shardings is not None and sharding is None:
        raise ValueError("param_shardings was given without a mesh")

    @functools.wraps(fun)
    def accumulated(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        call_cfg = bind_call(cfg, args, kwargs, argnums, batch_argnums)
        call_sharding = sharding
        if sharding is not None:
            call_sharding = sharding.with_param_shardings(param_shardings, args, argnums)
        out = accumulate(call_cfg, args, num_microbatches, microbatch_size, call_sharding)
        return shape_value(cfg, out), out.grads

    return accumulated


def shape_value(cfg: Config, out: Accumulated, with_carry: bool = True) -> Any:
    """``value_and_grad``'s value: the loss, ``(loss, aux)``, or with ``skip_nonfinite`` a dict;
    with ``carry_argnums``, ``(that, new_carry)``."""
    if cfg.skip_nonfinite:
        info = {
            "aux": out.aux if cfg.has_aux else None,
            "skipped": out.skipped,
            "num_microbatches": out.num_microbatches,
        }
        value: Any = (out.loss, info)
    else:
        value = (out.loss, out.aux) if cfg.has_aux else out.loss
    if with_carry and cfg.carry_argnums:
        return value, carry_value(cfg, out.carry)
    return value


def carry_value(cfg: Config, carry: tuple[Any, ...]) -> Any:
    """The carried values as the caller gave ``carry_argnums``: one value for an int."""
    return carry if len(cfg.carry_argnums) > 1 else carry[0]
