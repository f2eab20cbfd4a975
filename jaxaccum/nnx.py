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
from typing import Any, Unpack

import jax
from flax import nnx

from jaxaccum import (
    _arguments,
    _coupled,
    _options,
    _pipeline,
    _reductions,
    _train_step,
    _value_and_grad,
)
from jaxaccum._options import OptionsDict
from jaxaccum._records import Result, StepInfo, step_info

__all__ = ["value_and_grad", "train_step", "coupled_value_and_grad", "statistics_first"]


def _in_model(path: tuple[Any, ...], _: Any) -> bool:
    """Filter: variables reached first through the module (node 0 of the split nodes)."""
    return bool(path) and path[0] == 0


def _split(nodes: Any, diff_filter: Any) -> tuple[Any, nnx.State, nnx.State]:
    """``nnx.split(nodes, diff_filter, ...)``: the graph, the differentiated and the rest."""
    split: Any = nnx.split(nodes, diff_filter, ...)
    return split[0], split[1], split[2]


def _pure(model: nnx.Module, wrt: Any) -> tuple[nnx.State, Callable[[Any], Any]]:
    """The ``wrt`` variables, and a function rebuilding the module from (new values of) them;
    the module's other variables are constants of the rebuilt modules."""
    graphdef, params, state = _split(model, wrt)

    def merged(p: Any) -> Any:
        return nnx.merge(graphdef, p, state, copy=True)

    return params, merged


def _check_options(entry: str, batch_argnums: Any, options: OptionsDict) -> tuple[
        _options.Options, tuple[int, ...]]:
    opts = _options.parse(entry, options)
    split = _arguments.make(entry, lambda *a: None, opts, batch_argnums=batch_argnums).split
    if 0 in split:
        raise ValueError(
            f"{entry}: batch_argnums={batch_argnums!r}: argument 0 of loss_fn is the module; "
            "the batch arguments come after it"
        )
    return opts, split


def _accumulate(
    entry: str,
    loss_fn: Callable[..., Any],
    opts: _options.Options,
    batch_argnums: tuple[int, ...],
    wrt: Any,
    model: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[_arguments.Accumulation, Result, Callable[[], None]]:
    """Accumulates ``loss_fn(model, *args, **kwargs)``: the module (and every graph node among
    ``args`` and ``kwargs``, e.g. an ``nnx.Rngs``) is split once into the module's ``wrt``
    variables, differentiated, and the rest, carried. Returns the accumulation, the result
    (its gradient sums as the module's ``wrt`` state) and a function writing the carried
    state back."""
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"{entry}: argument 0 of loss_fn must be an nnx.Module; got {type(model).__name__}"
        )
    node_at = tuple(i for i, a in enumerate(args) if nnx.graph.is_graph_node(a))
    node_kw = tuple(k for k, v in kwargs.items() if nnx.graph.is_graph_node(v))
    nodes = (model, *(args[i] for i in node_at), *(kwargs[k] for k in node_kw))
    diff_filter = nnx.All(wrt, _in_model)
    graphdef, params, state = _split(nodes, diff_filter)
    plain_kw = {k: v for k, v in kwargs.items() if k not in node_kw}

    def pure(params: Any, *rest: Any) -> tuple[Any, Any]:
        *plain, state = rest
        # copy: fresh Variables inside the trace, never the caller's (which it must not
        # mutate from inside a jax transform)
        merged = nnx.merge(graphdef, params, state, copy=True)
        call_args = list(plain)
        for i, node in zip(node_at, merged[1:], strict=False):
            call_args[i] = node
        node_kwargs = dict(zip(node_kw, merged[1 + len(node_at):], strict=True))
        out = loss_fn(merged[0], *call_args, **plain_kw, **node_kwargs)
        return out, _split(merged, diff_filter)[2]

    carry_at = 1 + len(args)
    acc = _arguments.make(
        entry, pure, opts, batch_argnums=batch_argnums, carry_argnums=carry_at,
        state_name="the module's state",
        state_rule=f"loss_fn must leave the module's variables other than "
        f"wrt={getattr(wrt, '__name__', wrt)!r} (carried from one micro-batch to the next: "
        "BatchStat, RNG counts, ...) with their structure, shapes and dtypes (paths start "
        "with the position of the node: [0] is the module)")
    plain = tuple(None if i in node_at else a for i, a in enumerate(args))
    call_args = (params, *plain, state)
    acc.bind(call_args, {})
    res = _pipeline.run(acc, call_args)
    new_state = res.carry[0]
    model_only = (lambda tree: tree[0] if 0 in tree else nnx.State({}))  # noqa: E731

    def write_back() -> None:
        nnx.update(nodes, new_state)

    return acc, res._replace(grads=model_only(res.grads), like=model_only(res.like),
                             carry=()), write_back


def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    wrt: Any = nnx.Param,
    batch_argnums: int | tuple[int, ...] = 1,
    return_info: bool = False,
    **options: Unpack[OptionsDict],
) -> Callable[..., tuple[Any, ...]]:
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

    Call it inside ``nnx.jit`` (or see :func:`train_step`). Keyword arguments are passed
    whole to every micro-batch; a graph node passed by keyword (``rngs=nnx.Rngs(0)``, say)
    is carried like one passed positionally. For the Flax MNIST tutorial's metrics, return the
    logits as aux with ``has_aux="concat"``: they come back in the batch's own order, so
    ``metrics.update(logits=logits, labels=labels)`` works unchanged.

    Args:
      loss_fn: ``loss_fn(model, batch, *rest, **kwargs)`` returning the mean loss (``(loss,
        aux)`` with ``has_aux``, ``(loss, weight)`` with ``weighted``).
      wrt: the ``nnx`` filter of the variables to differentiate (as ``nnx.Optimizer``'s
        ``wrt``); they must be floating.
      batch_argnums: positions in ``loss_fn``'s arguments (>= 1) of the batch arguments.
      return_info: also return a :class:`jaxaccum.StepInfo`, as
        :func:`jaxaccum.value_and_grad` does.
      **options: the accumulation options (:class:`jaxaccum.Options`). On a mesh with Auto
        axes only a module with no variables beside the ``wrt`` ones runs: carried variables
        (BatchNorm statistics, RNG counts) need Explicit axes.

    Returns:
      A function ``(model, batch, *rest, **kwargs) -> (value, grads)`` that updates
      ``model``'s non-``wrt`` variables in place; ``value`` is the loss or ``(loss, aux)``.
      With ``return_info=True`` ``(value, grads, info)``.

    Raises:
      ValueError, TypeError: as :func:`jaxaccum.value_and_grad`; ``TypeError`` if argument 0
        is not an ``nnx.Module``.

    Examples:
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
    entry = "jaxaccum.nnx.value_and_grad"
    opts, split = _check_options(entry, batch_argnums, options)
    _value_and_grad.check_return_info(entry, opts, return_info)

    @functools.wraps(loss_fn)
    def accumulated(model: nnx.Module, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        acc, res, write_back = _accumulate(entry, loss_fn, opts, split, wrt, model, args, kwargs)
        write_back()
        return _value_and_grad.shape_result(acc, res, return_info, with_carry=False)

    return accumulated


def train_step(
    loss_fn: Callable[..., Any],
    *,
    wrt: Any = None,
    batch_argnums: int | tuple[int, ...] = 1,
    donate: bool = False,
    **options: Unpack[OptionsDict],
) -> Callable[..., Any]:
    """One ``nnx.jit`` optimizer step over a batch split into micro-batches.

    ``step = train_step(loss_fn, num_microbatches=k)``; ``loss, info = step(model, optimizer,
    batch, *rest)`` computes the loss and gradients of ``loss_fn(model, batch, *rest)`` as
    :func:`value_and_grad` does (the module's other variables carried through the micro-batches
    and written back), then calls ``optimizer.update(model, grads)`` (an ``nnx.Optimizer``):
    the usual hand-written NNX step, in one compiled program. A step whose total weight is 0
    (``weighted`` with every weight 0, or every micro-batch skipped by ``skip_nonfinite``)
    changes nothing: not the parameters, the optimizer state, ``optimizer.step``, nor the
    module's other variables.

    Args:
      loss_fn: as in :func:`value_and_grad`.
      wrt: the variables to differentiate; by default the optimizer's ``wrt``.
      batch_argnums: as in :func:`value_and_grad`.
      donate: donate the model's and optimizer's arrays to the step (saves their memory).
        Off by default, as with ``nnx.jit``: a donated array is deleted, and copies that
        share arrays with the model (``nnx.clone``, a best-model snapshot) would then fail
        with "Array has been deleted"; take such copies with ``jax.tree.map(jnp.copy, ...)``
        (or ``nnx.clone`` after ``nnx.state`` copies) when you donate.
      **options: the accumulation options (:class:`jaxaccum.Options`).

    Returns:
      ``step(model, optimizer, batch, *rest, **kwargs) -> (loss, info)``, ``info`` a
      :class:`jaxaccum.StepInfo` (the aux in ``info.aux``), as every step returns. On a mesh
      with Explicit axes the step sets the mesh itself, as :func:`jaxaccum.train_step` does.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import jaxaccum.nnx
      >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      >>> def loss_fn(model, batch):
      ...     x, y = batch
      ...     return jnp.mean((model(x)[:, 0] - y) ** 2)
      >>> step = jaxaccum.nnx.train_step(loss_fn, num_microbatches=4)
      >>> loss, info = step(model, optimizer, (jnp.ones((8, 3)), jnp.zeros(8)))
      >>> int(optimizer.step[...]), int(info.num_microbatches)
      (1, 4)
    """
    entry = "jaxaccum.nnx.train_step"
    opts, split = _check_options(entry, batch_argnums, options)

    def step(model: nnx.Module, optimizer: nnx.Optimizer, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[Any, StepInfo]:
        if not isinstance(optimizer, nnx.Optimizer):
            raise TypeError(
                f"{entry}: argument 1 of the step must be an nnx.Optimizer; got "
                f"{type(optimizer).__name__}"
            )
        both = (model, optimizer)
        graphdef, before = nnx.split(both)
        before = jax.tree.map(lambda x: x, before)  # a snapshot: new Variables, same arrays
        acc, res, write_back = _accumulate(entry, loss_fn, opts, split, optimizer.wrt if wrt is
                                          None else wrt, model, args, kwargs)
        write_back()
        carried = nnx.state(both)

        def update(_: Any) -> Any:  # pure: on fresh copies of the model and optimizer
            new_model, new_optimizer = nnx.merge(graphdef, carried, copy=True)
            # (the division by the total weight here, in the update, where it fuses into it)
            new_optimizer.update(new_model, res.mean_grads())
            return nnx.state((new_model, new_optimizer))

        # (a step of weight 0 changes nothing, carried state included)
        nnx.update(both, _reductions.step_unless_empty(res.weight, update, before, donated=donate,
                                                       may_be_empty=res.may_be_empty))
        return res.loss, step_info(res)

    jitted = nnx.jit(step, donate_argnums=(0, 1) if donate else None)

    @functools.wraps(loss_fn)
    def run(model: nnx.Module, optimizer: nnx.Optimizer, *args: Any,
            **kwargs: Any) -> tuple[Any, StepInfo]:
        args, tracing = _train_step.prepared(entry, opts, args)
        with tracing:
            return jitted(model, optimizer, args, kwargs)  # type: ignore[no-any-return]

    return run


def coupled_value_and_grad(
    encode: Callable[..., Any],
    loss: Callable[..., Any],
    *,
    wrt: Any = nnx.Param,
    **options: Unpack[OptionsDict],
) -> Callable[..., tuple[Any, nnx.State]]:
    """:func:`jaxaccum.coupled_value_and_grad` for an NNX module: a loss that couples the batch.

    ``encode(model, microbatch, *rest)`` returns per-example representations; ``loss(model,
    reps, batch, *rest)`` the scalar loss of the whole batch from them. Returns ``(loss,
    grads)`` with ``grads`` an ``nnx.State`` of the module's ``wrt`` variables (what
    ``nnx.Optimizer.update`` takes). The module's other variables are constants here: both
    passes see them as they are (so the replay draws what the first pass drew), and they are
    not written back; draw randomness from per-example keys in the batch.

    Args:
      encode: the per-example part of the model.
      loss: the batch-coupled loss.
      wrt: the ``nnx`` filter of the variables to differentiate.
      **options: as in :func:`jaxaccum.coupled_value_and_grad`.

    Returns:
      A function ``(model, batch, *rest) -> (loss, grads)``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxaccum.nnx
      >>> model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
      >>> def loss(m, z, x):
      ...     return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(z @ z.T)))
      >>> fn = jaxaccum.nnx.coupled_value_and_grad(lambda m, x: m(x), loss, num_microbatches=4)
      >>> value, grads = nnx.jit(fn)(model, jnp.arange(24.0).reshape(8, 3) / 10)
      >>> grads["kernel"][...].shape
      (3, 4)
    """
    def accumulated(model: nnx.Module, batch: Any, *rest: Any) -> tuple[Any, nnx.State]:
        params, merged = _pure(model, wrt)
        fn = _coupled.coupled_value_and_grad(
            lambda p, b, *r: encode(merged(p), b, *r),
            lambda p, reps, b, *r: loss(merged(p), reps, b, *r), **options)
        return fn(params, batch, *rest)

    return accumulated


def statistics_first(
    stats: Callable[..., Any],
    fun: Callable[..., Any],
    *,
    wrt: Any = nnx.Param,
    **options: Unpack[OptionsDict],
) -> Callable[..., tuple[Any, nnx.State]]:
    """:func:`jaxaccum.statistics_first` for an NNX module: a loss that needs statistics of
    the whole batch (global MoE load balancing, group-normalised advantages).

    ``stats(model, microbatch, *rest)`` returns the micro-batch's sums; ``fun(model,
    microbatch, totals, *rest)`` the mean loss given the whole batch's totals (no gradient
    flows through them). Returns ``(value, grads)`` with ``grads`` an ``nnx.State`` of the
    ``wrt`` variables; ``value`` is shaped as :func:`jaxaccum.value_and_grad` shapes it
    (``(loss, aux)`` with ``has_aux``). The module's other variables are constants here.

    Args:
      stats: the statistics of one micro-batch, as sums.
      fun: the loss, given the whole batch's totals.
      wrt: the ``nnx`` filter of the variables to differentiate.
      **options: as in :func:`jaxaccum.statistics_first`.

    Returns:
      A function ``(model, batch, *rest) -> (value, grads)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxaccum.nnx
      >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
      >>> def stats(m, x):
      ...     return {"sum": jnp.sum(m(x)), "n": jnp.asarray(x.shape[0], jnp.float32)}
      >>> def loss(m, x, totals):  # centred by the whole batch's mean output
      ...     return jnp.mean((m(x) - totals["sum"] / totals["n"]) ** 2)
      >>> fn = jaxaccum.nnx.statistics_first(stats, loss, num_microbatches=4)
      >>> value, grads = nnx.jit(fn)(model, jnp.arange(24.0).reshape(8, 3) / 10)
      >>> grads["kernel"][...].shape
      (3, 1)
    """
    def accumulated(model: nnx.Module, batch: Any, *rest: Any) -> tuple[Any, nnx.State]:
        params, merged = _pure(model, wrt)
        fn = _coupled.statistics_first(
            lambda p, b, *r: stats(merged(p), b, *r),
            lambda p, b, totals, *r: fun(merged(p), b, totals, *r), **options)
        return fn(params, batch, *rest)  # type: ignore[no-any-return]

    return accumulated
