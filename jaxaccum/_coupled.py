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

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxaccum import (
    _arguments,
    _options,
    _pipeline,
    _placement,
    _train_step,
    _validation,
    _value_and_grad,
)


def _forward(entry: str, fun: Callable[..., Any], options: dict[str, Any], how: str) -> Any:
    """A pass of the pipeline that only evaluates ``fun`` and returns its output combined
    across micro-batches as ``how`` says: the differentiated argument is a scalar placeholder
    (the loss itself), so no parameter gradient is computed or accumulated.

    On a mesh it runs as on Auto axes, even where they are Explicit: each device evaluates its
    share of every micro-batch and the outputs meet once, after the loop (on Explicit axes a
    sum over the batch inside ``fun`` would be reduced over the devices in every micro-batch).
    """

    def placeholder_loss(zero: jax.Array, params: Any, *args: Any) -> tuple[jax.Array, Any]:
        return zero, fun(params, *args)

    opts = _options.parse(entry, {**options, "has_aux": how})
    acc = _arguments.make(entry, placeholder_loss, opts, argnums=0, batch_argnums=2)
    dp = opts.data_parallel

    def forward(params: Any, batch: Any, *rest: Any) -> Any:
        args = (jnp.zeros((), jnp.float32), params, batch, *rest)
        if dp is None or not dp.explicit:
            return _value_and_grad.call(acc, args).aux
        return _pipeline.run(acc, args, _placement.AutoMesh(dp)).aux

    return forward


def coupled_value_and_grad(
    encode: Callable[..., Any],
    loss: Callable[..., Any],
    **options: Any,
) -> Callable[..., tuple[Any, Any]]:
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
      **options: the accumulation options (:class:`jaxaccum.Options`): ``num_microbatches``
        or ``microbatch_size``, ``accumulator_dtype``, ``mesh``, ``unroll``, and ``has_aux``
        as a bool: ``loss`` returns ``(value, aux)`` and the aux, computed once on the whole
        batch, comes back as it is. ``weighted`` and ``skip_nonfinite`` are not taken: the
        coupled loss sees the whole batch at once, so it normalises itself (mask padding
        inside ``loss``) and a non-finite micro-batch cannot be left out of it.

    Returns:
      A function ``(params, batch, *rest) -> (loss, grads)``, with ``has_aux=True``
      ``((loss, aux), grads)``.

    Raises:
      TypeError: an unknown option, ``weighted``/``skip_nonfinite``, or a ``has_aux`` that
        is not a bool.

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
    entry = "jaxaccum.coupled_value_and_grad"
    for name in ("weighted", "skip_nonfinite"):
        if name in options:
            raise TypeError(
                f"{entry}: {name}= is not taken: the coupled loss sees the whole batch at once "
                "(mask padded examples inside the loss; a non-finite micro-batch cannot be "
                "left out of a loss that couples it with every other)"
            )
    has_aux = options.pop("has_aux", False)
    if not isinstance(has_aux, bool):
        raise TypeError(
            f"{entry}: has_aux must be a bool (the loss's aux is computed once on the whole "
            f"batch and returned as it is); got {has_aux!r}"
        )
    pullback = _arguments.make(entry, encode, _options.parse(entry, {**options, "weighted": True}))
    forward = _forward(entry, encode, options, "concat")

    def result(params: Any, batch: Any, *rest: Any) -> _pipeline.Result:
        reps = forward(params, batch, *rest)
        value, (direct, cotangents) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=has_aux)(
            params, reps, batch, *rest)
        size = _validation.leading_batch_size((batch,), (0,), entry)

        def surrogate(p: Any, both: Any, *r: Any) -> tuple[jax.Array, jax.Array]:
            micro, cot = both  # <encode(p, micro), its cotangent>, scaled for the mean
            z = encode(p, micro, *r)
            dot = sum(jnp.sum(a * b) for a, b in zip(jax.tree.leaves(z), jax.tree.leaves(cot),
                                                     strict=True))
            m = jax.tree.leaves(micro)[0].shape[0]
            return dot * (size / m), jnp.asarray(m, jnp.float32)

        pull = _value_and_grad.call(pullback.with_fun(surrogate), (params, (batch, cotangents),
                                                                   *rest))
        grads = jax.tree.map(jnp.add, direct, pull.grads)
        value, aux = value if has_aux else (value, None)
        return _pipeline.Result(value, grads, aux, jnp.ones((), jnp.float32),
                                jnp.zeros((), jnp.int32), pull.num_microbatches)

    @functools.wraps(loss)
    def accumulated(params: Any, batch: Any, *rest: Any) -> tuple[Any, Any]:
        res = result(params, batch, *rest)
        return ((res.loss, res.aux) if has_aux else res.loss), res.grads

    accumulated.result = result  # type: ignore[attr-defined]
    return accumulated


def statistics_first(
    stats: Callable[..., Any],
    fun: Callable[..., Any],
    **options: Any,
) -> Callable[..., tuple[Any, Any]]:
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
      **options: the accumulation options (:class:`jaxaccum.Options`), for the loss.

    Returns:
      A function ``(params, batch, *rest) -> (value, grads)`` shaped as
      :func:`jaxaccum.value_and_grad` shapes it.

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
    opts = _options.parse(entry, options)
    forward = _forward(entry, stats, {k: v for k, v in options.items()
                                      if k not in ("has_aux", "weighted", "skip_nonfinite")},
                       "sum")

    def with_totals(params: Any, batch: Any, totals: Any, *rest: Any) -> Any:
        return fun(params, batch, jax.lax.stop_gradient(totals), *rest)

    acc = _arguments.make(entry, with_totals, opts)

    def result(params: Any, batch: Any, *rest: Any) -> _pipeline.Result:
        totals = forward(params, batch, *rest)
        return _value_and_grad.call(acc, (params, batch, totals, *rest))

    @functools.wraps(fun)
    def accumulated(params: Any, batch: Any, *rest: Any) -> tuple[Any, Any]:
        res = result(params, batch, *rest)
        return _value_and_grad.shape_value(acc, res), res.grads

    accumulated.result = result  # type: ignore[attr-defined]
    return accumulated


def coupled_train_step(
    encode: Callable[..., Any],
    loss: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    donate: bool = True,
    **options: Any,
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
    fn = coupled_value_and_grad(encode, loss, **options)
    return _train_step.from_value_and_grad(entry, fn.result, optimizer, donate,  # type: ignore[attr-defined]
                                           options)


def statistics_first_train_step(
    stats: Callable[..., Any],
    fun: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    donate: bool = True,
    **options: Any,
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
    fn = statistics_first(stats, fun, **options)
    return _train_step.from_value_and_grad(entry, fn.result, optimizer, donate,  # type: ignore[attr-defined]
                                           options)
