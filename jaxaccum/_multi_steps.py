"""``multi_steps``: an optax transform that accumulates one micro-batch per call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike, DTypeLike

from jaxaccum import _reductions, _validation


class MultiStepsState(NamedTuple):
    """State of :func:`multi_steps`.

    Attributes:
      micro_step: int32 scalar, how many micro-batches the current window holds so far.
      gradient_step: int32 scalar, how many optimizer steps (emitting calls) have been made.
      acc_grads: the weighted sum of the window's gradients, in the accumulator dtype.
      acc_weight: float32 scalar, the sum of the window's weights.
      inner_state: the inner optimizer's state; it changes only on emitting calls.
      skipped: int32 scalar, how many micro-batches were left out as non-finite so far
        (only with ``skip_nonfinite=True``).
    """

    micro_step: jax.Array
    gradient_step: jax.Array
    acc_grads: optax.Updates
    acc_weight: jax.Array
    inner_state: optax.OptState
    skipped: jax.Array


def multi_steps(
    inner: optax.GradientTransformation,
    every_k: int | Callable[[jax.Array], ArrayLike],
    *,
    accumulator_dtype: DTypeLike | None = jnp.float32,
    skip_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Accumulates ``every_k`` micro-batch gradients, then applies ``inner`` once to their mean.

    For training loops that feed one micro-batch per call. The first ``k - 1`` calls of a
    window return zero updates; the k-th returns ``inner``'s update of the (weighted) mean
    gradient. Unlike ``optax.MultiSteps``, ``inner.update`` is placed in the emitting branch of
    a ``jax.lax.cond`` and is therefore executed only on emitting calls (under ``jax.jit`` on
    CPU, GPU and TPU; under ``jax.vmap`` a ``cond`` becomes a select and both branches run),
    its step counters and schedules advance once per optimizer step, and micro-batches can be
    weighted by their number of valid items.

    ``update(grads, state, params=None, *, weight=None, **extra_args)``: ``grads`` must be the
    mean over the micro-batch's (valid) items and ``weight`` their count (default 1). The
    emitted mean is ``sum(w_i * g_i) / sum(w_i)``; a micro-batch with weight 0 contributes
    nothing, and a window whose weights are all 0 feeds a zero gradient to ``inner``.
    ``extra_args`` are passed on to ``inner``.

    Args:
      inner: the optimizer to apply every k-th call (any optax transform or chain).
      every_k: k, an int >= 1, or a function of the int32 gradient step returning k (values
        below 1 count as 1).
      accumulator_dtype: the dtype of the accumulated gradient (never narrower than a
        gradient leaf); ``None`` keeps each gradient leaf's dtype. The emitted mean is cast
        back to the gradient's dtype.
      skip_nonfinite: leave out a micro-batch whose gradient holds a NaN or an infinity (it
        still counts as a call of the window) and renormalise: the emitted mean is over the
        window's finite micro-batches. A window with none is skipped whole: zero updates, the
        inner state and ``gradient_step`` unchanged. ``state.skipped`` counts them. Without
        it a NaN propagates into the update.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state :class:`MultiStepsState`.

    Raises:
      TypeError: if ``inner`` is not an optax transform or ``every_k`` not an int or callable.
      ValueError: if ``every_k`` < 1, or ``weight`` is not a scalar.

    Example:
      >>> import jax.numpy as jnp, optax, jaxaccum
      >>> opt = jaxaccum.multi_steps(optax.sgd(0.1), every_k=2)
      >>> params = jnp.zeros(2)
      >>> state = opt.init(params)
      >>> u1, state = opt.update(jnp.array([1.0, 2.0]), state, params)
      >>> u2, state = opt.update(jnp.array([3.0, 4.0]), state, params)
      >>> print(u1, u2, bool(jaxaccum.has_updated(state)))
      [0. 0.] [-0.2 -0.3] True

    References:
      ``optax.MultiSteps``; Ott et al., "Scaling Neural Machine Translation", 2018
      (https://arxiv.org/abs/1806.00187).
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            f"inner must be an optax.GradientTransformation; got {type(inner).__name__}"
        )
    if callable(every_k):
        schedule: Callable[[jax.Array], ArrayLike] = every_k
    else:
        k = _validation.positive_int(every_k, "every_k")
        schedule = lambda step: k  # noqa: E731
    inner_ex = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> MultiStepsState:
        return MultiStepsState(
            micro_step=jnp.zeros((), jnp.int32),
            gradient_step=jnp.zeros((), jnp.int32),
            acc_grads=_reductions.zeros_accumulator(params, accumulator_dtype),
            acc_weight=jnp.zeros((), jnp.float32),
            inner_state=inner_ex.init(params),
            skipped=jnp.zeros((), jnp.int32),
        )

    def update_fn(
        updates: optax.Updates,
        state: MultiStepsState,
        params: optax.Params | None = None,
        *,
        weight: ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, MultiStepsState]:
        _validation.floating_leaves(
            updates, "updates", "multi_steps averages gradients and needs floating leaves"
        )
        skipped = state.skipped
        if weight is None and not skip_nonfinite:
            w = None
            acc_weight = state.acc_weight + 1
        else:
            if weight is None:
                w = jnp.ones((), jnp.float32)
            else:
                _validation.scalar(jnp.asarray(weight), "weight", floating=False)
                w = jnp.asarray(weight, jnp.float32)
            if skip_nonfinite:
                finite = _reductions.all_finite(updates)
                w = jnp.where(finite, w, 0.0)
                skipped = skipped + jnp.logical_not(finite).astype(jnp.int32)
            acc_weight = state.acc_weight + w

        def add(acc: jax.Array, g: jax.Array) -> jax.Array:
            if w is None:
                return (acc + g).astype(acc.dtype)
            return _reductions.weighted_add(acc, g, w)

        k = jnp.maximum(jnp.asarray(schedule(state.gradient_step), jnp.int32), 1)
        emit = state.micro_step + 1 >= k

        acc_grads = jax.tree.map(add, state.acc_grads, updates)

        # Only the inner update sits in the cond, so only it is skipped on accumulating calls.
        def emit_branch(operands: Any) -> tuple[optax.Updates, optax.OptState]:
            total, inner_state = operands
            mean = _reductions.cast_like(_reductions.safe_divide(total, acc_weight), updates)
            return inner_ex.update(mean, inner_state, params, **extra_args)

        def accumulate_branch(operands: Any) -> tuple[optax.Updates, optax.OptState]:
            inner_state = operands[1]
            shapes, _ = jax.eval_shape(
                lambda: inner_ex.update(updates, inner_state, params, **extra_args)
            )
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), inner_state

        # With skip_nonfinite, a window without one finite micro-batch makes no step.
        step = jnp.logical_and(emit, acc_weight > 0) if skip_nonfinite else emit
        new_updates, inner_state = jax.lax.cond(
            step, emit_branch, accumulate_branch, (acc_grads, state.inner_state)
        )
        return new_updates, MultiStepsState(
            micro_step=jnp.where(emit, 0, state.micro_step + 1).astype(jnp.int32),
            gradient_step=(state.gradient_step + step).astype(jnp.int32),
            acc_grads=jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc_grads),
            acc_weight=jnp.where(emit, 0.0, acc_weight).astype(jnp.float32),
            inner_state=inner_state,
            skipped=skipped,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def has_updated(state: MultiStepsState) -> jax.Array:
    """Whether the last :func:`multi_steps` update emitted (applied the inner optimizer).

    Args:
      state: a :class:`MultiStepsState`, as returned by the last update.

    Returns:
      A boolean scalar array.

    Raises:
      TypeError: if ``state`` is not a :class:`MultiStepsState`.

    Example:
      >>> import jax.numpy as jnp, optax, jaxaccum
      >>> opt = jaxaccum.multi_steps(optax.sgd(1.0), every_k=3)
      >>> state = opt.init(jnp.zeros(1))
      >>> bool(jaxaccum.has_updated(state))
      False
    """
    if not isinstance(state, MultiStepsState):
        raise TypeError(f"state must be a MultiStepsState; got {type(state).__name__}")
    return jnp.logical_and(state.micro_step == 0, state.gradient_step > 0)
