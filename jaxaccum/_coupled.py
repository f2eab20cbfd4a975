"""Losses that couple the examples of a batch, accumulated exactly.

Two mechanisms, both built on the one pipeline (so every placement runs them):

- :func:`coupled_value_and_grad`, gradient through representations (GradCache, Gao et al.
  2021, generalised): a forward-only pass produces every micro-batch's representations; the
  coupled loss and its gradient with respect to the representations are computed on the
  whole batch's ``(B, ...)`` representations; a second pass replays each micro-batch's forward
  and pulls its slice of those cotangents back through it. Exact; memory is the
  representations plus one micro-batch's activations; the price is one extra forward.
- :func:`statistics_first`: a forward-only pass sums the statistics the loss needs over the
  whole batch (expert loads, group sums, token counts); the accumulation then runs with those
  global statistics as a constant. Exact when the gradient does not flow through them.

Randomness must replay bit-identically in the second pass: draw it from per-example keys in
the batch (:func:`jaxaccum.per_example_keys`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import optax

from jaxaccum import (
    _arguments,
    _options,
    _pipeline,
    _placement,
    _train_step,
    _value_and_grad,
)
from jaxaccum._options import OptionsDict
from jaxaccum._records import Result, step_info
from jaxaccum._reductions import AuxReductionName


def _forward(entry: str, fun: Callable[..., Any], opts: _options.Options, how: AuxReductionName,
             takes_weights: bool = True) -> Any:
    """A pass of the pipeline that only evaluates ``fun`` and returns its output combined
    across micro-batches as ``how`` says: the differentiated argument is a scalar placeholder
    (the loss itself), so no parameter gradient is computed or accumulated.

    On a mesh it runs as on Auto axes, even where they are Explicit: each device evaluates its
    share of every micro-batch and the outputs meet once, after the loop (on Explicit axes a
    sum over the batch inside ``fun`` would be reduced over the devices in every micro-batch).
    """

    def placeholder_loss(zero: jax.Array, params: Any, *args: Any) -> tuple[jax.Array, Any]:
        return zero, fun(params, *args)

    opts = dataclasses.replace(opts, has_aux=how, weighted=False, skip_nonfinite=False,
                               noise_scale=False)
    acc = _arguments.make(entry, placeholder_loss, opts, argnums=0, batch_argnums=2,
                          takes_weights=takes_weights)
    placement = _placement.for_forward(opts)

    def forward(params: Any, batch: Any, *rest: Any) -> Any:
        args = (jnp.zeros((), jnp.float32), params, batch, *rest)
        return _pipeline.run(acc, args, placement=placement).aux

    return forward


# Options the coupled-loss mechanism cannot honour, and why (refused when it is built).
NOT_COUPLED = {
    "weighted": "the coupled loss sees the whole batch at once: mask padded examples inside "
    "the loss",
    "skip_nonfinite": "a non-finite micro-batch cannot be left out of a loss that couples it "
    "with every other",
    "noise_scale": "its gradient is no mean of micro-batch gradients, so there is no "
    "micro-batch gradient to compare (jaxaccum.value_and_grad, train_step and "
    "statistics_first offer it)",
    "max_microbatches": "the representations of the whole batch are computed at once; give "
    "num_microbatches or microbatch_size (jaxaccum.value_and_grad, train_step and "
    "statistics_first take a runtime count)",
}


def _refuse(entry: str, options: OptionsDict) -> None:
    for name, why in NOT_COUPLED.items():
        if options.get(name) not in (None, False):
            raise TypeError(f"{entry}: {name}= is not taken: {why}; remove it here")


def coupled_value_and_grad(
    encode: Callable[..., Any],
    loss: Callable[..., Any],
    *,
    return_info: bool = False,
    **options: Unpack[OptionsDict],
) -> Callable[..., tuple[Any, ...]]:
    """``jax.value_and_grad`` of a loss that couples the whole batch, over k micro-batches.

    ``encode(params, microbatch, *rest)`` returns per-example representations (a pytree whose
    leaves have the micro-batch's leading axis: embeddings, scores). ``loss(params, reps,
    batch, *rest)`` returns the scalar loss of the whole batch from the whole batch's
    representations, in batch order (in-batch negatives, a CLIP/InfoNCE loss, a late-
    interaction score). The result equals ``jax.value_and_grad(lambda p, b, *r: loss(p,
    encode(p, b, *r), b, *r))(params, batch, *rest)`` up to float rounding, for any k; the
    gradient reaches ``params`` through the representations and through ``loss``'s own use of
    ``params`` (a temperature).

    Args:
      encode: the per-example part of the model.
      loss: the batch-coupled loss on the representations.
      return_info: also return a :class:`jaxaccum.StepInfo`, as
        :func:`jaxaccum.value_and_grad` does (its ``weight`` is the micro-batch count, its
        ``skipped`` 0).
      **options: the accumulation options (:class:`jaxaccum.Options`): ``num_microbatches``
        or ``microbatch_size``, ``accumulator_dtype``, ``mesh``, ``unroll``, and ``has_aux``
        as a bool: ``loss`` returns ``(value, aux)`` and the aux, computed once on the whole
        batch, comes back as it is. ``weighted``, ``skip_nonfinite``, ``noise_scale`` and
        ``max_microbatches`` are not taken: the coupled loss sees the whole batch at once, so
        it normalises itself (mask padding inside ``loss``), a non-finite micro-batch cannot
        be left out of it, and its gradient is no mean of micro-batch gradients.

    Returns:
      A function ``(params, batch, *rest) -> (loss, grads)``, with ``has_aux=True``
      ``((loss, aux), grads)``; with ``return_info=True`` ``(value, grads, info)``.

    Raises:
      TypeError: an unknown option, one of the options not taken, or a ``has_aux`` that is
        not a bool.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxaccum
      >>> def encode(w, x):
      ...     return jnp.tanh(x @ w)
      >>> def loss(w, z, x):  # every example against every other: in-batch negatives
      ...     logits = z @ z.T
      ...     return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(z)), jnp.arange(len(z))])
      >>> w, x = jnp.eye(3) * 0.5, jnp.arange(24.0).reshape(8, 3) / 10
      >>> full = jax.value_and_grad(lambda w, x: loss(w, encode(w, x), x))(w, x)
      >>> micro = jax.jit(jaxaccum.coupled_value_and_grad(encode, loss, num_microbatches=4))(w, x)
      >>> bool(jnp.allclose(full[0], micro[0])), bool(jnp.allclose(full[1], micro[1], atol=1e-6))
      (True, True)
    """
    opts, result = _coupled("jaxaccum.coupled_value_and_grad", encode, loss, options)
    _value_and_grad.check_return_info("jaxaccum.coupled_value_and_grad", opts, return_info)

    @functools.wraps(loss)
    def accumulated(params: Any, batch: Any, *rest: Any) -> tuple[Any, ...]:
        res = result(params, batch, *rest)
        value = (res.loss, res.aux) if opts.has_aux else res.loss
        grads = res.mean_grads()
        return (value, grads, step_info(res)) if return_info else (value, grads)

    return accumulated


def _coupled(entry: str, encode: Callable[..., Any], loss: Callable[..., Any],
             options: OptionsDict) -> tuple[_options.Options, Callable[..., Result]]:
    """The options of a coupled loss, parsed once, and its ``(params, batch, *rest) ->
    Result``: a forward pass for the representations, the loss and its cotangents on the
    whole batch, and a replay pass pulling each micro-batch's slice back: the gradient of the
    sum over micro-batches of ``<encode(params, micro-batch), its cotangents>``, a sum that is
    never divided, so no gradient-sized buffer follows the loop."""
    _refuse(entry, options)
    has_aux = options.get("has_aux", False)
    if not isinstance(has_aux, bool):
        raise TypeError(
            f"{entry}: has_aux must be a bool (the loss's aux is computed once on the whole "
            f"batch and returned as it is); got {has_aux!r}"
        )
    opts = _options.parse(entry, options, runtime_count=False)
    pull_opts = dataclasses.replace(opts, has_aux=False, weighted=True)
    _arguments.make(entry, encode, pull_opts)  # (encode checked as the loss function is)

    def surrogate(p: Any, both: Any, *r: Any) -> tuple[jax.Array, jax.Array]:
        micro, cot = both  # <encode(p, micro), its cotangent>, weight 1: summed
        z = encode(p, micro, *r)
        dot = sum((jnp.sum(a * b) for a, b in zip(jax.tree.leaves(z), jax.tree.leaves(cot),
                                                  strict=True)), jnp.zeros(()))
        return dot, jnp.ones((), jnp.float32)

    # the replay pass, built whole once: the surrogate's gradient is the pulled-back sum
    pullback = _arguments.make(entry, surrogate, pull_opts, takes_weights=False)
    forward = _forward(entry, encode, opts, "concat", takes_weights=False)

    def result(params: Any, batch: Any, *rest: Any) -> Result:
        reps = forward(params, batch, *rest)
        value, (direct, cotangents) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=has_aux)(
            params, reps, batch, *rest)
        pull = _pipeline.run(pullback, (params, (batch, cotangents), *rest))
        # the pulled-back sum is the whole gradient already (weight 1 per micro-batch, never
        # divided): its divisor is 1; added to the direct part in the accumulator's dtype
        grads = jax.tree.map(lambda d, g: d.astype(g.dtype) + g, direct, pull.grads)
        value, aux = value if has_aux else (value, None)
        count = pull.num_microbatches
        return Result(value, grads, aux, jnp.asarray(count, jnp.float32),
                      jnp.zeros((), jnp.int32), count, like=pull.like,
                      divisor=jnp.ones((), jnp.float32))

    return opts, result


def statistics_first(
    stats: Callable[..., Any],
    fun: Callable[..., Any],
    *,
    return_info: bool = False,
    **options: Unpack[OptionsDict],
) -> Callable[..., tuple[Any, ...]]:
    """``value_and_grad`` of a loss that needs statistics of the whole batch.

    ``stats(params, microbatch, *rest)`` returns the micro-batch's **sums** (expert token
    counts, per-group reward sums and counts, numbers of tokens); they are summed over the
    whole batch (and the data-parallel devices) in a forward-only pass, then ``fun(params,
    microbatch, totals, *rest)`` (the mean loss over its examples, as for
    :func:`jaxaccum.value_and_grad`) is accumulated with those totals as a constant. Exact
    whenever no gradient flows through the statistics (MoE load fractions, GRPO advantages,
    normalisers): the result equals ``jax.value_and_grad`` of ``fun(params, batch,
    stop_gradient(stats(params, batch)))`` on the full batch.

    Args:
      stats: the statistics of one micro-batch, as sums.
      fun: the loss, given the whole batch's totals.
      return_info: also return a :class:`jaxaccum.StepInfo`, as
        :func:`jaxaccum.value_and_grad` does.
      **options: the accumulation options (:class:`jaxaccum.Options`), for the loss; every
        one is taken.

    Returns:
      A function ``(params, batch, *rest) -> (value, grads)`` shaped as
      :func:`jaxaccum.value_and_grad` shapes it (``(value, grads, info)`` with
      ``return_info=True``).

    Examples:
      >>> import jax, jax.numpy as jnp, jaxaccum
      >>> def stats(w, x):  # the batch's sum and count
      ...     return {"sum": jnp.sum(x @ w), "n": jnp.asarray(x.shape[0], jnp.float32)}
      >>> def loss(w, x, totals):  # centred by the whole batch's mean
      ...     return jnp.mean((x @ w - totals["sum"] / totals["n"]) ** 2)
      >>> w, x = jnp.ones(3), jnp.arange(24.0).reshape(8, 3) / 10
      >>> def full_loss(w, x):
      ...     return loss(w, x, jax.lax.stop_gradient(stats(w, x)))
      >>> full = jax.value_and_grad(full_loss)(w, x)
      >>> micro = jax.jit(jaxaccum.statistics_first(stats, loss, num_microbatches=4))(w, x)
      >>> bool(jnp.allclose(full[0], micro[0])), bool(jnp.allclose(full[1], micro[1]))
      (True, True)
    """
    entry = "jaxaccum.statistics_first"
    acc, result = _statistics_first(entry, stats, fun, options)
    _value_and_grad.check_return_info(entry, acc.options, return_info)

    @functools.wraps(fun)
    def accumulated(params: Any, batch: Any, *rest: Any) -> tuple[Any, ...]:
        return _value_and_grad.shape_result(acc, result(params, batch, *rest), return_info)

    return accumulated


def _statistics_first(entry: str, stats: Callable[..., Any], fun: Callable[..., Any],
                      options: OptionsDict) -> tuple[_arguments.Accumulation,
                                                        Callable[..., Result]]:
    """The accumulation of ``fun`` with the totals as argument 2 (options parsed once), and
    its ``(params, batch, *rest) -> Result``: a forward pass summing ``stats``, then the
    pipeline with the totals as a constant."""
    opts = _options.parse(entry, options)
    forward = _forward(entry, stats, opts, "sum")

    def with_totals(params: Any, batch: Any, totals: Any, *rest: Any) -> Any:
        return fun(params, batch, jax.lax.stop_gradient(totals), *rest)

    acc = _arguments.make(entry, with_totals, opts)

    def result(params: Any, batch: Any, *rest: Any) -> Result:
        totals = forward(params, batch, *rest)
        return _pipeline.run(acc, (params, batch, totals, *rest))

    return acc, result


def coupled_train_step(
    encode: Callable[..., Any],
    loss: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    donate: bool = True,
    **options: Unpack[OptionsDict],
) -> _train_step.TrainStep:
    """:func:`jaxaccum.train_step` for a batch-coupled loss: one jitted, donating step
    ``(params, opt_state, batch, *rest) -> (params, opt_state, loss, info)`` whose gradient is
    :func:`coupled_value_and_grad`'s.

    Args:
      encode: as in :func:`coupled_value_and_grad`.
      loss: as in :func:`coupled_value_and_grad`.
      optimizer: any optax transform or chain.
      donate: donate ``params`` and ``opt_state``.
      **options: as in :func:`coupled_value_and_grad`.

    Returns:
      A :class:`jaxaccum.TrainStep`.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxaccum
      >>> def encode(w, x):
      ...     return jnp.tanh(x @ w)
      >>> def loss(w, z, x):
      ...     return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(z @ z.T)))
      >>> opt = optax.sgd(0.1)
      >>> step = jaxaccum.coupled_train_step(encode, loss, opt, num_microbatches=4)
      >>> w = jnp.eye(3) * 0.5
      >>> w, state, value, info = step(w, opt.init(w), jnp.arange(24.0).reshape(8, 3) / 10)
      >>> int(info.num_microbatches)
      4
    """
    entry = "jaxaccum.coupled_train_step"
    opts, result = _coupled(entry, encode, loss, options)
    return _train_step.from_result(entry, result, optimizer, donate, opts)


def statistics_first_train_step(
    stats: Callable[..., Any],
    fun: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    donate: bool = True,
    **options: Unpack[OptionsDict],
) -> _train_step.TrainStep:
    """:func:`jaxaccum.train_step` for a loss that needs the whole batch's statistics: one
    jitted, donating step whose gradient is :func:`statistics_first`'s (the aux, if any, in
    ``info.aux``).

    Args:
      stats: as in :func:`statistics_first`.
      fun: as in :func:`statistics_first`.
      optimizer: any optax transform or chain.
      donate: donate ``params`` and ``opt_state``.
      **options: the accumulation options.

    Returns:
      A :class:`jaxaccum.TrainStep`.
    """
    entry = "jaxaccum.statistics_first_train_step"
    acc, result = _statistics_first(entry, stats, fun, options)
    return _train_step.from_result(entry, result, optimizer, donate, acc.options)
