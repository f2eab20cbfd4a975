"""Gradient accumulation for Flax NNX modules: ``import jaxaccum.nnx``.

This module imports flax (the rest of jaxaccum does not). It differentiates a module's
``wrt`` variables (``nnx.Param`` by default) and *carries* every other variable through the
micro-batches, as k sequential forward passes in train mode would: BatchNorm running
statistics, the RNG counters of ``nnx.Dropout`` (so each micro-batch draws fresh masks),
caches. Their final values are written back into the module, as ``nnx.value_and_grad`` writes
back mutations.

- :func:`value_and_grad`: ``loss, grads = value_and_grad(loss_fn, num_microbatches=k)(model,
  batch)``, a drop-in for ``nnx.value_and_grad(loss_fn)(model, batch)``.
- :func:`train_step`: one ``nnx.jit`` program: accumulated gradients and
  ``optimizer.update(model, grads)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from jaxaccum import _accumulate, _reductions, _sharding, _validation


def _in_model(path: tuple[Any, ...], _: Any) -> bool:
    """Filter: variables reached first through the module (argument 0 of ``loss_fn``)."""
    return bool(path) and path[0] == 0


def _split(nodes: Any, diff_filter: Any) -> tuple[Any, nnx.State, nnx.State]:
    """``nnx.split(nodes, diff_filter, ...)``: the graph, the differentiated and the rest."""
    split: Any = nnx.split(nodes, diff_filter, ...)
    return split[0], split[1], split[2]


class _Accumulator:
    """What :func:`value_and_grad` and :func:`train_step` share: one accumulated call.

    ``loss_fn(model, *args)`` is turned into a pure function of ``(params, *args, state)``:
    the module (and any graph node among ``args``, e.g. an ``nnx.Rngs``) is split once into
    its ``wrt`` variables of the module, differentiated, and the rest, carried.
    """

    def __init__(self, loss_fn: Callable[..., Any], options: dict[str, Any]) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable; got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self.counts = (options.pop("num_microbatches"), options.pop("microbatch_size"))
        _validation.exactly_one_count(*self.counts)
        self.sharding = _sharding.data_parallel(
            options.pop("mesh"), options.pop("data_axis"), options.pop("fsdp")
        )
        self.options = options
        batch_argnums = _validation.argnums_tuple(options["batch_argnums"], "batch_argnums")
        if 0 in batch_argnums:
            raise ValueError(
                f"batch_argnums={options['batch_argnums']!r}: argument 0 of loss_fn is the "
                "module; the batch arguments come after it"
            )
        # checks every option now, at construction (the state goes after every argument)
        self.config(loss_fn, max(batch_argnums) + 1)

    def config(self, fun: Callable[..., Any], carry_position: int) -> _accumulate.Config:
        options = dict(self.options)
        batch_argnums = options.pop("batch_argnums")
        return _accumulate.make_config(
            fun, argnums=0, batch_argnums=batch_argnums, carry_argnums=carry_position, **options
        )

    def __call__(
        self, wrt: Any, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[_accumulate.Config, _accumulate.Accumulated, Callable[[], None]]:
        """Accumulates ``loss_fn(model, *args, **kwargs)``; returns the config, the result
        (grads as the module's ``wrt`` state) and a function writing the carried state back."""
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"argument 0 of loss_fn must be an nnx.Module; got {type(model).__name__}"
            )
        node_at = tuple(i for i, a in enumerate(args) if nnx.graph.is_graph_node(a))
        nodes = (model, *(args[i] for i in node_at))
        diff_filter = nnx.All(wrt, _in_model)
        graphdef, params, state = _split(nodes, diff_filter)
        loss_fn = self.loss_fn

        def pure(params: Any, *rest: Any, **kw: Any) -> tuple[Any, Any]:
            *plain, state = rest
            # copy: fresh Variables inside the trace, never the caller's (which it must not
            # mutate from inside a jax transform)
            merged = nnx.merge(graphdef, params, state, copy=True)
            call_args = list(plain)
            for i, node in zip(node_at, merged[1:], strict=True):
                call_args[i] = node
            out = loss_fn(merged[0], *call_args, **kw)
            new_state = _split(merged, diff_filter)[2]
            return out, new_state

        carry_position = 1 + len(args)
        cfg = self.config(pure, carry_position)
        plain = tuple(None if i in node_at else a for i, a in enumerate(args))
        call_args = (params, *plain, state)
        cfg = _accumulate.bind_call(cfg, call_args, kwargs, 0, cfg.split_argnums)
        try:
            out = _accumulate.accumulate(cfg, call_args, *self.counts, self.sharding)
        except TypeError as error:
            prefix = f"carry_argnums: argument {carry_position}"
            if not str(error).startswith(prefix):
                raise
            raise TypeError(
                "jaxaccum.nnx: loss_fn must leave the module's variables other than "
                f"wrt={getattr(wrt, '__name__', wrt)!r} (carried from one micro-batch to the "
                "next: BatchStat, RNG counts, ...) with their structure, shapes and dtypes "
                "(paths start with the position of the node in loss_fn's arguments, [0]: the "
                "module); the module's state" + str(error)[len(prefix):]
            ) from None
        new_state = out.carry[0]
        grads = out.grads[0] if 0 in out.grads else nnx.State({})
        out = out._replace(grads=grads, carry=())

        def write_back() -> None:
            nnx.update(nodes, new_state)

        return cfg, out, write_back


def _options(**options: Any) -> dict[str, Any]:
    return options


def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    wrt: Any = nnx.Param,
    has_aux: bool = False,
    weighted: bool = False,
    aux_reduce: Any = "stack",
    skip_nonfinite: bool = False,
    batch_argnums: int | tuple[int, ...] = 1,
    accumulator_dtype: DTypeLike | None = jnp.float32,
    remat: bool | _accumulate.RematPolicy = False,
    unroll: int | bool = 1,
    mesh: jax.sharding.Mesh | None = None,
    data_axis: str | tuple[str, ...] | None = None,
    fsdp: str = "step",
) -> Callable[..., tuple[Any, nnx.State]]:
    """``nnx.value_and_grad`` over a batch split into k micro-batches (one ``lax.scan``).

    ``value_and_grad(loss_fn, num_microbatches=k)(model, batch, *rest)`` returns ``(value,
    grads)`` like ``nnx.value_and_grad(loss_fn)(model, batch, *rest)``: ``grads`` is an
    ``nnx.State`` of the module's ``wrt`` variables (what ``nnx.Optimizer.update`` takes), the
    value the (weighted) mean loss over the batch. ``loss_fn(model, batch, *rest)`` returns the
    mean loss over the examples it is given; the batch is split **strided** (micro-batch i
    holds examples i, i + k, ...), as in :func:`jaxaccum.value_and_grad`.

    The module's other variables are carried: micro-batch i + 1 runs with the state micro-batch
    i left (BatchNorm running statistics updated k times, as k sequential train-mode calls
    would; ``nnx.Dropout``'s RNG count advanced once per micro-batch, so every micro-batch
    draws its own masks). Their final values are written back into ``model``; integer and key
    variables are never differentiated. Graph nodes among ``rest`` (an ``nnx.Rngs`` passed to
    ``loss_fn``, say) are carried and written back the same way. ``loss_fn`` must leave the
    carried variables with their structure, shapes and dtypes (else a ``TypeError`` naming the
    variable and both structures). With ``skip_nonfinite``, a skipped micro-batch's state
    update is dropped.

    Call it inside ``nnx.jit`` (or see :func:`train_step`).

    Args:
      loss_fn: ``loss_fn(model, batch, *rest, **kwargs)`` returning the mean loss (``(loss,
        aux)`` with ``has_aux``, ``(loss, weight)`` with ``weighted``).
      num_microbatches: k; exactly one of this and ``microbatch_size``.
      microbatch_size: the size of each micro-batch instead of k.
      wrt: the ``nnx`` filter of the variables to differentiate (as ``nnx.Optimizer``'s
        ``wrt``); they must be floating.
      has_aux: see :func:`jaxaccum.value_and_grad` (the aux comes back stacked by default).
      weighted: see :func:`jaxaccum.value_and_grad`.
      aux_reduce: see :func:`jaxaccum.value_and_grad`.
      skip_nonfinite: see :func:`jaxaccum.value_and_grad`; the value is then ``(loss,
        {"aux", "skipped", "num_microbatches"})``.
      batch_argnums: positions in ``loss_fn``'s arguments (>= 1) of the batch arguments.
      accumulator_dtype: see :func:`jaxaccum.value_and_grad`.
      remat: see :func:`jaxaccum.value_and_grad`.
      unroll: see :func:`jaxaccum.value_and_grad`.
      mesh: see :func:`jaxaccum.value_and_grad` (carried state needs Explicit axes).
      data_axis: see :func:`jaxaccum.value_and_grad`.
      fsdp: see :func:`jaxaccum.value_and_grad`.

    Returns:
      A function ``(model, batch, *rest, **kwargs) -> (value, grads)`` that updates
      ``model``'s non-``wrt`` variables in place.

    Raises:
      ValueError, TypeError: as :func:`jaxaccum.value_and_grad`; ``TypeError`` if argument 0
        is not an ``nnx.Module``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import jaxaccum.nnx
      >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> def loss_fn(model, batch):
      ...     x, y = batch
      ...     return jnp.mean((model(x)[:, 0] - y) ** 2)
      >>> @nnx.jit
      ... def step(model, optimizer, batch):
      ...     loss, grads = jaxaccum.nnx.value_and_grad(loss_fn, num_microbatches=4)(model, batch)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> loss = step(model, optimizer, (jnp.ones((8, 3)), jnp.zeros(8)))
      >>> int(optimizer.step[...])
      1
    """
    acc = _Accumulator(
        loss_fn,
        _options(
            num_microbatches=num_microbatches, microbatch_size=microbatch_size, has_aux=has_aux,
            weighted=weighted, aux_reduce=aux_reduce, skip_nonfinite=skip_nonfinite,
            batch_argnums=batch_argnums, accumulator_dtype=accumulator_dtype, remat=remat,
            unroll=unroll, mesh=mesh, data_axis=data_axis, fsdp=fsdp,
        ),
    )

    @functools.wraps(loss_fn)
    def accumulated(model: nnx.Module, *args: Any, **kwargs: Any) -> tuple[Any, nnx.State]:
        cfg, out, write_back = acc(wrt, model, args, kwargs)
        write_back()
        return _accumulate.shape_value(cfg, out, with_carry=False), out.grads

    return accumulated


def train_step(
    loss_fn: Callable[..., Any],
    *,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    wrt: Any = None,
    has_aux: bool = False,
    weighted: bool = False,
    aux_reduce: Any = "stack",
    skip_nonfinite: bool = False,
    batch_argnums: int | tuple[int, ...] = 1,
    donate: bool = True,
    accumulator_dtype: DTypeLike | None = jnp.float32,
    remat: bool | _accumulate.RematPolicy = False,
    unroll: int | bool = 1,
    mesh: jax.sharding.Mesh | None = None,
    data_axis: str | tuple[str, ...] | None = None,
    fsdp: str = "step",
) -> Callable[..., Any]:
    """One ``nnx.jit`` optimizer step over a batch split into micro-batches.

    ``step = train_step(loss_fn, num_microbatches=k)``; ``loss = step(model, optimizer,
    batch, *rest)`` computes the loss and gradients of ``loss_fn(model, batch, *rest)`` as
    :func:`value_and_grad` does (the module's other variables carried through the micro-batches
    and written back), then calls ``optimizer.update(model, grads)`` (an ``nnx.Optimizer``):
    the usual hand-written NNX step, in one compiled program. A step whose total weight is 0
    (``weighted`` with every weight 0, or every micro-batch skipped by ``skip_nonfinite``)
    changes nothing: not the parameters, the optimizer state, ``optimizer.step``, nor the
    module's other variables.

    Args:
      loss_fn: as in :func:`value_and_grad`.
      num_microbatches: k; exactly one of this and ``microbatch_size``.
      microbatch_size: the size of each micro-batch instead of k.
      wrt: the variables to differentiate; by default the optimizer's ``wrt``.
      has_aux, weighted, aux_reduce, skip_nonfinite, batch_argnums: as in
        :func:`value_and_grad`.
      donate: donate the model's and optimizer's arrays to the step (they are replaced in
        place; do not keep references to the old arrays).
      accumulator_dtype, remat, unroll, mesh, data_axis, fsdp: as in
        :func:`jaxaccum.value_and_grad`.

    Returns:
      ``step(model, optimizer, batch, *rest) -> value``: the loss, ``(loss, aux)`` with
      ``has_aux``; with ``skip_nonfinite``, ``(loss, {"aux", "skipped", "num_microbatches"})``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import jaxaccum.nnx
      >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      >>> def loss_fn(model, batch):
      ...     x, y = batch
      ...     return jnp.mean((model(x)[:, 0] - y) ** 2)
      >>> step = jaxaccum.nnx.train_step(loss_fn, num_microbatches=4)
      >>> loss = step(model, optimizer, (jnp.ones((8, 3)), jnp.zeros(8)))
      >>> int(optimizer.step[...])
      1
    """
    acc = _Accumulator(
        loss_fn,
        _options(
            num_microbatches=num_microbatches, microbatch_size=microbatch_size, has_aux=has_aux,
            weighted=weighted, aux_reduce=aux_reduce, skip_nonfinite=skip_nonfinite,
            batch_argnums=batch_argnums, accumulator_dtype=accumulator_dtype, remat=remat,
            unroll=unroll, mesh=mesh, data_axis=data_axis, fsdp=fsdp,
        ),
    )

    def step(model: nnx.Module, optimizer: nnx.Optimizer, *args: Any) -> Any:
        if not isinstance(optimizer, nnx.Optimizer):
            raise TypeError(
                f"argument 1 of the step must be an nnx.Optimizer; got {type(optimizer).__name__}"
            )
        both = (model, optimizer)
        # a snapshot: new Variables holding the current (immutable) arrays
        before = jax.tree.map(lambda x: x, nnx.state(both)) if acc_divides_safely else None
        cfg, out, write_back = acc(optimizer.wrt if wrt is None else wrt, model, args, {})
        write_back()
        optimizer.update(model, out.grads)
        if before is not None:  # nothing to learn from: no step, no state change at all
            nnx.update(both, _reductions.unless_empty(out.weight, before, nnx.state(both)))
        return _accumulate.shape_value(cfg, out, with_carry=False)

    acc_divides_safely = weighted or skip_nonfinite
    jitted = nnx.jit(step, donate_argnums=(0, 1) if donate else None)

    @functools.wraps(loss_fn)
    def run(model: nnx.Module, optimizer: nnx.Optimizer, *args: Any) -> Any:
        return jitted(model, optimizer, *args)

    return run
