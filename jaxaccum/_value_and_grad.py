"""The public :func:`value_and_grad`: ``jax.value_and_grad`` over k micro-batches."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Unpack

from jaxaccum import _arguments, _options, _pipeline
from jaxaccum._arguments import Accumulation
from jaxaccum._options import OptionsDict
from jaxaccum._records import Result, step_info

ENTRY = "jaxaccum.value_and_grad"


def shape_value(acc: Accumulation, res: Result, with_carry: bool = True) -> Any:
    """The value as ``jax.value_and_grad`` shapes it: the loss, or ``(loss, aux)``; with
    carried arguments (and ``with_carry``) ``(that, carried)``."""
    value = res.loss if acc.options.aux_spec is None else (res.loss, res.aux)
    if acc.carry and with_carry:
        return value, carried_value(acc, res.carry)
    return value


def check_return_info(entry: str, options: _options.Options, return_info: Any) -> None:
    """``return_info`` is a bool; ``noise_scale`` is reported only in the info, so it needs it
    (never computed and dropped)."""
    _options.check_bool(entry, "return_info", return_info)
    if options.noise_scale and not return_info:
        raise TypeError(
            f"{entry}: noise_scale=True is reported in the jaxaccum.StepInfo that a "
            "value_and_grad returns with return_info=True; build it with return_info=True and "
            "read value, grads, info = ...; info.noise_scale"
        )


def shape_result(acc: Accumulation, res: Result, return_info: bool,
                 with_carry: bool = True) -> tuple[Any, ...]:
    """What every ``value_and_grad`` returns: ``(value, grads)``, with ``return_info``
    ``(value, grads, info)``, ``info`` a :class:`jaxaccum.StepInfo`; the gradient divided
    here, once."""
    value = shape_value(acc, res, with_carry)
    grads = res.mean_grads()
    if not return_info:
        return value, grads
    carry = carried_value(acc, res.carry) if acc.carry and with_carry else ()
    return value, grads, step_info(res, carry)


def carried_value(acc: Accumulation, carry: tuple[Any, ...]) -> Any:
    """The carried values as the caller gave ``carry_argnums``: one value for one position."""
    return carry if len(acc.carry) > 1 else carry[0]


def value_and_grad(
    fun: Callable[..., Any],
    *,
    argnums: int | tuple[int, ...] = 0,
    batch_argnums: int | tuple[int, ...] = 1,
    carry_argnums: int | tuple[int, ...] = (),
    return_info: bool = False,
    **options: Unpack[OptionsDict],
) -> Callable[..., tuple[Any, ...]]:
    """Like ``jax.value_and_grad``, but the batch is processed as k micro-batches in one scan.

    The arguments named by ``batch_argnums`` (pytrees whose leaves share a leading batch axis)
    are split into k micro-batches of equal size, **strided**: micro-batch i holds examples
    i, i + k, i + 2k, ... (so a batch sharded over devices is split where it lies). ``fun`` and
    its gradient are evaluated on each inside one ``jax.lax.scan``; losses and gradients are
    summed in ``accumulator_dtype`` and divided once. Live activations scale like ``1/k``; no
    parameter-sized state persists between calls. With ``k == 1`` no scan is emitted.

    ``fun(*args, **kwargs)`` returns the **mean** loss over the examples it is given; then the
    result equals ``jax.value_and_grad(fun, argnums, has_aux)(*args, **kwargs)`` on the full
    batch, up to float rounding. Keyword arguments are passed whole to every micro-batch:
    neither split nor differentiated. An Equinox module passed as a differentiated argument is
    filtered as ``eqx.filter_value_and_grad`` does (its inexact arrays are differentiated, the
    rest passed through; the gradient holds None there).

    Args:
      fun: the loss function.
      argnums: which positional arguments to differentiate, as in ``jax.grad``.
      batch_argnums: which positional arguments carry the batch (split into micro-batches).
      carry_argnums: positions of arguments threaded through the micro-batches, micro-batch
        i + 1 seeing the value micro-batch i returned, as k sequential calls would (BatchNorm
        statistics, RNG counters). ``fun`` then returns ``(output, new_value)`` (a tuple of
        new values, in the order of ``carry_argnums``, for several), each with the structure,
        shapes and dtypes it came in with. With ``skip_nonfinite`` a skipped micro-batch's
        update is dropped. On a mesh its axes must be Explicit.
      return_info: also return a :class:`jaxaccum.StepInfo` (the skipped count, the total
        weight, the micro-batches evaluated, the noise scale, ...), as the steps do.
      **options: the accumulation options, each documented once in
        :class:`jaxaccum.Options`; every one is taken (``noise_scale`` needs
        ``return_info=True``: its estimate comes back in ``info.noise_scale``).

    Returns:
      A function with the signature of ``fun`` returning ``(value, grads)``: ``value`` is the
      loss, or ``(loss, aux)`` with ``has_aux``; with ``carry_argnums`` ``(that, carried)``.
      With ``return_info=True`` ``(value, grads, info)``. No other option changes this shape.

    Raises:
      TypeError: an unknown option (the message says what replaced a removed one), a count
        that is not an int, ``fun``'s output of the wrong structure, an NNX module or a
        ``TrainState`` as a differentiated argument (the message names the front end to use).
      TypeError: ``noise_scale=True`` without ``return_info=True`` (the estimate lives in
        the info).
      ValueError: both or neither count, a count < 1; at trace time, k not dividing the batch
        size (per device on a mesh), batch leaves of different leading sizes, a loss or weight
        that is not a scalar.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxaccum
      >>> def loss(w, batch, scale=1.0):
      ...     x, y = batch
      ...     return scale * jnp.mean((x @ w - y) ** 2)
      >>> x = jnp.arange(24.0).reshape(8, 3) / 10
      >>> y = jnp.ones(8)
      >>> w = jnp.array([0.1, -0.2, 0.3])
      >>> full = jax.value_and_grad(loss)(w, (x, y), scale=2.0)
      >>> micro = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=4))(w, (x, y), scale=2.0)
      >>> bool(jnp.allclose(full[0], micro[0])), bool(jnp.allclose(full[1], micro[1]))
      (True, True)
    """
    acc = _arguments.make(
        ENTRY, fun, _options.parse(ENTRY, options), argnums=argnums,
        batch_argnums=batch_argnums, carry_argnums=carry_argnums,
    )
    check_return_info(ENTRY, acc.options, return_info)

    @functools.wraps(fun)
    def accumulated(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        bound = acc.bind(args, kwargs)
        return shape_result(bound, _pipeline.run(bound, args), return_info)

    return accumulated
