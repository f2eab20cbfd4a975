"""Gradient accumulation with Flax linen's ``TrainState``: ``import jaxaccum.linen``.

Duck-typed, flax is not imported: a "train state" is any object with ``params``,
``opt_state``, ``tx``, ``step`` and a ``replace(**fields)`` method, such as
``flax.training.train_state.TrainState`` and subclasses with a ``batch_stats`` field.

- :func:`train_step`: one jitted step ``(state, batch, *rest) -> (state, loss, info)`` over k
  micro-batches, threading ``state.batch_stats`` (if present) through them.
- :func:`apply_gradients`: ``TrainState.apply_gradients`` for ``tx = jaxaccum.multi_steps(...)``
  (or ``optax.MultiSteps``): it passes ``weight=`` on to the transform and counts optimizer
  steps in ``state.step``, not calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from jaxaccum import (
    _arguments,
    _options,
    _pipeline,
    _reductions,
    _train_step,
)
from jaxaccum._multi_steps import MultiStepsState
from jaxaccum._options import OptionsDict
from jaxaccum._records import StepInfo, step_info

__all__ = ["apply_gradients", "train_step"]

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"  # flax.training.train_state's name


def _multi_steps_states(opt_state: Any) -> list[Any]:
    """The (jaxaccum or optax) multi-steps states inside an optimizer state."""
    kinds = (MultiStepsState, optax.MultiStepsState)
    return [
        s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds))
        if isinstance(s, kinds)
    ]


def _steps_made(old: Any, new: Any) -> Any:
    """How many optimizer steps one ``tx.update`` made: 1, or for a multi-steps transform the
    increase of its ``gradient_step`` (0 while accumulating, 1 on the emitting call)."""
    before, after = _multi_steps_states(old), _multi_steps_states(new)
    if not after:
        return 1
    if len(after) > 1:
        raise ValueError(
            f"the optimizer state holds {len(after)} multi-steps states; which one counts the "
            "optimizer steps is ambiguous"
        )
    return after[0].gradient_step - before[0].gradient_step


def apply_gradients(state: Any, grads: Any, *, weight: ArrayLike | None = None,
                    **replace: Any) -> Any:
    """``state.apply_gradients(grads=grads)`` that takes a micro-batch weight and counts steps.

    ``flax.training.train_state.TrainState.apply_gradients`` calls ``tx.update(grads,
    opt_state, params)``: it cannot pass ``weight=`` (its keyword arguments are fields to
    replace), and it adds 1 to ``state.step`` on every call. With ``tx =
    jaxaccum.multi_steps(inner, every_k=k)`` (or ``optax.MultiSteps``) every call is one
    micro-batch, so ``step`` would count micro-batches. This function calls
    ``tx.update(grads, opt_state, params, weight=weight)`` (``weight`` only when given),
    applies the updates, and adds to ``step`` the number of optimizer steps made: 1 for a
    plain transform; for a multi-steps transform 1 on the call that made an optimizer step and
    0 otherwise (so ``step`` is the inner optimizer's ``gradient_step``).

    Args:
      state: a ``TrainState`` (any object with ``params``, ``opt_state``, ``tx``, ``step`` and
        ``replace``).
      grads: gradients with the structure of ``state.params`` (the mean over the micro-batch's
        valid examples when ``weight`` is given).
      weight: the micro-batch's weight, e.g. its number of valid examples (needs a transform
        that takes it, as :func:`jaxaccum.multi_steps`).
      **replace: further fields to replace, as ``TrainState.apply_gradients``' keywords.

    Returns:
      The new state.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxaccum, jaxaccum.linen
      >>> from flax.training import train_state
      >>> tx = jaxaccum.multi_steps(optax.sgd(0.1), every_k=2)
      >>> state = train_state.TrainState.create(apply_fn=None, params=jnp.zeros(2), tx=tx)
      >>> for w in (1.0, 3.0):
      ...     state = jaxaccum.linen.apply_gradients(state, jnp.ones(2), weight=w)
      >>> int(state.step), state.params.tolist()
      (1, [-0.10000000149011612, -0.10000000149011612])
    """
    params, overwrite = state.params, None
    if isinstance(grads, dict) and OVERWRITE_WITH_GRADIENT in grads:  # as TrainState does
        params, overwrite = state.params["params"], grads[OVERWRITE_WITH_GRADIENT]
        grads = grads["params"]
    extra = {} if weight is None else {"weight": weight}
    updates, opt_state = state.tx.update(grads, state.opt_state, params, **extra)
    new_params = optax.apply_updates(params, updates)
    if overwrite is not None:
        new_params = {"params": new_params, OVERWRITE_WITH_GRADIENT: overwrite}
    return state.replace(
        step=state.step + _steps_made(state.opt_state, opt_state),
        params=new_params,
        opt_state=opt_state,
        **replace,
    )


def _with_rngs(loss_fn: Callable[..., Any], stats: bool) -> Callable[..., Any]:
    """``loss_fn`` whose last positional argument is the carried RNG state ``(keys, count)``:
    micro-batch ``count`` is called with ``rngs={name: fold_in(key, count)}`` and the count
    advances by one, as k sequential ``apply`` calls with those keys would draw."""

    def fun(*args: Any) -> Any:
        *plain, (keys, count) = args
        rngs = {name: jax.random.fold_in(key, count) for name, key in keys.items()}
        out = loss_fn(*plain, rngs=rngs)
        advanced = (keys, count + 1)
        if stats:
            value, new_stats = out
            return value, (new_stats, advanced)
        return out, advanced

    return fun


def train_step(
    loss_fn: Callable[..., Any],
    *,
    donate: bool = True,
    **options: Unpack[OptionsDict],
) -> Callable[..., tuple[Any, Any, StepInfo]]:
    """One jitted ``TrainState`` step over a batch split into k micro-batches.

    ``step = train_step(loss_fn, num_microbatches=k)``; ``state, loss, info = step(state,
    batch, *rest, rngs=None)``. Without a ``batch_stats`` field (or with ``state.batch_stats is
    None``), ``loss_fn(params, batch, *rest)`` returns the mean loss as for
    :func:`jaxaccum.value_and_grad`. With one, ``loss_fn(params, batch, batch_stats, *rest)``
    returns ``(loss, new_batch_stats)`` (``((loss, aux), new_batch_stats)`` with ``has_aux``),
    e.g. from ``apply_fn({"params": params, "batch_stats": batch_stats}, x,
    mutable=["batch_stats"])``: the statistics are carried through the micro-batches, as k
    sequential train-mode calls would update them.

    Randomness (``nn.Dropout``): pass ``rngs={"dropout": key}`` to the step (a new key every
    step, e.g. ``jax.random.fold_in(key, state.step)``); ``loss_fn`` then receives
    ``rngs=`` as a keyword and hands it to ``apply_fn``. Micro-batch i gets ``{"dropout":
    jax.random.fold_in(key, i)}``: every micro-batch draws its own masks, as k sequential
    ``apply`` calls with those keys would (one key for every micro-batch would repeat one
    mask k times). Masks that do not depend on k at all need keys per example
    (:func:`jaxaccum.per_example_keys`).

    The gradients go to :func:`apply_gradients` (one optimizer step; with a multi-steps
    ``tx``, ``step`` counts optimizer steps) and the final statistics into
    ``state.batch_stats``. A step whose total weight is 0 returns the state unchanged.

    Args:
      loss_fn: as above.
      donate: donate the state's arrays to the step (do not reuse the state you pass in).
      **options: the accumulation options (:class:`jaxaccum.Options`).

    Returns:
      ``step(state, batch, *rest, rngs=None) -> (state, loss, info)``, ``info`` a
      :class:`jaxaccum.StepInfo` (the aux in ``info.aux``), as every step returns.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxaccum.linen
      >>> from flax.training import train_state
      >>> def loss_fn(params, batch):
      ...     x, y = batch
      ...     return jnp.mean((x @ params - y) ** 2)
      >>> state = train_state.TrainState.create(
      ...     apply_fn=None, params=jnp.zeros(3), tx=optax.sgd(0.1))
      >>> step = jaxaccum.linen.train_step(loss_fn, num_microbatches=4)
      >>> state, loss, info = step(state, (jnp.ones((8, 3)), jnp.ones(8)))
      >>> int(state.step), float(loss), int(info.num_microbatches)
      (1, 1.0, 4)
    """
    entry = "jaxaccum.linen.train_step"
    opts = _options.parse(entry, options)
    _arguments.make(entry, loss_fn, opts)  # checks now

    def step(state: Any, batch: Any, *rest: Any, rngs: Any = None) -> tuple[Any, Any, StepInfo]:
        stats = getattr(state, "batch_stats", None)
        args: list[Any] = [state.params, batch, *([] if stats is None else [stats]), *rest]
        carry = [] if stats is None else [2]
        fun = loss_fn
        if rngs is not None:
            fun = _with_rngs(loss_fn, stats is not None)
            args.append((rngs, jnp.zeros((), jnp.int32)))
            carry.append(len(args) - 1)
        acc = _arguments.make(entry, fun, opts, carry_argnums=tuple(carry))
        res = _pipeline.run(acc, tuple(args))

        def update(old: Any) -> Any:  # (divided here, in the update, where it fuses into it)
            new = apply_gradients(old, res.mean_grads())
            return new if stats is None else new.replace(batch_stats=res.carry[0])

        new = _reductions.step_unless_empty(res.weight, update, state, donated=donate,
                                            may_be_empty=res.may_be_empty)
        return new, res.loss, step_info(res)

    jitted = jax.jit(step, donate_argnums=(0,) if donate else ())

    def run(state: Any, batch: Any, *rest: Any, rngs: Any = None) -> tuple[Any, Any, StepInfo]:
        args, tracing = _train_step.prepared(entry, opts, (batch, *rest))
        with tracing:
            return jitted(state, *args, rngs=rngs)  # type: ignore[no-any-return]

    return run
