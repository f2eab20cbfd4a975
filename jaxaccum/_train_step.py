"""``train_step``: micro-batched gradients and one optimizer update in one jitted program."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Unpack

import jax
import optax
from jax.sharding import NamedSharding

from jaxaccum import (
    _arguments,
    _microbatches,
    _options,
    _pipeline,
    _placement,
    _pytrees,
    _reductions,
    _value_and_grad,
)
from jaxaccum._options import OptionsDict
from jaxaccum._records import Result, StepInfo, step_info

ENTRY = "jaxaccum.train_step"


# A gradient source: (arguments of the loss function, their shardings read before tracing or
# None) -> the accumulated Result. The pipeline is one (jaxaccum._pipeline.run); the coupled
# pass and statistics-first are others; a train step is written once over any of them.
Source = Callable[[tuple[Any, ...], Any], Result]


def apply_step(
    optimizer: optax.GradientTransformation,
    params: optax.Params,
    opt_state: optax.OptState,
    res: Result,
    donated: bool = True,
) -> tuple[optax.Params, optax.OptState]:
    """One optimizer update on the mean gradient (divided inside the update, where it
    fuses); with zero total weight, params and state come back unchanged."""

    def update(state: tuple[optax.Params, optax.OptState]) -> tuple[optax.Params, optax.OptState]:
        params, opt_state = state
        updates, new_state = optimizer.update(res.mean_grads(), opt_state, params)
        return optax.apply_updates(params, updates), new_state

    return _reductions.step_unless_empty(  # type: ignore[no-any-return]
        res.weight, update, (params, opt_state), donated=donated,
        may_be_empty=res.may_be_empty)


class TrainStep:
    """The callable :func:`train_step` returns: one jitted program per optimizer step.

    On an Auto-axis mesh, traced arrays carry no sharding, so the step reads the shardings of
    the arrays it is called with (``jax.Array`` or ``jax.ShapeDtypeStruct``) before it traces,
    keeps one compiled program per distinct set of shardings, and returns the parameters and
    optimizer state with the shardings they came in with.
    """

    def __init__(
        self,
        acc: _arguments.Accumulation,
        optimizer: optax.GradientTransformation,
        donate: bool,
        source: Source | None = None,
    ) -> None:
        self._acc = acc
        self._source = source or functools.partial(_pipeline.run, acc)  # (no frame of its own)
        self._optimizer = optimizer
        self._donate = donate
        self._dp = acc.options.data_parallel
        self._compiled: dict[Any, Any] = {}

    def _step_fn(self, hints: Any) -> Callable[..., Any]:
        acc, optimizer = self._acc, self._optimizer
        # loss_fn(params, batch, *rest) sees the step's arguments without opt_state
        arg_hints = None if hints is None else (hints[0], *hints[2:])

        def step(
            static: _pytrees.Static | None, params: optax.Params, opt_state: optax.OptState,
            batch: Any, *rest: Any
        ) -> tuple[Any, ...]:
            whole = params if static is None else _pytrees.combine(params, static.tree)
            res = self._source((whole, batch, *rest), arg_hints)
            new_params, new_state = apply_step(optimizer, params, opt_state, res, self._donate)
            if hints is not None:  # keep the shardings the step was called with
                new_params, new_state = jax.tree.map(
                    lambda x, s: x if s is None else jax.lax.with_sharding_constraint(x, s),
                    (new_params, new_state),
                    hints[:2],
                    is_leaf=lambda s: s is None or isinstance(s, NamedSharding),
                )
            carry = _value_and_grad.carried_value(acc, res.carry) if acc.carry else ()
            return new_params, new_state, res.loss, step_info(res, carry)

        # loss_fn's argument i >= 2 is the step's argument i + 1 (opt_state comes second), and
        # the step's argument j is the jitted function's j + 1 (the static part comes first)
        donated = (1, 2, *(i + 2 for i in acc.carry)) if self._donate else ()
        return jax.jit(step, static_argnums=0, donate_argnums=donated)

    def _jitted(self, args: tuple[Any, ...]) -> Any:
        hints = _placement.traced_hints(self._acc.options, args)
        key = None if hints is None else jax.tree.flatten(hints, is_leaf=lambda s: s is None)
        cache_key = None if key is None else (tuple(key[0]), key[1])
        if cache_key not in self._compiled:
            self._compiled[cache_key] = self._step_fn(hints)
        return self._compiled[cache_key]

    def _arguments(self, params: Any, opt_state: Any, batch: Any, rest: tuple[Any, ...]) -> tuple[
            _pytrees.Static | None, tuple[Any, ...]]:
        """An Equinox module (or any parameters holding leaves that are no arrays) is split
        as ``eqx.filter_jit`` does: its inexact arrays are the step's argument, the rest is
        static (one program per distinct static part); a runtime count made int32."""
        static = None
        if _pytrees.needs_filter(params):
            params, static_tree = _pytrees.partition(params)
            static = _pytrees.Static.of(self._acc.entry, static_tree)
        return static, (params, opt_state, batch, *rest)

    def __call__(
        self, params: optax.Params, opt_state: optax.OptState, batch: Any, *rest: Any
    ) -> tuple[optax.Params, optax.OptState, jax.Array, StepInfo]:
        static, args = self._arguments(params, opt_state, batch, rest)
        args, tracing = prepared(self._acc.entry, self._acc.options, args)
        with tracing:
            new_params, *out = self._jitted(args)(static, *args)
        if static is not None:
            new_params = _pytrees.combine(new_params, static.tree)
        return (new_params, *out)  # type: ignore[return-value]

    def lower(self, *args: Any) -> Any:
        """``jax.jit(...).lower`` of the step for these arguments (arrays or shape structs)."""
        static, args = self._arguments(args[0], args[1], args[2], args[3:])
        args, tracing = prepared(self._acc.entry, self._acc.options, args)
        with tracing:
            return self._jitted(args).lower(static, *args)

    def trace(self, *args: Any) -> Any:
        """``jax.jit(...).trace`` of the step for these arguments."""
        static, args = self._arguments(args[0], args[1], args[2], args[3:])
        args, tracing = prepared(self._acc.entry, self._acc.options, args)
        with tracing:
            return self._jitted(args).trace(static, *args)

    @property
    def num_programs(self) -> int:
        """The programs compiled so far: one per distinct set of argument shapes, dtypes and
        shardings. With ``max_microbatches`` every count runs the same program, so a loop of
        varying counts keeps this at 1 (counts given as Python or NumPy integers are made
        int32 first). JAX compiles anew for arguments of another kind: NumPy parameters
        after the first step's jax arrays, a weakly typed scalar in the optimizer state."""
        return sum(f._cache_size() for f in self._compiled.values())


def prepared(entry: str, options: _options.Options,
             args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
    """How every step is called, written once (jaxaccum's, the coupled ones, NNX's, linen's):
    the arguments with each runtime count made int32 (one compiled program for every count),
    and the context to call the jitted step in (on Explicit axes, the mesh). The caller calls
    inside it itself: no frame of this between the step and the loss."""
    args = tuple(_microbatches.canonical(a, entry, options.max_microbatches) for a in args)
    return args, _placement.mesh_context(options)


def from_result(
    entry: str,
    result: Callable[..., Result],
    optimizer: optax.GradientTransformation,
    donate: bool,
    options: _options.Options,
) -> TrainStep:
    """A :class:`TrainStep` around an accumulated ``(params, batch, *rest) -> Result`` (the
    coupled-loss mechanisms): the step's gradient source is ``result``, not the pipeline."""
    check_optimizer(entry, optimizer)
    acc = _arguments.make(entry, result, options)
    return TrainStep(acc, optimizer, donate, lambda args, hints: result(*args))


def check_optimizer(entry: str, optimizer: Any) -> None:
    """Refuses an optimizer that is no optax transform."""
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"{entry}: optimizer must be an optax.GradientTransformation; got "
            f"{type(optimizer).__name__}"
        )


def train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    carry_argnums: int | tuple[int, ...] = (),
    donate: bool = True,
    **options: Unpack[OptionsDict],
) -> TrainStep:
    """Builds one jitted optimizer step over a batch split into micro-batches.

    ``step(params, opt_state, batch, *rest)`` computes the loss and gradient of
    ``loss_fn(params, batch, *rest)`` as :func:`jaxaccum.value_and_grad` does (one
    ``lax.scan`` over the micro-batches), applies ``optimizer.update`` once and
    ``optax.apply_updates``, all in one ``jax.jit`` program. ``params`` and ``opt_state`` are
    donated: do not reuse the arrays you pass in. A step whose total weight is 0 (``weighted``
    with every weight 0, or every micro-batch skipped by ``skip_nonfinite``) changes neither
    ``params`` nor ``opt_state``: no optimizer step is taken.

    With a mesh, parameters and optimizer state may carry any ``NamedSharding`` on it (tensor
    parallel over model axes, FSDP over the data axes, or both); they come back with the same
    shardings, and the gradients are reduced over the data axes once per step. The step enters
    the mesh itself (``jax.set_mesh``), which Explicit axes need; :func:`jaxaccum.value_and_grad`
    is called inside ``with jax.set_mesh(mesh):`` there.

    Args:
      loss_fn: ``loss_fn(params, batch, *rest)`` returning the mean loss over its examples
        (``(loss, aux)`` with ``has_aux``; ``(loss, weight)`` with ``weighted``).
      optimizer: any optax transform or chain.
      carry_argnums: positions in ``loss_fn(params, batch, *rest)`` (>= 2) of arguments
        threaded through the micro-batches (see :func:`jaxaccum.value_and_grad`); they are
        donated and their final values come back in ``info.carry``.
      donate: donate ``params`` and ``opt_state`` to the step (saves their memory).
      **options: the accumulation options, each documented once in
        :class:`jaxaccum.Options`; every one is taken (``noise_scale``'s estimate comes back
        in ``info.noise_scale``).

    Returns:
      A :class:`TrainStep`: ``step(params, opt_state, batch, *rest) -> (params, opt_state,
      loss, info)`` with ``info`` a :class:`StepInfo` (aux, skipped, weight,
      num_microbatches, carry), with ``lower``/``trace`` like a jitted function.

    Raises:
      ValueError, TypeError: as :func:`jaxaccum.value_and_grad`; ``TypeError`` if
        ``optimizer`` is not an optax transform.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxaccum
      >>> def loss(w, batch):
      ...     return jnp.mean((batch @ w - 1.0) ** 2)
      >>> opt = optax.sgd(0.1)
      >>> step = jaxaccum.train_step(loss, opt, num_microbatches=2)
      >>> w = jnp.zeros(3)
      >>> w, state, value, info = step(w, opt.init(w), jnp.ones((4, 3)))
      >>> print(value, w, info.num_microbatches)
      1.0 [0.2 0.2 0.2] 2
    """
    check_optimizer(ENTRY, optimizer)
    acc = _arguments.make(ENTRY, loss_fn, _options.parse(ENTRY, options),
                          carry_argnums=carry_argnums)
    if any(i < 2 for i in acc.carry):
        raise ValueError(
            f"{ENTRY}: carry_argnums={carry_argnums!r}: loss_fn(params, batch, *rest) can carry "
            "only arguments of rest (positions >= 2)"
        )
    return TrainStep(acc, optimizer, donate)
