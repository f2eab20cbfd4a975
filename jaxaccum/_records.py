"""The records every front end shares: what the pipeline accumulates (:class:`Sums`), what a
gradient source returns (:class:`Result`), and the one report every entry point gives
(:class:`StepInfo`).

The contract: every step returns its loss and a :class:`StepInfo`; every ``value_and_grad``
returns jax's ``(value, grads)`` and, with ``return_info=True``, ``(value, grads, info)``, the
same :class:`StepInfo`. No option changes these shapes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum import _reductions


class Sums(NamedTuple):
    """What one device accumulates before the final division.

    Attributes:
      loss: the sum over micro-batches of ``weight_i * loss_i`` (unweighted: ``weight_i = 1``).
      grads: the matching sum of gradients, in the accumulator dtype.
      weight: float32, the sum of the weights (unweighted: the number of micro-batches).
      skipped: int32, micro-batches left out for a non-finite loss or gradient.
      carry: the carried arguments' current values (a tuple, one per carried argument).
      aux: one accumulator per aux leaf (None where the leaf is stacked by the scan).
      sq_norms: with ``noise_scale``, float32 ``(sum_i n_i |g_i|^2, sum_i n_i, m)`` over the
        ``m`` micro-batches: each gradient's squared norm (each device's own, before any
        reduction) times its number of items ``n_i`` (examples; with ``weighted``, its weight).
    """

    loss: jax.Array
    grads: Any
    weight: jax.Array
    skipped: jax.Array
    carry: Any = ()
    aux: Any = None
    sq_norms: Any = None


class Result(NamedTuple):
    """What a gradient source returns (the pipeline, the coupled pass, statistics-first):
    the gradient as an undivided sum, divided once where it is used (:meth:`mean_grads`).

    Attributes:
      loss: the (weighted) mean loss over the batch, in the loss's dtype (a scalar, divided
        where its dtype is known).
      grads: the sum of the micro-batch gradients (each times its weight), reduced over the
        data axes, in the accumulator dtype: not yet divided by the total weight.
      aux: the aux value combined across micro-batches as ``has_aux`` says (None without).
      weight: float32 scalar, the total weight (unweighted: the micro-batches kept).
      skipped: int32 scalar, micro-batches left out by ``skip_nonfinite``.
      num_microbatches: the micro-batches evaluated (a Python int; on an Auto mesh, k per
        device times the data-parallel devices; an int32 array with ``max_microbatches``).
      carry: the carried arguments' final values (a tuple), ``()`` without them.
      noise: with ``noise_scale``, a :class:`jaxaccum.NoiseScale` (inside the placement:
        the reduced sum of the micro-batch gradients' squared norms).
      aux_plan: the aux leaves' reductions (:attr:`Shapes.aux_plan`), for a placement that
        combines the devices' aux values.
      like: the differentiated arguments (as the loss function saw them): the gradient
        comes back in their dtypes.
      may_be_empty: the total weight can be 0 (``Options.divides_safely``): the mean is then
        zeros.
      divisor: what ``grads`` is divided by; None: ``weight`` (the coupled pass's sum is the
        whole gradient already: its divisor is 1 while it reports its micro-batch count).
    """

    loss: jax.Array
    grads: Any
    aux: Any
    weight: jax.Array
    skipped: jax.Array
    num_microbatches: Any
    carry: Any = ()
    noise: Any = None
    aux_plan: Any = ()
    like: Any = None
    may_be_empty: bool = False
    divisor: Any = None

    def mean_grads(self, cast: bool = True) -> Any:
        """The gradient: ``grads`` divided once by the total weight (zeros for a total of 0
        where it can be 0), in the differentiated arguments' dtypes (``cast=False``: the
        accumulator's).

        A train step calls this inside its update, where the division fuses into the
        optimizer even under the zero-weight rule's ``lax.cond`` (whose operands XLA
        materialises): no gradient-sized buffer is written for the mean."""
        total = self.weight if self.divisor is None else self.divisor
        divide = _reductions.safe_divide if self.may_be_empty else _reductions.divide
        grads = divide(self.grads, total)
        return _reductions.cast_like(grads, self.like) if cast else grads


class Shapes(NamedTuple):
    """The abstract output of ``fun`` on one micro-batch, and the plan made from it once per
    call.

    Attributes:
      loss: the loss's shape and dtype.
      aux: the aux value's (None without aux).
      aux_plan: one :class:`jaxaccum._reductions.AuxReduction` per aux leaf, in flattened
        order (``[]`` without aux).
      convs: ``fun`` holds a convolution (its gradient is then rewritten for XLA:CPU's loop
        bodies: :func:`jaxaccum._xla.conv_layout.canonical_convs`).
    """

    loss: Any
    aux: Any
    aux_plan: Any = ()
    convs: bool = False


class StepInfo(NamedTuple):
    """What every entry point reports besides its loss (and gradients): one record, one shape.

    Every step (:func:`jaxaccum.train_step`, the coupled and statistics-first steps,
    ``jaxaccum.nnx.train_step``, ``jaxaccum.linen.train_step``) returns one; every
    ``value_and_grad`` returns one when built with ``return_info=True``. Options fill fields,
    they never change the shape.

    Attributes:
      aux: the aux value combined as ``has_aux`` says (None without aux).
      skipped: int32 scalar, micro-batches left out by ``skip_nonfinite`` (over all devices).
      weight: float32 scalar, the total weight the mean was taken over: with ``weighted`` the
        sum of the kept micro-batches' weights (e.g. tokens), else the number of micro-batches
        kept. 0 means the step made no update.
      num_microbatches: int32 scalar, the micro-batches evaluated (on an Auto mesh summed over
        the data-parallel devices: k per device times their number; with
        ``max_microbatches`` the runtime count).
      carry: the carried arguments' final values (one value, a tuple for several), ``()``
        without ``carry_argnums``.
      noise_scale: with the ``noise_scale`` option, the step's :class:`jaxaccum.NoiseScale`
        estimates; None without.
    """

    aux: Any
    skipped: jax.Array
    weight: jax.Array
    num_microbatches: jax.Array
    carry: Any = ()
    noise_scale: Any = None


def step_info(res: Result, carry: Any = ()) -> StepInfo:
    """The :class:`StepInfo` of a pipeline :class:`Result` (``carry`` shaped for the caller)."""
    return StepInfo(
        aux=res.aux,
        skipped=jnp.asarray(res.skipped, jnp.int32),
        weight=jnp.asarray(res.weight, jnp.float32),
        num_microbatches=jnp.asarray(res.num_microbatches, jnp.int32),
        carry=carry,
        noise_scale=res.noise,
    )
