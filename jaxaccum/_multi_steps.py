"""``multi_steps``: an optax transform that accumulates one micro-batch per call.

A drop-in for ``optax.MultiSteps`` (same state field names, same keyword arguments, a
``has_updated`` method) that runs the inner optimizer only on emitting calls and takes weights.
The rules for weights and skipped micro-batches are those of :mod:`jaxaccum._reductions`.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike, DTypeLike

from jaxaccum import _options, _reductions, _validation

ShouldSkipUpdateFn = Callable[[optax.Updates, jax.Array, "optax.Params | None"], tuple[Any, Any]]


class MultiStepsState(NamedTuple):
    """State of :func:`multi_steps`; the first five fields are those of ``optax.MultiStepsState``.

    Attributes:
      mini_step: int32 scalar, how many micro-batches the current window holds so far.
      gradient_step: int32 scalar, how many optimizer steps (inner updates) have been made.
      inner_opt_state: the inner optimizer's state; it changes only on calls that make an
        optimizer step, and keeps the dtypes ``inner.init`` gave it.
      acc_grads: the window's gradients so far as a weighted **sum**, ``sum_i w_i * g_i``, in
        the accumulator dtype (zeros after an emitting call). Unlike ``optax.MultiSteps``,
        whose ``acc_grads`` is the running mean: the mean here is
        ``acc_grads / acc_weight``, computed once when the window ends.
      skip_state: what ``should_skip_update_fn`` returned last as its second output (``()``
        without one), as in ``optax.MultiSteps``.
      acc_weight: float32 scalar, the sum of the window's weights.
      skipped: int32 scalar, how many micro-batches were left out so far: non-finite ones
        (with ``skip_nonfinite=True``) and those ``should_skip_update_fn`` rejected.
      emitted: bool scalar, whether the last call made an optimizer step; what
        :func:`has_updated` returns.
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    inner_opt_state: optax.OptState
    acc_grads: optax.Updates
    skip_state: Any
    acc_weight: jax.Array
    skipped: jax.Array
    emitted: jax.Array


def has_updated(state: MultiStepsState) -> jax.Array:
    """Whether the last :func:`multi_steps` update made an optimizer step.

    True only after a call that ended a window *and* applied the inner optimizer: False on
    accumulating calls, after a window that was skipped whole (every micro-batch weight 0 or
    non-finite), and after a call rejected by ``should_skip_update_fn``.

    Args:
      state: a :class:`MultiStepsState`, as returned by the last update.

    Returns:
      A boolean scalar array.

    Raises:
      TypeError: if ``state`` is not a :class:`MultiStepsState`.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxaccum
      >>> opt = jaxaccum.multi_steps(optax.sgd(1.0), every_k=3)
      >>> state = opt.init(jnp.zeros(1))
      >>> bool(jaxaccum.has_updated(state)), bool(opt.has_updated(state))
      (False, False)
    """
    if not isinstance(state, MultiStepsState):
        raise TypeError(f"state must be a MultiStepsState; got {type(state).__name__}")
    return state.emitted


class MultiStepsTransformation(optax.GradientTransformationExtraArgs):
    """What :func:`multi_steps` returns: an ``optax.GradientTransformationExtraArgs``.

    The ``(init, update)`` pair optax expects, plus ``optax.MultiSteps``' two helpers, so code
    written for ``optax.MultiSteps`` runs unchanged: ``has_updated(state)`` (the same as
    :func:`has_updated`) and ``gradient_transformation()`` (which returns the object itself).
    Build it with :func:`multi_steps`; its own constructor takes ``(init, update)``, as any
    ``optax.GradientTransformation``.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxaccum
      >>> opt = jaxaccum.multi_steps(optax.adam(1e-3), every_k_schedule=2)
      >>> isinstance(opt, optax.GradientTransformationExtraArgs)
      True
      >>> tx = opt.gradient_transformation()  # as with optax.MultiSteps
      >>> state = tx.init(jnp.zeros(3))
      >>> _, state = tx.update(jnp.ones(3), state)
      >>> bool(opt.has_updated(state)), int(state.mini_step)
      (False, 1)
    """

    __slots__ = ()

    has_updated = staticmethod(has_updated)

    def gradient_transformation(self) -> MultiStepsTransformation:
        """This transformation itself (``optax.MultiSteps`` needs the conversion; we do not)."""
        return self


class _NotGiven:
    """The type of ``every_k``'s default: not given (``every_k=None`` means windows of no k)."""

    def __repr__(self) -> str:
        return "<not given>"


_NOT_GIVEN: Any = _NotGiven()
_ENTRY = "jaxaccum.multi_steps"
_UPDATE = "jaxaccum.multi_steps(...).update"


def _every_k_schedule(
    every_k: Any, every_k_schedule: Any
) -> Callable[[jax.Array], ArrayLike] | None:
    """The k schedule from ``every_k`` or its optax-named alias ``every_k_schedule``.

    ``None`` for ``every_k=None``: windows that end only when the caller passes ``emit``.
    """
    k_given = every_k is not _NOT_GIVEN
    if k_given and every_k_schedule is not None:
        raise ValueError(
            f"{_ENTRY}: give every_k or its alias every_k_schedule, not both; got "
            f"every_k={every_k!r}, every_k_schedule={every_k_schedule!r}; keep one (every_k=None "
            "alone for windows that end only at update(..., emit=True))"
        )
    if not k_given and every_k_schedule is None:
        raise TypeError(
            f"{_ENTRY} needs every_k (or its alias every_k_schedule); got neither: pass "
            "every_k=k for windows of k calls, or every_k=None for windows that end only at "
            "update(..., emit=True)"
        )
    if every_k is None:
        return None
    if k_given:
        name, value = "every_k", every_k
    else:
        name, value = "every_k_schedule", every_k_schedule
    if callable(value):
        return value  # type: ignore[no-any-return]
    k = _validation.positive_int(value, name, _ENTRY)
    return lambda step: k


def _emit_flag(emit: Any) -> jax.Array | None:
    """``emit`` as a boolean scalar array, or ``None`` for ``None`` and Python ``False``.

    Checks the (possibly traced) flag's type, dtype and shape; never its value.
    """
    if emit is None or emit is False:
        return None  # exactly today's computation: the window ends only at k
    if isinstance(emit, bool):
        return jnp.asarray(emit)
    shape = getattr(emit, "shape", None)
    dtype = getattr(emit, "dtype", None)
    expected = "None, a bool or a boolean scalar array (dtype bool, shape ())"
    if shape is None or dtype is None:
        raise TypeError(
            f"{_UPDATE}: emit must be {expected}; got {emit!r} of type {type(emit).__name__}. "
            "Pass a comparison, e.g. emit=(i == n - 1), or jnp.asarray(flag, bool)"
        )
    if dtype != jnp.bool_:
        raise TypeError(
            f"{_UPDATE}: emit must be {expected}; got an array of dtype {dtype} and shape "
            f"{tuple(shape)}. Pass a comparison, e.g. emit=(i == n - 1), or flag.astype(bool)"
        )
    if shape != ():
        raise ValueError(
            f"{_UPDATE}: emit must be {expected}, one flag for the call; got an array of dtype "
            f"{dtype} and shape {tuple(shape)}. Pass this call's flag, e.g. flags[i]"
        )
    return jnp.asarray(emit)


_KEYWORDS = ("every_k", "every_k_schedule", "use_grad_mean", "should_skip_update_fn",
             "accumulator_dtype", "skip_nonfinite")


def _check_keywords(unknown: dict[str, Any]) -> None:
    """Refuses a keyword :func:`multi_steps` does not take, naming the accepted ones."""
    for name in unknown:
        close = difflib.get_close_matches(name, _KEYWORDS, n=1)
        hint = f"did you mean {close[0]}=? " if close else ""
        options = (" (an option of jaxaccum.Options: multi_steps takes one micro-batch's "
                   "gradient per call, and its count as update(..., weight=n))"
                   if name in _OPTIONS else "")
        raise TypeError(
            f"{_ENTRY}: unknown keyword argument {name}={unknown[name]!r}{options}; {hint}"
            f"multi_steps(inner, every_k, ...) takes {list(_KEYWORDS)}: remove {name}= or "
            "rename it"
        )


# the accumulation options multi_steps has no use for (it is given one gradient per call)
_OPTIONS = tuple(name for name in _options.Options.__dataclass_fields__ if name not in _KEYWORDS)


def _check_bool(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r} of type {type(value).__name__}")


def _keep_dtypes(new: Any, old: Any) -> Any:
    """``new`` with each leaf cast to the dtype of the matching leaf of ``old`` where it differs."""

    def cast(n: Any, o: Any) -> Any:
        dtype = _reductions.leaf_dtype(o)
        return n if _reductions.leaf_dtype(n) == dtype else jnp.asarray(n).astype(dtype)

    return jax.tree.map(cast, new, old)


def multi_steps(
    inner: optax.GradientTransformation,
    every_k: int | Callable[[jax.Array], ArrayLike] | None = _NOT_GIVEN,
    *,
    every_k_schedule: int | Callable[[jax.Array], ArrayLike] | None = None,
    use_grad_mean: bool = True,
    should_skip_update_fn: ShouldSkipUpdateFn | None = None,
    accumulator_dtype: DTypeLike | None = jnp.float32,
    skip_nonfinite: bool = False,
    **unknown: Any,
) -> MultiStepsTransformation:
    """Accumulates ``every_k`` micro-batch gradients, then applies ``inner`` once to their mean.

    For training loops that feed one micro-batch per call. The first ``k - 1`` calls of a
    window return zero updates; the k-th returns ``inner``'s update of the (weighted) mean
    gradient. The caller can also end a window itself, with ``update(..., emit=True)``: the
    last, partial window of an epoch, say, or, with ``every_k=None``, windows of any length.
    ``inner.update`` sits in the emitting branch of a ``jax.lax.cond`` and so runs only on
    emitting calls (under ``jax.jit`` on CPU, GPU and TPU; under ``jax.vmap`` a ``cond`` becomes
    a select and both branches run).

    ``update(grads, state, params=None, *, weight=None, emit=None, **extra_args)``: ``grads`` is
    the mean over the micro-batch's (valid) items and ``weight`` their count (default 1);
    ``extra_args`` go to ``inner`` on the emitting call. The emitted gradient is
    ``sum(w_i * g_i) / sum(w_i)`` (``sum(w_i * g_i)`` with ``use_grad_mean=False``), cast back to
    the gradient's dtype. The weighting rules of :class:`jaxaccum.Options` (``weighted``)
    hold: a weight-0 micro-batch adds nothing (not even a NaN); a window of total weight 0
    makes no step (zero updates, ``inner_opt_state`` and ``gradient_step`` unchanged,
    ``has_updated`` False); a negative ``weight`` raises a ``ValueError`` when it is
    concrete, and when traced makes the emitted update NaN (with ``skip_nonfinite`` the
    micro-batch is left out and counted instead).

    ``emit`` is the caller's end of the window: a bool or a boolean scalar array (it may be
    traced under ``jax.jit``: one compilation serves both values). When true, this call's
    gradient joins the window and the window ends now, whatever its length, as if it had
    reached k: ``inner`` is applied once to the (weighted) mean of the gradients the window
    holds (exact for any length: ``acc_grads`` holds their sum and ``acc_weight`` their total
    weight), ``mini_step`` returns to 0, ``gradient_step`` advances and ``has_updated`` is True.
    When ``None`` or false the call is as without it, and a window that reaches k ends as
    always. ``emit`` ends the window even when ``should_skip_update_fn`` rejects, or
    ``skip_nonfinite`` leaves out, this call's gradient: the window ends with what it held (if
    that is nothing, or of total weight 0, it ends without a step).

    Replacing ``optax.MultiSteps(opt, every_k_schedule=k, ...)`` by
    ``jaxaccum.multi_steps(opt, every_k_schedule=k, ...)`` is the whole migration: the state
    fields ``mini_step``, ``gradient_step``, ``inner_opt_state`` and ``skip_state`` mean what
    they mean in optax (``acc_grads`` holds the weighted sum, not optax's running mean; see
    :class:`MultiStepsState`), the keywords are optax's, and the result has
    ``has_updated(state)`` and ``gradient_transformation()``. Differences, each deliberate:

    - ``inner.update`` runs only on emitting calls (optax runs it on every call and keeps the
      result with ``jnp.where``): k times less optimizer work.
    - ``weight``: the exact mean over valid items however unevenly they fall into micro-batches
      (optax has no weights: a mean of micro-batch means).
    - The mean is the window's float32 sum divided once by its total weight; optax keeps a
      running mean (``acc + (g - acc) / (n + 1)``), which divides at every call. Both equal
      the full batch's mean up to float32 rounding (tested against a float64 run).
    - A window of total weight 0 makes no step; optax feeds a zero gradient to the inner
      optimizer, which advances Adam's count and decays its moments.
    - ``has_updated`` says whether the last call made a step (the ``emitted`` field); optax's
      ``mini_step == 0 and gradient_step > 0`` stays True after a step until a call is
      accumulated, e.g. across calls that ``should_skip_update_fn`` rejected.
    - ``skip_nonfinite=True`` (ours) keeps the call in the window and renormalises over its
      finite micro-batches, so windows stay aligned with the data; ``should_skip_update_fn``
      (optax's) drops the call as if it never happened, lengthening the window.
    - The accumulator is never narrower than a parameter leaf (optax casts to
      ``accumulator_dtype`` even if narrower); ``every_k`` values below 1 count as 1.
    - No ``inner_opt`` attribute; the optax keywords are keyword-only.
    - ``emit`` and ``every_k=None`` (ours): windows the caller ends, of any length.
    - With an inner ``optax.apply_if_finite`` and a non-finite micro-batch (without
      ``skip_nonfinite``): here the window's mean is NaN, ``apply_if_finite`` skips that one
      step, and the next window starts from zeros and steps normally. In
      ``optax.MultiSteps`` the NaN stays in its accumulator after the window ends (it is
      reset by multiplication), so every later window is NaN and skipped too, until
      ``max_consecutive_errors`` lets a NaN update through (measured with optax 0.2.8: after
      one NaN micro-batch at every_k=2, no later window stepped). Prefer
      ``skip_nonfinite=True``, which drops only the bad micro-batch and keeps the rest.

    As in optax, the inner optimizer's step count (and so its schedules) advance once per
    optimizer step, and its state keeps the dtypes ``inner.init`` gave it (an update that would
    change them, as Adam's with bfloat16 parameters and float32 gradients, is cast back): the
    state pytree never changes type, so a jitted step compiles once and ``opt.init(params)`` is
    an exact checkpoint-restore template. Pass ``mu_dtype=jnp.float32`` to Adam for float32
    moments with low-precision parameters.

    Args:
      inner: the optimizer to apply every k-th call (any optax transform or chain).
      every_k: k, an int >= 1, or a function of the int32 gradient step returning k (values
        below 1 count as 1); or ``None``: windows of no fixed length, each ending only at a
        call ``update(..., emit=True)`` (the other calls accumulate). One of ``every_k`` and
        ``every_k_schedule`` must be given.
      every_k_schedule: optax's name for ``every_k`` (an int or a function, not ``None``);
        give one of the two.
      use_grad_mean: emit the weighted mean (default) or, if False, the weighted sum
        ``sum(w_i * g_i)`` (optax's sum when every weight is 1).
      should_skip_update_fn: optax's hook, e.g. ``optax.skip_not_finite`` or
        ``functools.partial(optax.skip_large_updates, max_squared_norm=...)``: a function
        ``(grads, gradient_step, params) -> (should_skip, skip_state)`` with ``should_skip`` a
        boolean scalar. A rejected micro-batch changes nothing but ``skip_state`` and
        ``skipped``: it is not accumulated and does not count as a call of the window.
      accumulator_dtype: the dtype of the accumulated gradient (never narrower than a
        parameter leaf); ``None`` keeps each parameter leaf's dtype.
      skip_nonfinite: leave out a micro-batch whose gradient holds a NaN or an infinity (it
        still counts as a call of the window) and renormalise: the emitted mean is over the
        window's finite micro-batches. A window with none makes no step. ``state.skipped``
        counts them. Without it (and without ``should_skip_update_fn``) a NaN propagates into
        the update.

    Returns:
      A :class:`MultiStepsTransformation` (an ``optax.GradientTransformationExtraArgs``) with
      state :class:`MultiStepsState`.

    Raises:
      TypeError: for a keyword argument it does not take (the error names it, the accepted ones and
        the closest match); if ``inner`` is not an optax transform, ``every_k`` is not an int,
        callable or ``None`` (or neither it nor ``every_k_schedule`` is given), a flag is not a
        bool, or ``should_skip_update_fn`` is not callable; at update (at trace time), for
        non-floating gradients, or an ``emit`` that is not a bool or an array of dtype bool.
      ValueError: if ``every_k`` < 1 or both spellings are given; at update, if ``weight`` is
        not a scalar, or is concrete and negative or non-finite, ``should_skip_update_fn``
        does not return a boolean scalar, or ``emit`` is a boolean array of shape other
        than ``()``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxaccum
      >>> opt = jaxaccum.multi_steps(optax.sgd(0.1), every_k_schedule=2)
      >>> params = jnp.zeros(2)
      >>> state = opt.init(params)
      >>> u1, state = opt.update(jnp.array([1.0, 2.0]), state, params, weight=1)
      >>> u2, state = opt.update(jnp.array([5.0, 6.0]), state, params, weight=3)
      >>> print(u1, u2, bool(opt.has_updated(state)))
      [0. 0.] [-0.4 -0.5] True

      ``emit=True`` ends a window early, e.g. the last, partial window of an epoch: one step
      on the mean of the two gradients it holds, and the next window starts empty.

      >>> opt = jaxaccum.multi_steps(optax.sgd(1.0), every_k=4)
      >>> state = opt.init(params)
      >>> _, state = opt.update(jnp.array([1.0, 2.0]), state, params)
      >>> u, state = opt.update(jnp.array([3.0, 6.0]), state, params, emit=True)
      >>> print(u, int(state.mini_step), int(state.gradient_step), bool(opt.has_updated(state)))
      [-2. -4.] 0 1 True

      With ``every_k=None`` only ``emit`` ends a window; under ``jax.jit`` the flag may be
      traced (pass it as an array, or any argument ``jax.jit`` traces).

      >>> opt = jaxaccum.multi_steps(optax.sgd(1.0), every_k=None)
      >>> update = jax.jit(opt.update)
      >>> state = opt.init(params)
      >>> for i, g in enumerate([1.0, 2.0, 6.0]):
      ...     u, state = update(jnp.full(2, g), state, params, emit=jnp.asarray(i == 2))
      >>> print(u, int(state.gradient_step))
      [-3. -3.] 1

    References:
      ``optax.MultiSteps``; Ott et al., "Scaling Neural Machine Translation", 2018
      (https://arxiv.org/abs/1806.00187).
    """
    _check_keywords(unknown)
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            f"inner must be an optax.GradientTransformation; got {type(inner).__name__}"
        )
    schedule = _every_k_schedule(every_k, every_k_schedule)
    _check_bool(use_grad_mean, "use_grad_mean")
    _check_bool(skip_nonfinite, "skip_nonfinite")
    if should_skip_update_fn is not None and not callable(should_skip_update_fn):
        raise TypeError(
            "should_skip_update_fn must be a function (updates, gradient_step, params) -> "
            f"(should_skip, skip_state); got {type(should_skip_update_fn).__name__}"
        )
    config = _Window(optax.with_extra_args_support(inner), schedule, use_grad_mean,
                     should_skip_update_fn, accumulator_dtype, skip_nonfinite)
    return MultiStepsTransformation(functools.partial(_init, config),
                                    functools.partial(_update, config))


class _Window(NamedTuple):
    """What :func:`multi_steps` decided once, for every call of its ``init`` and ``update``.

    Attributes:
      inner: the inner transform, taking extra arguments.
      schedule: ``gradient_step -> k`` (None: only the caller's ``emit`` ends a window).
      use_grad_mean, should_skip_update_fn, accumulator_dtype, skip_nonfinite: as given to
        :func:`multi_steps`.
    """

    inner: optax.GradientTransformationExtraArgs
    schedule: Callable[[jax.Array], ArrayLike] | None
    use_grad_mean: bool
    should_skip_update_fn: ShouldSkipUpdateFn | None
    accumulator_dtype: DTypeLike | None
    skip_nonfinite: bool


def _init(window: _Window, params: optax.Params) -> MultiStepsState:
    gradient_step = jnp.zeros((), jnp.int32)
    skip_state: Any = ()
    if window.should_skip_update_fn is not None:
        _, skip_state = window.should_skip_update_fn(
            optax.tree.zeros_like(params), gradient_step, params
        )
    return MultiStepsState(
        mini_step=jnp.zeros((), jnp.int32),
        gradient_step=gradient_step,
        inner_opt_state=window.inner.init(params),
        acc_grads=_reductions.zeros_accumulator(params, window.accumulator_dtype),
        skip_state=skip_state,
        acc_weight=jnp.zeros((), jnp.float32),
        skipped=jnp.zeros((), jnp.int32),
        emitted=jnp.zeros((), jnp.bool_),
    )


def _check_update(updates: optax.Updates, weight: ArrayLike | None) -> None:
    _validation.floating_leaves(
        updates, "updates", "multi_steps averages gradients and needs floating leaves"
    )
    if weight is not None:
        try:
            _validation.scalar(jnp.asarray(weight), "weight", floating=False)
            _reductions.check_weight(weight, "weight")
        except (TypeError, ValueError) as e:
            raise type(e)(f"{_UPDATE}: {e}") from None


def _admitted(window: _Window, updates: optax.Updates, state: MultiStepsState,
              params: optax.Params | None) -> tuple[jax.Array | None, Any, jax.Array]:
    """Whether the micro-batch enters the window (None: ``should_skip_update_fn`` is not
    given, every one does), the new skip state, and whether it is left out."""
    if window.should_skip_update_fn is None:
        return None, state.skip_state, jnp.zeros((), jnp.bool_)
    should_skip, skip_state = window.should_skip_update_fn(updates, state.gradient_step, params)
    should_skip = jnp.asarray(should_skip)
    if (should_skip.dtype, should_skip.shape) != (jnp.bool_, ()):
        raise ValueError(
            "should_skip_update_fn must return a boolean scalar first; got dtype "
            f"{should_skip.dtype} and shape {should_skip.shape}"
        )
    return jnp.logical_not(should_skip), skip_state, should_skip


def _added(window: _Window, updates: optax.Updates, state: MultiStepsState,
           weight: ArrayLike | None, keep: jax.Array | None,
           left_out: jax.Array) -> tuple[Any, jax.Array, jax.Array, jax.Array]:
    """The micro-batch added into the window: ``(acc_grads, acc_weight, mini_step,
    left_out)`` (a non-finite micro-batch left out too, with ``skip_nonfinite``)."""
    w: jax.Array | None = None
    if weight is None and not window.skip_nonfinite:
        acc_weight = state.acc_weight + 1  # every weight 1: plain sums, no NaN to guard
    else:
        w = jnp.ones((), jnp.float32) if weight is None else jnp.asarray(weight, jnp.float32)
        if window.skip_nonfinite:
            w, bad = _reductions.skip_if_nonfinite(w, _reductions.all_finite(updates))
            left_out = jnp.logical_or(left_out, bad)
        acc_weight = _reductions.add_weight(state.acc_weight, w)

    def add(acc: jax.Array, g: ArrayLike) -> jax.Array:
        if w is None:
            return (acc + g).astype(acc.dtype)
        return _reductions.weighted_add(acc, g, w)

    acc_grads = jax.tree.map(add, state.acc_grads, updates)
    mini_step = state.mini_step + 1
    if keep is not None:  # a rejected micro-batch leaves the window as it was
        acc_grads = jax.tree.map(
            lambda new, old: jnp.where(keep, new, old), acc_grads, state.acc_grads
        )
        acc_weight = jnp.where(keep, acc_weight, state.acc_weight)
        mini_step = jnp.where(keep, mini_step, state.mini_step)
    return acc_grads, acc_weight, mini_step, left_out


def _ends(window: _Window, state: MultiStepsState, mini_step: jax.Array,
          keep: jax.Array | None, caller_emit: jax.Array | None) -> jax.Array:
    """Whether this call ends the window (k below 1 acts as 1: a kept call makes
    ``mini_step`` >= 1)."""
    if window.schedule is None:  # every_k=None: only the caller ends a window
        emit = jnp.zeros((), jnp.bool_)
    else:
        emit = mini_step >= jnp.asarray(window.schedule(state.gradient_step), jnp.int32)
        if keep is not None:  # a rejected call never ends a window (even one resumed
            emit = jnp.logical_and(keep, emit)  # with k smaller than what it holds)
    if caller_emit is not None:  # the caller ends it now, with what it holds (this call's
        emit = jnp.logical_or(emit, caller_emit)  # gradient, unless left out, included)
    return emit


def _inner_step(window: _Window, step: jax.Array, acc_grads: Any, acc_weight: jax.Array,
                updates: optax.Updates, inner_state: Any, params: optax.Params | None,
                extra_args: dict[str, Any]) -> tuple[optax.Updates, optax.OptState]:
    """The inner update on the window's mean where ``step``, else zeros and the state as it
    was: a ``lax.cond``, so that ``inner.update`` runs only on emitting calls."""

    def inner_step(total: Any, inner_state: Any) -> tuple[optax.Updates, optax.OptState]:
        if window.use_grad_mean:  # acc_weight != 0 here; a NaN one gives NaN
            total = _reductions.safe_divide(total, acc_weight)
        new_updates, new_state = window.inner.update(
            _reductions.cast_like(total, updates), inner_state, params, **extra_args
        )
        return new_updates, _keep_dtypes(new_state, inner_state)

    def no_step(total: Any, inner_state: Any) -> tuple[optax.Updates, optax.OptState]:
        shapes, _ = jax.eval_shape(inner_step, total, inner_state)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), inner_state

    return jax.lax.cond(step, inner_step, no_step, acc_grads, inner_state)  # type: ignore[no-any-return]


def _update(
    window: _Window,
    updates: optax.Updates,
    state: MultiStepsState,
    params: optax.Params | None = None,
    *,
    weight: ArrayLike | None = None,
    emit: ArrayLike | None = None,
    **extra_args: Any,
) -> tuple[optax.Updates, MultiStepsState]:
    _check_update(updates, weight)
    caller_emit = _emit_flag(emit)
    keep, skip_state, left_out = _admitted(window, updates, state, params)
    acc_grads, acc_weight, mini_step, left_out = _added(window, updates, state, weight, keep,
                                                        left_out)
    ends = _ends(window, state, mini_step, keep, caller_emit)
    # No step on a window of total weight 0; a NaN total (a traced negative weight) does
    # step, so that the NaN reaches the update instead of being dropped silently.
    step = jnp.logical_and(ends, acc_weight != 0)
    new_updates, inner_opt_state = _inner_step(window, step, acc_grads, acc_weight, updates,
                                               state.inner_opt_state, params, extra_args)
    return new_updates, MultiStepsState(
        mini_step=jnp.where(ends, 0, mini_step).astype(jnp.int32),
        gradient_step=(state.gradient_step + step).astype(jnp.int32),
        inner_opt_state=inner_opt_state,
        acc_grads=jax.tree.map(lambda a: jnp.where(ends, jnp.zeros_like(a), a), acc_grads),
        skip_state=skip_state,
        acc_weight=jnp.where(ends, 0.0, acc_weight).astype(jnp.float32),
        skipped=(state.skipped + left_out).astype(jnp.int32),
        emitted=step,
    )
