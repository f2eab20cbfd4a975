"""``train_step``: micro-batched gradients and one optimizer update in one jitted program."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.typing import DTypeLike

from jaxaccum import _accumulate, _reductions, _sharding, _validation


def _sharding_of(x: Any) -> Any:
    """A concrete array's (or ShapeDtypeStruct's) NamedSharding, else None."""
    sharding = getattr(x, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def apply_step(
    optimizer: optax.GradientTransformation,
    params: optax.Params,
    opt_state: optax.OptState,
    out: _accumulate.Accumulated,
    may_be_empty: bool,
    donated: bool = True,
) -> tuple[optax.Params, optax.OptState]:
    """One optimizer update; with zero total weight, params and state come back unchanged."""

    def update(state: tuple[optax.Params, optax.OptState]) -> tuple[optax.Params, optax.OptState]:
        params, opt_state = state
        updates, new_state = optimizer.update(out.grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state

    if not may_be_empty:  # no weights, no skipping: every step has a nonzero total
        return update((params, opt_state))
    return _reductions.step_unless_empty(  # type: ignore[no-any-return]
        out.weight, update, (params, opt_state), donated=donated
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
        cfg: _accumulate.Config,
        optimizer: optax.GradientTransformation,
        counts: tuple[int | None, int | None],
        sharding: _sharding.DataParallel | None,
        donate: bool,
    ) -> None:
        self._cfg = cfg
        self._optimizer = optimizer
        self._counts = counts
        self._sharding = sharding
        self._donate = donate
        self._compiled: dict[Any, Any] = {}

    def _step_fn(self, hints: Any) -> Callable[..., Any]:
        cfg, optimizer, sharding = self._cfg, self._optimizer, self._sharding
        if sharding is not None and hints is not None:
            sharding = dataclasses.replace(sharding, hints=(hints[0], *hints[2:]))

        def step(
            params: optax.Params, opt_state: optax.OptState, batch: Any, *rest: Any
        ) -> tuple[Any, ...]:
            out = _accumulate.accumulate(cfg, (params, batch, *rest), *self._counts, sharding)
            new_params, new_state = apply_step(
                optimizer, params, opt_state, out, cfg.divides_safely, self._donate
            )
            if hints is not None:  # keep the shardings the step was called with
                new_params, new_state = jax.tree.map(
                    lambda x, s: x if s is None else jax.lax.with_sharding_constraint(x, s),
                    (new_params, new_state),
                    hints[:2],
                    is_leaf=lambda s: s is None or isinstance(s, NamedSharding),
                )
            value = _accumulate.shape_value(cfg, out, with_carry=False)
            loss, aux = value if cfg.has_aux or cfg.skip_nonfinite else (value, None)
            if cfg.carry_argnums:
                return new_params, new_state, loss, aux, _accumulate.carry_value(cfg, out.carry)
            return new_params, new_state, loss, aux

        # loss_fn's argument i >= 2 is the step's argument i + 1 (opt_state comes second)
        donated = (0, 1, *(i + 1 for i in cfg.carry_argnums)) if self._donate else ()
        return jax.jit(step, donate_argnums=donated)

    def _jitted(self, args: tuple[Any, ...]) -> Any:
        hints = None
        if self._sharding is not None and not self._sharding.explicit:
            hints = tuple(jax.tree.map(_sharding_of, a) for a in args)
        key = None if hints is None else jax.tree.flatten(hints, is_leaf=lambda s: s is None)
        cache_key = None if key is None else (tuple(key[0]), key[1])
        if cache_key not in self._compiled:
            self._compiled[cache_key] = self._step_fn(hints)
        return self._compiled[cache_key]

    def __call__(
        self, params: optax.Params, opt_state: optax.OptState, batch: Any, *rest: Any
    ) -> tuple[optax.Params, optax.OptState, jax.Array, Any]:
        args = (params, opt_state, batch, *rest)
        with self._mesh_context():
            return self._jitted(args)(*args)  # type: ignore[no-any-return]

    def _mesh_context(self) -> Any:
        """Explicit-axis meshes need the mesh in context (``jax.set_mesh``) while tracing."""
        if self._sharding is not None and self._sharding.explicit:
            return jax.set_mesh(self._sharding.mesh)
        return contextlib.nullcontext()

    def lower(self, *args: Any) -> Any:
        """``jax.jit(...).lower`` of the step for these arguments (arrays or shape structs)."""
        with self._mesh_context():
            return self._jitted(args).lower(*args)

    def trace(self, *args: Any) -> Any:
        """``jax.jit(...).trace`` of the step for these arguments."""
        with self._mesh_context():
            return self._jitted(args).trace(*args)


def train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    has_aux: bool = False,
    weighted: bool = False,
    skip_nonfinite: bool = False,
    donate: bool = True,
    accumulator_dtype: DTypeLike | None = jnp.float32,
    remat: bool | _accumulate.RematPolicy = False,
    unroll: int | bool = 1,
    mesh: jax.sharding.Mesh | None = None,
    data_axis: str | tuple[str, ...] | None = None,
    fsdp: str = "step",
    carry_argnums: int | tuple[int, ...] = (),
    aux_reduce: Any = "stack",
) -> TrainStep:
    """Builds one jitted optimizer step over a batch split into micro-batches.

    ``step(params, opt_state, batch, *rest)`` computes the loss and gradient of
    ``loss_fn(params, batch, *rest)`` with :func:`jaxaccum.value_and_grad` (one ``lax.scan``
    over the micro-batches), applies ``optimizer.update`` once and ``optax.apply_updates``, all
    in one ``jax.jit`` program. ``params`` and ``opt_state`` are donated: do not reuse the
    arrays you pass in. A step whose total weight is 0 (``weighted`` with every weight 0, or
    every micro-batch skipped by ``skip_nonfinite``) changes neither ``params`` nor
    ``opt_state``: no optimizer step is taken (Adam's count and moments stay where they were).

    With ``mesh``, parameters and optimizer state may carry any ``NamedSharding`` on it (tensor
    parallel over model axes, FSDP over the data axes, or both); they come back with the same
    shardings, and the gradients are reduced over the data axes once per step.

    Args:
      loss_fn: ``loss_fn(params, batch, *rest)`` returning the mean loss over its examples
        (``(loss, aux)`` with ``has_aux``; ``(loss, weight)`` with ``weighted``).
      optimizer: any optax transform or chain.
      num_microbatches: k; exactly one of this and ``microbatch_size``.
      microbatch_size: the micro-batch size instead of k.
      has_aux: see :func:`jaxaccum.value_and_grad`.
      weighted: see :func:`jaxaccum.value_and_grad`.
      skip_nonfinite: leave out micro-batches with a non-finite loss or gradient (see
        :func:`jaxaccum.value_and_grad`); if every micro-batch is left out, the whole step is
        skipped.
      donate: donate ``params`` and ``opt_state`` to the step (saves their memory).
      accumulator_dtype: see :func:`jaxaccum.value_and_grad`.
      remat: see :func:`jaxaccum.value_and_grad`.
      unroll: see :func:`jaxaccum.value_and_grad`.
      mesh: see :func:`jaxaccum.value_and_grad`.
      data_axis: see :func:`jaxaccum.value_and_grad`.
      fsdp: see :func:`jaxaccum.value_and_grad`.
      carry_argnums: positions in ``loss_fn(params, batch, *rest)`` (>= 2) of arguments
        threaded through the micro-batches (BatchNorm statistics, RNG counters; see
        :func:`jaxaccum.value_and_grad`). They are donated and their final values returned.
      aux_reduce: see :func:`jaxaccum.value_and_grad`.

    Returns:
      A :class:`TrainStep`: ``step(params, opt_state, batch, *rest) -> (params, opt_state,
      loss, aux)``, with ``lower``/``trace`` like a jitted function. ``aux`` is the stacked
      aux with ``has_aux``, ``None`` without it; with ``skip_nonfinite`` it is the dict
      ``{"aux": stacked aux or None, "skipped": int32 count, "num_microbatches": k}``.
      With ``carry_argnums`` the step returns a fifth value, the carried arguments' final
      values (one value, or a tuple for several).

    Raises:
      ValueError: as :func:`jaxaccum.value_and_grad`.
      TypeError: if ``optimizer`` is not an optax transform.

    Example:
      >>> import jax.numpy as jnp, optax, jaxaccum
      >>> def loss(w, batch):
      ...     return jnp.mean((batch @ w - 1.0) ** 2)
      >>> opt = optax.sgd(0.1)
      >>> step = jaxaccum.train_step(loss, opt, num_microbatches=2)
      >>> w = jnp.zeros(3)
      >>> w, state, value, _ = step(w, opt.init(w), jnp.ones((4, 3)))
      >>> print(value, w)
      1.0 [0.2 0.2 0.2]
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation; got {type(optimizer).__name__}"
        )
    _validation.exactly_one_count(num_microbatches, microbatch_size)
    cfg = _accumulate.make_config(
        loss_fn,
        has_aux=has_aux,
        weighted=weighted,
        argnums=0,
        batch_argnums=1,
        accumulator_dtype=accumulator_dtype,
        remat=remat,
        unroll=unroll,
        skip_nonfinite=skip_nonfinite,
        carry_argnums=carry_argnums,
        aux_reduce=aux_reduce,
    )
    if any(i < 2 for i in cfg.carry_argnums):
        raise ValueError(
            f"carry_argnums={carry_argnums!r}: in train_step, loss_fn(params, batch, *rest) "
            "can carry only arguments of rest (positions >= 2)"
        )
    sharding = _sharding.data_parallel(mesh, data_axis, fsdp)
    return TrainStep(cfg, optimizer, (num_microbatches, microbatch_size), sharding, donate)
