"""``jaxaccum.check``: a startup self-check of an accumulated step on a probe batch."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, Unpack

import jax
import numpy as np

from jaxaccum import _options, _placement, _value_and_grad
from jaxaccum._options import OptionsDict
from jaxaccum._xla import hlo as _hlo

EPS32 = float(np.finfo(np.float32).eps)
# Accumulation reorders float32 sums; its rounding error is of the order of the full batch's own
# (both O(eps32 log B) per reduction). 10x that error plus 16 ulps leaves room for the two
# realisations to differ; the bugs this looks for are errors of 1e-3 and more.
FACTOR, FLOOR = 10.0, 16.0


class CheckReport(NamedTuple):
    """What :func:`check` found.

    Attributes:
      ok: no problem found.
      problems: each problem in plain words, with what to do (empty when ``ok``).
      error: the step's loss-and-gradient error against the float64 full batch, relative to
        the largest magnitude of the reference.
      full_batch_error: the same error of the float32 full batch (k = 1, no accumulation).
      bound: the error float32 rounding allows: ``10 x full_batch_error + 16 eps32``.
      scale: the factor that best maps the reference gradient onto the step's (1 if right).
      reductions: gradient-sized reductions over the data axes in the compiled step.
      reductions_in_loops: how many of them sit inside a loop (run once per micro-batch).
    """

    ok: bool
    problems: list[str]
    error: float
    full_batch_error: float
    bound: float
    scale: float
    reductions: int
    reductions_in_loops: int


def _rel(tree: Any, ref: Any) -> float:
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
               for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref), strict=True))
    scale = max(float(np.max(np.abs(np.asarray(b, np.float64)))) for b in jax.tree.leaves(ref))
    return diff / max(scale, 1e-30)


def _scale(grads: Any, ref: Any) -> float:
    g = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(grads)])
    r = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(ref)])
    return float(g @ r / max(r @ r, 1e-300))


def _float64(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(x, np.float64) if np.issubdtype(
        np.asarray(x).dtype, np.floating) else np.asarray(x), tree)


def _data_groups(options: _options.Options) -> set[int]:
    dp = options.data_parallel
    if dp is None:
        return set()
    return {math.prod(dp.mesh.shape[a] for a in sub) for r in range(1, len(dp.axes) + 1)
            for sub in itertools.combinations(dp.axes, r)}


def check(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    *rest: Any,
    step: Callable[..., tuple[Any, Any]] | None = None,
    **options: Unpack[OptionsDict],
) -> CheckReport:
    """Checks an accumulated gradient against the full batch, on a probe batch, once.

    Runs the step you train with (``step``, or ``jaxaccum.value_and_grad(loss_fn,
    **options)``) on ``batch``, the plain full batch (``jax.value_and_grad(loss_fn)``, k = 1)
    in float32, and the full batch in float64, and compares: the step's error against the
    float64 run must stay within what float32 rounding allows (10x the float32 full batch's
    own error, plus 16 ulps). From the compiled step it counts the gradient-sized reductions
    over the data axes and those inside loops (once per micro-batch: k times the traffic).
    Silent accumulation bugs are caught this way: a reduction per micro-batch, a gradient
    scaled wrong (a mean of sums, 1/k twice), a step fed one micro-batch's gradient, and a loss
    that couples the batch (in-batch negatives, batch statistics) accumulated as if it did not.

    Args:
      loss_fn: the loss of the whole batch, ``loss_fn(params, batch, *rest)`` (for a coupled
        loss, the loss computed on the full batch's representations).
      params: the parameters.
      batch: a probe batch (a few micro-batches' worth is enough; it must divide into k).
      *rest: further arguments of ``loss_fn``.
      step: your accumulated ``(params, batch, *rest) -> (loss, grads)``; default
        ``jaxaccum.value_and_grad(loss_fn, **options)``.
      **options: the accumulation options (:class:`jaxaccum.Options`); ``mesh`` also says
        which devices form the data axes when counting reductions. With ``step`` no count
        is needed (your step splits the batch itself).

    Returns:
      A :class:`CheckReport`; ``report.problems`` says what is wrong and what to do.

    Examples:
      >>> import jax.numpy as jnp, jaxaccum
      >>> def loss(w, x):
      ...     return jnp.mean((x @ w - 1.0) ** 2)
      >>> w, x = jnp.ones(3) / 2, jnp.arange(24.0).reshape(8, 3) / 10
      >>> jaxaccum.check(loss, w, x, num_microbatches=4).ok
      True
      >>> bad = jaxaccum.value_and_grad(lambda w, x: 4 * loss(w, x), num_microbatches=4)
      >>> print(jaxaccum.check(loss, w, x, step=bad, num_microbatches=4).problems[0][:40])
      the gradient is 4 times the full batch's
    """
    counts = ("num_microbatches", "microbatch_size", "max_microbatches")
    if step is not None and not any(options.get(c) is not None for c in counts):
        options = {**options, "num_microbatches": 1}  # your step splits the batch itself
    opts = _options.parse("jaxaccum.check", options)
    if step is None:
        step = _value_and_grad.value_and_grad(loss_fn, **options)
    jitted = jax.jit(step)
    with _placement.mesh_context(opts):
        got = jitted(params, batch, *rest)
        hlo = jitted.lower(params, batch, *rest).compile().as_text() or ""
    full32 = jax.jit(jax.value_and_grad(loss_fn))(*jax.device_get((params, batch, *rest)))
    with jax.enable_x64(True):
        ref = jax.jit(jax.value_and_grad(loss_fn))(*_float64(jax.device_get((params, batch,
                                                                              *rest))))
        ref64 = jax.tree.map(lambda a: np.asarray(a, np.float64), ref)
    error, full_error = _rel(got, ref64), _rel(full32, ref64)
    bound = FACTOR * full_error + FLOOR * EPS32
    scale = _scale(got[1], ref64[1])
    grad_error = _rel(got[1], ref64[1])
    rescaled = grad_error if scale == 0 else _rel(
        jax.tree.map(lambda g: np.asarray(g, np.float64) / scale, got[1]), ref64[1])
    groups = _data_groups(opts)
    red = _hlo.gradient_reductions(hlo, groups) if groups else {"total": 0, "in loops": 0}
    problems = _explain(error, bound, scale, grad_error > bound >= rescaled, red, opts)
    return CheckReport(not problems, problems, error, full_error, bound, scale, red["total"],
                       red["in loops"])


def _explain(error: float, bound: float, scale: float, scaled: bool, red: dict[str, int],
             opts: _options.Options) -> list[str]:
    """The problems, in plain words (``scaled``: the gradient is wrong, and right once divided
    by ``scale``)."""
    problems = []
    if error > bound:
        if scaled:
            problems.append(
                f"the gradient is {scale:.6g} times the full batch's (a mean taken as a sum, or a "
                "division by k done twice or not at all): divide once by the total weight")
        else:
            problems.append(
                f"the loss and gradient differ from the full batch's by {error:.3g} (relative; "
                f"float32 rounding allows {bound:.3g}): the step does not compute the full-batch "
                "gradient. If the loss couples the examples of a batch (in-batch negatives, "
                "batch statistics, normalisation by the batch's token count), accumulate it "
                "with jaxaccum.coupled_value_and_grad or jaxaccum.statistics_first; if the "
                "optimizer sees one micro-batch's gradient, sum all of them first")
    dp = opts.data_parallel
    if red["in loops"] and not (dp is not None and dp.fsdp == "microbatch"):
        problems.append(
            f"{red['in loops']} gradient-sized reduction(s) over the data axes run inside a "
            "loop, once per micro-batch (k times the traffic of one per step): accumulate "
            "per-device partial sums and reduce once after the loop (jaxaccum.value_and_grad "
            "with mesh=jaxaccum.DataParallel(...) does)")
    return problems

