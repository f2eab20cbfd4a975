"""``train_step``: micro-batched gradients and one optimizer update in one jitted program."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import NamedSharding

from jaxaccum import (
    _arguments,
    _microbatches,
    _options,
    _pipeline,
    _pytrees,
    _reductions,
    _value_and_grad,
)

ENTRY = "jaxaccum.train_step"


class StepInfo(NamedTuple):
    """What a :func:`train_step` call reports besides the loss.

    Attributes:
      aux: the aux value combined as ``has_aux`` says (None without aux).
      skipped: int32 scalar, micro-batches left out by ``skip_nonfinite``.
      weight: float32 scalar, the step's total weight (0: no update was made).
      num_microbatches: the micro-batches evaluated (on an Auto mesh summed over the data-
        parallel devices: k per device times their number).
      carry: the carried arguments' final values (one value, a tuple for several), ``()``
        without ``carry_argnums``.
      noise_scale: with the ``noise_scale`` option, the step's :class:`jaxaccum.NoiseScale`
        estimates; None without.
    """

    aux: Any
    skipped: jax.Array
    weight: jax.Array
    num_microbatches: Any
    carry: Any = ()
    noise_scale: Any = None


def _sharding_of(x: Any) -> Any:
    """A concrete array's (or ShapeDtypeStruct's) NamedSharding, else None."""
    sharding = getattr(x, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def apply_step(
    optimizer: optax.GradientTransformation,
    params: optax.Params,
    opt_state: optax.OptState,
    res: _pipeline.Result,
    may_be_empty: bool,
    donated: bool = True,
) -> tuple[optax.Params, optax.OptState]:
    """One optimizer update; with zero total weight, params and state come back unchanged."""

    def update(state: tuple[optax.Params, optax.OptState]) -> tuple[optax.Params, optax.OptState]:
        params, opt_state = state
        updates, new_state = optimizer.update(res.grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state

    if not may_be_empty:  # no weights, no skipping: every step has a nonzero total
        return update((params, opt_state))
    return _reductions.step_unless_empty(  # type: ignore[no-any-return]
        res.weight, update, (params, opt_state), donated=donated
    )


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
        gradient: Callable[[tuple[Any, ...], Any], _pipeline.Result] | None = None,
    ) -> None:
        self._acc = acc
        # (arguments of loss_fn, their shardings read before tracing) -> the accumulated result
        self._gradient = gradient or (lambda args, hints: _value_and_grad.call(acc, args, hints))
        self._optimizer = optimizer
        self._donate = donate
        self._dp = acc.options.data_parallel
        self._compiled: dict[Any, Any] = {}

    def _step_fn(self, hints: Any) -> Callable[..., Any]:
        acc, optimizer = self._acc, self._optimizer
        # loss_fn(params, batch, *rest) sees the step's arguments without opt_state
        arg_hints = None if hints is None else (hints[0], *hints[2:])

        def step(
            params: optax.Params, opt_state: optax.OptState, batch: Any, *rest: Any
        ) -> tuple[Any, ...]:
            res = self._gradient((params, batch, *rest), arg_hints)
            new_params, new_state = apply_step(
                optimizer, params, opt_state, res, acc.options.divides_safely, self._donate
            )
            if hints is not None:  # keep the shardings the step was called with
                new_params, new_state = jax.tree.map(
                    lambda x, s: x if s is None else jax.lax.with_sharding_constraint(x, s),
                    (new_params, new_state),
                    hints[:2],
                    is_leaf=lambda s: s is None or isinstance(s, NamedSharding),
                )
            carry = _value_and_grad.carried_value(acc, res.carry) if acc.carry else ()
            info = StepInfo(res.aux, res.skipped, res.weight, res.num_microbatches, carry,
                            res.noise)
            return new_params, new_state, res.loss, info

        # loss_fn's argument i >= 2 is the step's argument i + 1 (opt_state comes second)
        donated = (0, 1, *(i + 1 for i in acc.carry)) if self._donate else ()
        return jax.jit(step, donate_argnums=donated)

    def _jitted(self, args: tuple[Any, ...]) -> Any:
        hints = None
        if self._dp is not None and not self._dp.explicit:
            hints = tuple(jax.tree.map(_sharding_of, a) for a in args)
        key = None if hints is None else jax.tree.flatten(hints, is_leaf=lambda s: s is None)
        cache_key = None if key is None else (tuple(key[0]), key[1])
        if cache_key not in self._compiled:
            self._compiled[cache_key] = self._step_fn(hints)
        return self._compiled[cache_key]

    def __call__(
        self, params: optax.Params, opt_state: optax.OptState, batch: Any, *rest: Any
    ) -> tuple[optax.Params, optax.OptState, jax.Array, StepInfo]:
        if _pytrees.has_non_arrays(params):
            raise TypeError(
                f"{self._acc.entry}: params holds leaves that are not arrays "
                f"({type(params).__name__}, e.g. an Equinox module with its activation "
                "functions), which a jitted step "
                "cannot take as an argument; split it: params, static = eqx.partition(model, "
                "eqx.is_inexact_array), close over static in loss_fn (eqx.combine(params, "
                "static)), and pass params; or use jaxaccum.value_and_grad inside eqx.filter_jit"
            )
        batch = _microbatches.canonical(batch)
        args = (params, opt_state, batch, *rest)
        with mesh_context(self._acc.options):
            return self._jitted(args)(*args)  # type: ignore[no-any-return]

    def lower(self, *args: Any) -> Any:
        """``jax.jit(...).lower`` of the step for these arguments (arrays or shape structs)."""
        with mesh_context(self._acc.options):
            return self._jitted(args).lower(*args)

    def trace(self, *args: Any) -> Any:
        """``jax.jit(...).trace`` of the step for these arguments."""
        with mesh_context(self._acc.options):
            return self._jitted(args).trace(*args)

    @property
    def num_programs(self) -> int:
        """The programs compiled so far: one per distinct set of argument shapes, dtypes and
        shardings. With ``max_microbatches`` every count runs the same program, so a loop of
        varying counts keeps this at 1 (counts given as Python or NumPy integers are made
        int32 first). JAX compiles anew for arguments of another kind: NumPy parameters
        after the first step's jax arrays, a weakly typed scalar in the optimizer state."""
        return sum(f._cache_size() for f in self._compiled.values())


def from_value_and_grad(
    entry: str,
    result: Callable[..., _pipeline.Result],
    optimizer: optax.GradientTransformation,
    donate: bool,
    options: dict[str, Any],
) -> TrainStep:
    """A :class:`TrainStep` around an accumulated ``(params, batch, *rest) -> Result`` (the
    coupled-loss mechanisms): the step's gradient comes from ``result``, not the pipeline."""
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"{entry}: optimizer must be an optax.GradientTransformation; got "
            f"{type(optimizer).__name__}"
        )
    opts = _options.parse(entry, options)
    acc = _arguments.make(entry, result, opts)
    return TrainStep(acc, optimizer, donate, lambda args, hints: result(*args))


def mesh_context(options: _options.Options) -> Any:
    """Explicit-axis meshes need the mesh in context (``jax.set_mesh``) while tracing."""
    dp = options.data_parallel
    if dp is not None and dp.explicit:
        return jax.set_mesh(dp.mesh)
    return contextlib.nullcontext()


def train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    carry_argnums: int | tuple[int, ...] = (),
    donate: bool = True,
    **options: Any,
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
    shardings, and the gradients are reduced over the data axes once per step.

    Args:
      loss_fn: ``loss_fn(params, batch, *rest)`` returning the mean loss over its examples
        (``(loss, aux)`` with ``has_aux``; ``(loss, weight)`` with ``weighted``).
      optimizer: any optax transform or chain.
      carry_argnums: positions in ``loss_fn(params, batch, *rest)`` (>= 2) of arguments
        threaded through the micro-batches (see :func:`jaxaccum.value_and_grad`); they are
        donated and their final values come back in ``info.carry``.
      donate: donate ``params`` and ``opt_state`` to the step (saves their memory).
      **options: the accumulation options (:class:`jaxaccum.Options`): ``num_microbatches``
        or ``microbatch_size``, ``has_aux``, ``weighted``, ``skip_nonfinite``,
        ``accumulator_dtype``, ``mesh``.

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
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"{ENTRY}: optimizer must be an optax.GradientTransformation; got "
            f"{type(optimizer).__name__}"
        )
    acc = _arguments.make(ENTRY, loss_fn, _options.parse(ENTRY, options),
                          carry_argnums=carry_argnums)
    if any(i < 2 for i in acc.carry):
        raise ValueError(
            f"{ENTRY}: carry_argnums={carry_argnums!r}: loss_fn(params, batch, *rest) can carry "
            "only arguments of rest (positions >= 2)"
        )
    return TrainStep(acc, optimizer, donate)
