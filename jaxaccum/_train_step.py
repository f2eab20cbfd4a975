"""``train_step``: micro-batched gradients and one optimizer update in one jitted program."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxaccum import _accumulate


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
    **kwargs: Any,
) -> Callable[..., tuple[optax.Params, optax.OptState, jax.Array, Any]]:
    """Builds one jitted optimizer step over a batch split into micro-batches.

    ``step(params, opt_state, batch, *rest)`` computes the loss and gradient of
    ``loss_fn(params, batch, *rest)`` with :func:`jaxaccum.value_and_grad` (one ``lax.scan``
    over the micro-batches), applies ``optimizer.update`` once and ``optax.apply_updates``, all
    in one ``jax.jit`` program. ``params`` and ``opt_state`` are donated: do not reuse the
    arrays you pass in.

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
        skipped: ``params`` and ``opt_state`` come back unchanged. ``aux`` is then
        ``{"aux": aux or None, "skipped": count, "num_microbatches": k}``.
      donate: donate ``params`` and ``opt_state`` to the step (saves their memory).
      **kwargs: passed on to :func:`jaxaccum.value_and_grad` (``accumulator_dtype``,
        ``remat``, ``unroll``).

    Returns:
      A jitted ``step(params, opt_state, batch, *rest) -> (params, opt_state, loss, aux)``;
      ``aux`` (stacked over micro-batches) is ``None`` without ``has_aux``.

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
    grad_fn = _accumulate.value_and_grad(
        loss_fn,
        num_microbatches=num_microbatches,
        microbatch_size=microbatch_size,
        has_aux=has_aux,
        weighted=weighted,
        argnums=0,
        batch_argnums=1,
        skip_nonfinite=skip_nonfinite,
        **kwargs,
    )

    def step(
        params: optax.Params, opt_state: optax.OptState, batch: Any, *rest: Any
    ) -> tuple[optax.Params, optax.OptState, jax.Array, Any]:
        value, grads = grad_fn(params, batch, *rest)
        loss, aux = value if has_aux or skip_nonfinite else (value, None)
        info: Any = aux
        updates, new_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if skip_nonfinite:  # nothing finite to learn from: skip the optimizer step
            keep = info["skipped"] == info["num_microbatches"]
            new_params, new_state = jax.tree.map(
                lambda old, new: jnp.where(keep, old, new),
                (params, opt_state),
                (new_params, new_state),
            )
        return new_params, new_state, loss, aux

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())
