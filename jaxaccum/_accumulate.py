"""Micro-batched ``value_and_grad``: one ``lax.scan`` over micro-batches, exact means."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from jaxaccum import _validation

RematPolicy = Callable[..., bool]


class Sums(NamedTuple):
    """What one device accumulates before the final division.

    Attributes:
      loss: sum over micro-batches of ``weight_i * loss_i`` (unweighted: ``weight_i = 1``).
      grads: the matching sum of gradients, in the accumulator dtype.
      weight: sum of the weights (unweighted: the number of micro-batches).
      skipped: int32, micro-batches left out for a non-finite loss or gradient.
    """

    loss: jax.Array
    grads: Any
    weight: jax.Array
    skipped: jax.Array


def accumulator_dtype_for(dtype: DTypeLike, accumulator_dtype: DTypeLike | None) -> Any:
    """The dtype a gradient leaf of ``dtype`` is summed in: never narrower than the leaf."""
    if accumulator_dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
        return jnp.dtype(dtype)
    return jnp.promote_types(dtype, accumulator_dtype)


def zeros_accumulator(tree: Any, accumulator_dtype: DTypeLike | None) -> Any:
    """Zeros shaped like ``tree`` (arrays or ShapeDtypeStructs) in the accumulator dtype."""
    return jax.tree.map(
        lambda x: jnp.zeros(jnp.shape(x), accumulator_dtype_for(x.dtype, accumulator_dtype)),
        tree,
    )


def cast_like(tree: Any, like: Any) -> Any:
    """Casts every leaf of ``tree`` to the dtype of the matching leaf of ``like``."""
    return jax.tree.map(lambda x, y: x.astype(y.dtype), tree, like)


def safe_divide(tree: Any, total: jax.Array) -> Any:
    """``tree / total``, or zeros where ``total`` is 0 (a window with no valid example)."""
    nonzero = total > 0
    denom = jnp.where(nonzero, total, 1)
    return jax.tree.map(lambda x: jnp.where(nonzero, x / denom.astype(x.dtype), 0), tree)


def _with_remat(fun: Callable[..., Any], remat: bool | RematPolicy) -> Callable[..., Any]:
    if remat is False or remat is None:
        return fun
    if remat is True:
        return jax.checkpoint(fun)
    if callable(remat):
        return jax.checkpoint(fun, policy=remat)
    raise TypeError(f"remat must be a bool or a jax.checkpoint policy; got {remat!r}")


def _mesh_axes(
    mesh: jax.sharding.Mesh | None, data_axis: str | tuple[str, ...] | None
) -> tuple[str, ...] | None:
    """Checks the data-parallel arguments; returns the data axes as a tuple (None: no mesh)."""
    if mesh is None:
        if data_axis is not None:
            raise ValueError(f"data_axis={data_axis!r} was given without a mesh")
        return None
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    if data_axis is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(
                f"data_axis must name the batch axis of a mesh with several axes; mesh axes are "
                f"{mesh.axis_names}"
            )
        return tuple(mesh.axis_names)
    axes = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing or not axes:
        raise ValueError(
            f"data_axis={data_axis!r} is not an axis of the mesh; mesh axes are {mesh.axis_names}"
        )
    return axes


def all_finite(tree: Any) -> jax.Array:
    """A boolean scalar: whether every element of every leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def weighted_add(acc: jax.Array, g: jax.Array, weight: jax.Array) -> jax.Array:
    """``acc + weight * g``, adding nothing (not even a NaN from 0/0) where ``weight`` is 0."""
    return acc + jnp.where(weight > 0, weight.astype(acc.dtype) * g, 0)


def _split_output(out: Any, *, has_aux: bool, weighted: bool) -> tuple[Any, Any, Any]:
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
    skip_nonfinite: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """Like ``jax.value_and_grad``, but the batch is processed as k micro-batches in one scan.

    The arguments named by ``batch_argnums`` (pytrees whose leaves share a leading batch axis)
    are split into ``k`` contiguous micro-batches of equal size; ``fun`` and its gradient are
    evaluated on each inside one ``jax.lax.scan``, and the losses and gradients are summed in
    ``accumulator_dtype`` and divided once. Live activations therefore scale like ``1/k``; no
    parameter-sized state persists between calls. With ``k == 1`` no scan is emitted and the
    cost is that of ``jax.value_and_grad``.

    ``fun(*args)`` must return the **mean** loss over the examples it is given. Then the result
    equals ``jax.value_and_grad(fun, argnums, has_aux)(*args)`` on the full batch, up to float
    rounding.

    With ``weighted=True`` ``fun`` returns ``(loss, weight)`` (with aux, ``((loss, weight),
    aux)``) where ``loss`` is the mean over the micro-batch's valid items and ``weight`` their
    number. The result is ``sum_i w_i * loss_i / sum_i w_i`` and its gradient: exactly the
    full-batch mean over valid items however unevenly they fall into micro-batches (a mean of
    micro-batch means would not be). A micro-batch with weight 0 contributes nothing, even if
    its loss is NaN (0/0); if every weight is 0 the loss and gradient are 0.

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
      mesh: data parallelism: a ``jax.sharding.Mesh``. The batch is split along
        ``data_axis`` (it must divide the batch size); every other argument, the parameters
        included, is replicated. Each device scans over *its own* k micro-batches (so k and
        ``microbatch_size`` are per device: micro-batches hold ``B / (devices * k)``
        examples), and the loss, gradient and weight sums are reduced across devices once,
        after the scan, with one ``psum``: the all-reduce count does not grow with k, and the
        batch is never all-gathered. Weighted mode divides by the global sum of weights. The
        aux values come back stacked over devices and micro-batches (``devices * k``). Works
        with meshes from ``jax.make_mesh`` (Explicit axes: the arguments are resharded to
        the batch spec and replicated) and with Auto-axis meshes, and in multi-process runs
        (``jax.distributed``), where the batch is a global array.
      data_axis: the mesh axis (or axes) the batch is split over; may be omitted for a
        one-axis mesh.
      skip_nonfinite: leave out every micro-batch whose loss or gradient holds a NaN or an
        infinity, and renormalise: the result is the exact (weighted) mean over the remaining
        micro-batches, and 0 if none remains. The value then carries a count: it is
        ``(loss, {"aux": aux or None, "skipped": int32 count, "num_microbatches": k})``.
        Without it a NaN propagates to the result (nothing is masked silently).

    Returns:
      A function with the signature of ``fun`` returning ``(value, grads)``, where ``value`` is
      the loss, or ``(loss, stacked_aux)`` with ``has_aux``.

    Raises:
      ValueError: at construction when both or neither of ``num_microbatches`` and
        ``microbatch_size`` are given or one is < 1; at trace time when k does not divide the
        batch size, when the batch leaves differ in leading size, or when the loss (or weight)
        is not a scalar.
      TypeError: when a count is not an int, or ``fun``'s output has the wrong structure.

    Example:
      >>> import jax, jax.numpy as jnp, jaxaccum
      >>> def loss(w, batch):
      ...     x, y = batch
      ...     return jnp.mean((x @ w - y) ** 2)
      >>> x = jnp.arange(24.0).reshape(8, 3) / 10
      >>> y = jnp.ones(8)
      >>> w = jnp.array([0.1, -0.2, 0.3])
      >>> full = jax.value_and_grad(loss)(w, (x, y))
      >>> micro = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=4))(w, (x, y))
      >>> bool(jnp.allclose(full[0], micro[0])), bool(jnp.allclose(full[1], micro[1]))
      (True, True)

    References:
      Goyal et al., "Accurate, Large Minibatch SGD", 2017 (https://arxiv.org/abs/1706.02677);
      the 2024 Hugging Face gradient-accumulation loss fix
      (https://huggingface.co/blog/gradient_accumulation).
    """
    _validation.exactly_one_count(num_microbatches, microbatch_size)
    diff_argnums = _validation.argnums_tuple(argnums, "argnums")
    split_argnums = _validation.argnums_tuple(batch_argnums, "batch_argnums")
    if set(diff_argnums) & set(split_argnums):
        raise ValueError(
            f"argnums={argnums!r} and batch_argnums={batch_argnums!r} overlap; the batch is split "
            "and cannot be differentiated as a whole"
        )
    checked_fun = _with_remat(fun, remat)
    axes = _mesh_axes(mesh, data_axis)

    def micro_fun(*args: Any) -> tuple[jax.Array, tuple[Any, Any]]:
        loss, weight, aux = _split_output(checked_fun(*args), has_aux=has_aux, weighted=weighted)
        return loss, (weight, aux)

    grad_fun = jax.value_and_grad(micro_fun, argnums=argnums, has_aux=True)

    def micro_step(args: tuple[Any, ...], sums: Sums) -> tuple[Sums, Any]:
        (loss, (weight, aux)), grads = grad_fun(*args)
        loss = loss.astype(sums.loss.dtype)
        skipped = sums.skipped
        if skip_nonfinite:
            finite = all_finite((loss, grads))
            skipped = skipped + jnp.logical_not(finite).astype(jnp.int32)
            weight = jnp.where(finite, 1 if weight is None else weight, 0)
        if weight is None:  # unweighted: a plain sum, divided by k once at the end
            return Sums(
                loss=sums.loss + loss,
                grads=jax.tree.map(lambda acc, g: acc + g, sums.grads, grads),
                weight=sums.weight + 1,
                skipped=skipped,
            ), aux
        weight = jax.lax.stop_gradient(weight).astype(sums.weight.dtype)
        return Sums(
            loss=weighted_add(sums.loss, loss, weight),
            grads=jax.tree.map(lambda acc, g: weighted_add(acc, g, weight), sums.grads, grads),
            weight=sums.weight + weight,
            skipped=skipped,
        ), aux

    @functools.wraps(fun)
    def accumulated(*args: Any) -> tuple[Any, Any]:
        needed = max(diff_argnums + split_argnums) + 1
        if len(args) < needed:
            raise TypeError(
                f"argnums={argnums!r}, batch_argnums={batch_argnums!r} need at least {needed} "
                f"positional arguments; got {len(args)}"
            )
        batch_size = _validation.leading_batch_size(args, split_argnums)
        _validation.floating_leaves(
            _differentiated(args), "argnums", "gradients need floating (or complex) leaves"
        )
        if mesh is None:
            k = _validation.resolve_num_microbatches(batch_size, num_microbatches, microbatch_size)
            loss, grads, aux, skipped = reduce_and_finalize(args, k, batch_size // k, None)
        else:
            loss, grads, aux, skipped, k = data_parallel(args, batch_size)
        if skip_nonfinite:
            info = {"aux": aux if has_aux else None, "skipped": skipped, "num_microbatches": k}
            return (loss, info), grads
        return ((loss, aux) if has_aux else loss), grads

    def reduce_and_finalize(
        args: tuple[Any, ...], k: int, size: int, axes: tuple[str, ...] | None
    ) -> tuple[jax.Array, Any, Any, jax.Array]:
        """Scans this device's micro-batches, reduces over ``axes`` once, divides once."""
        sums, aux, out_loss = local_sums(args, k, size)
        if axes is not None:
            sums = jax.lax.psum(sums, axes)  # the only collective: once per step
        if weighted or skip_nonfinite:
            loss, grads = safe_divide(sums.loss, sums.weight), safe_divide(sums.grads, sums.weight)
        else:
            loss = sums.loss / sums.weight
            grads = jax.tree.map(lambda g: g / sums.weight.astype(g.dtype), sums.grads)
        grads = cast_like(grads, _differentiated(args))
        return loss.astype(out_loss.dtype), grads, aux, sums.skipped

    def data_parallel(args: tuple[Any, ...], batch_size: int) -> tuple[Any, ...]:
        """Each device scans its shard; one psum of the sums after the scan."""
        assert mesh is not None and axes is not None
        devices = math.prod(mesh.shape[a] for a in axes)
        if batch_size % devices:
            raise ValueError(
                f"the batch size {batch_size} is not divisible by the {devices} devices of "
                f"mesh axis data_axis={data_axis!r}"
            )
        local_size = batch_size // devices
        k = _validation.resolve_num_microbatches(local_size, num_microbatches, microbatch_size)
        spec = P(axes)
        in_specs = tuple(spec if i in split_argnums else P() for i in range(len(args)))
        if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
            # jax.make_mesh's default: place the arguments as shard_map expects them
            args = tuple(
                jax.tree.map(lambda x, s=s: jax.reshard(jnp.asarray(x), NamedSharding(mesh, s)), a)
                for a, s in zip(args, in_specs, strict=True)
            )
        out = jax.shard_map(
            lambda *local: reduce_and_finalize(local, k, local_size // k, axes),
            mesh=mesh,
            in_specs=in_specs,
            out_specs=(P(), P(), spec, P()),
            check_vma=False,
        )(*args)
        return (*out, k * devices)

    def _differentiated(args: tuple[Any, ...]) -> Any:
        if isinstance(argnums, int):
            return args[argnums]
        return tuple(args[i] for i in diff_argnums)

    def local_sums(args: tuple[Any, ...], k: int, size: int) -> tuple[Sums, Any, Any]:
        """Scans over this device's ``k`` micro-batches of ``size`` examples each."""
        split = tuple(
            jax.tree.map(lambda x: x.reshape((k, size) + x.shape[1:]), a)
            if i in split_argnums
            else a
            for i, a in enumerate(args)
        )
        first = tuple(
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), a)
            if i in split_argnums
            else a
            for i, a in enumerate(split)
        )
        out_loss = _check_output(first)
        sums = Sums(
            loss=jnp.zeros((), accumulator_dtype_for(out_loss.dtype, accumulator_dtype)),
            grads=zeros_accumulator(_differentiated(args), accumulator_dtype),
            weight=jnp.zeros((), jnp.float32),
            skipped=jnp.zeros((), jnp.int32),
        )

        def body(sums: Sums, batch_args: tuple[Any, ...]) -> tuple[Sums, Any]:
            full = tuple(
                batch_args[split_argnums.index(i)] if i in split_argnums else a
                for i, a in enumerate(args)
            )
            return micro_step(full, sums)

        if k == 1:  # no scan: the cost of a plain jax.value_and_grad
            sums, aux = body(sums, tuple(args[i] for i in split_argnums))
            aux = jax.tree.map(lambda x: jnp.expand_dims(jnp.asarray(x), 0), aux)
        else:
            batches = tuple(split[i] for i in split_argnums)
            sums, aux = jax.lax.scan(body, sums, batches, unroll=unroll)
        return sums, aux, out_loss

    def _check_output(first_args: tuple[Any, ...]) -> Any:
        out = jax.eval_shape(checked_fun, *first_args)
        loss, weight, _ = _split_output(out, has_aux=has_aux, weighted=weighted)
        _validation.scalar(loss, "the loss returned by fun", floating=True)
        if weighted:
            _validation.scalar(weight, "the weight returned by fun (weighted=True)", floating=False)
        return loss

    return accumulated
