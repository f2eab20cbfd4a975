"""``plan_microbatches``: the smallest k whose compiled step fits a memory budget."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import optax

from jaxaccum import _options, _placement, _train_step, _validation, _value_and_grad


class MemoryEstimate(NamedTuple):
    """XLA's compile-time memory analysis of one compiled step, in bytes.

    Attributes:
      num_microbatches: the k this program was compiled for.
      argument_bytes: the inputs (parameters, optimizer state, batch).
      output_bytes: the outputs.
      alias_bytes: outputs that reuse donated inputs' buffers (counted once).
      temp_bytes: XLA's temporary buffers: activations, gradients, accumulators.
      total_bytes: ``argument + output - alias + temp``, the estimate compared with the budget.
    """

    num_microbatches: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    total_bytes: int


class MicrobatchPlan(NamedTuple):
    """The result of :func:`plan_microbatches`.

    Attributes:
      num_microbatches: the chosen k, the smallest candidate whose estimate fits the budget.
      estimates: the estimate of every candidate compiled, in the order tried: keyed by k, or
        by ``(k, fsdp)`` when several ``fsdp`` options were planned.
      fsdp: the chosen FSDP option when several were planned (``"step"`` or
        ``"microbatch"``), else None.
    """

    num_microbatches: int
    estimates: dict[Any, MemoryEstimate]
    fsdp: _options.FsdpMode | None = None


def memory_estimate(compiled: Any, num_microbatches: int) -> MemoryEstimate:
    """Reads a ``jax.stages.Compiled``'s ``memory_analysis()`` into a :class:`MemoryEstimate`."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise RuntimeError(
            "this backend gives no compile-time memory analysis (memory_analysis() returned "
            "None); plan_microbatches cannot estimate memory here"
        )
    fields = [
        int(getattr(analysis, name))
        for name in (
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "alias_size_in_bytes",
            "temp_size_in_bytes",
        )
    ]
    if not any(fields):
        raise RuntimeError(
            "this backend reports every compile-time memory field as 0; plan_microbatches "
            "cannot estimate memory here"
        )
    argument, output, alias, temp = fields
    return MemoryEstimate(
        num_microbatches, argument, output, alias, temp, argument + output - alias + temp
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_microbatches(
    fun: Callable[..., Any],
    params: optax.Params,
    batch: Any,
    *rest: Any,
    memory_budget: int,
    optimizer: optax.GradientTransformation | None = None,
    candidates: Sequence[int] | None = None,
    fsdp: _options.FsdpMode | Sequence[_options.FsdpMode] | None = None,
    **kwargs: Any,
) -> MicrobatchPlan:
    """Chooses the smallest number of micro-batches whose compiled step fits ``memory_budget``.

    Each candidate k (by default every divisor of the batch size, smallest first) is lowered
    and compiled — nothing is run, so there are no out-of-memory trials — and XLA's
    ``memory_analysis()`` gives its argument, output, alias and temporary bytes. The first k
    whose ``argument + output - alias + temp`` fits is returned.

    Limits of the estimate: it is XLA's buffer assignment for one program. It does not count
    the runtime's own overhead, buffers held outside the step (other arrays you keep alive),
    or fragmentation; on the CPU, temporaries inside library calls (e.g. oneDNN matmul scratch)
    are not in ``temp``. Some backends report no analysis or all zeros: then a ``RuntimeError``
    says so rather than guessing. Leave headroom in the budget.

    Args:
      fun: the loss, as for :func:`jaxaccum.value_and_grad` (``fun(params, batch, *rest)``).
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      batch: the full batch (arrays or ``jax.ShapeDtypeStruct``).
      *rest: further arguments of ``fun``.
      memory_budget: bytes available to the step, an int >= 1.
      optimizer: when given, plan the whole :func:`jaxaccum.train_step` (gradient, optimizer
        update, donated params and state) instead of the gradient alone.
      candidates: the k to try, instead of all divisors of the batch size.
      fsdp: with ``mesh=jaxaccum.DataParallel(...)`` whose parameters are sharded over the data
        axes: one option (``"step"`` or ``"microbatch"``, see :class:`jaxaccum.DataParallel`),
        or a sequence
        of them in order of preference, to plan the option along with k: for each k, smallest
        first, the options are tried in the order given and the first that fits is chosen
        (``("step", "microbatch")`` prefers the option with k times less traffic).
      **kwargs: the other accumulation options (:class:`jaxaccum.Options`): ``has_aux``,
        ``weighted``, ``accumulator_dtype``, ``mesh``.

    Returns:
      A :class:`MicrobatchPlan`: the chosen k and the estimate per candidate compiled.

    Raises:
      ValueError: if ``memory_budget`` is not positive, a candidate does not divide the batch
        size, or even the largest candidate does not fit (the message gives its estimate).
      RuntimeError: if the backend gives no usable memory analysis.

    Examples:
      >>> import jax.numpy as jnp, jaxaccum
      >>> def loss(w, x):
      ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> w, x = jnp.ones((64, 64)), jnp.ones((256, 64))
      >>> big = jaxaccum.plan_microbatches(loss, w, x, memory_budget=2**30)
      >>> big.num_microbatches
      1
    """
    budget = _validation.positive_int(memory_budget, "memory_budget")
    batch_size = _validation.leading_batch_size((params, batch), (1,))
    ks = sorted(set(candidates)) if candidates is not None else _divisors(batch_size)
    for k in ks:
        _validation.resolve_num_microbatches(
            batch_size, _validation.positive_int(k, "candidates"), None
        )
    opt_state = None if optimizer is None else jax.eval_shape(optimizer.init, params)
    several = fsdp is not None and not isinstance(fsdp, str)
    options: list[_options.FsdpMode | None] = (
        list(fsdp) if fsdp is not None and not isinstance(fsdp, str) else [fsdp]
    )
    dp = _options.parse("jaxaccum.plan_microbatches", {"num_microbatches": 1, **kwargs}
                        ).data_parallel
    if fsdp is not None and dp is None:
        raise ValueError(
            f"jaxaccum.plan_microbatches: fsdp={fsdp!r} needs mesh=jaxaccum.DataParallel(...)"
        )
    estimates: dict[Any, MemoryEstimate] = {}
    for k in ks:
        for option in options:
            extra = dict(kwargs)
            if option is not None and dp is not None:
                extra["mesh"] = dataclasses.replace(dp, fsdp=option)
            opts = _options.parse("jaxaccum.plan_microbatches",
                                  {"num_microbatches": k, **extra})
            with _placement.mesh_context(opts):
                if optimizer is None:
                    fn = _value_and_grad.value_and_grad(fun, num_microbatches=k, **extra)
                    lowered = jax.jit(fn).lower(params, batch, *rest)
                else:
                    train = _train_step.train_step(fun, optimizer, num_microbatches=k, **extra)
                    lowered = train.lower(params, opt_state, batch, *rest)
                estimate = memory_estimate(lowered.compile(), k)
            estimates[(k, option) if several else k] = estimate
            if estimate.total_bytes <= budget:
                return MicrobatchPlan(k, estimates, option if several else None)
    smallest = min(estimates.values(), key=lambda e: e.total_bytes)
    raise ValueError(
        f"memory_budget={budget} bytes is too small: the smallest estimate is "
        f"{smallest.total_bytes} bytes (k={smallest.num_microbatches}; temp "
        f"{smallest.temp_bytes}, arguments {smallest.argument_bytes}); candidates tried: {ks}"
    )
