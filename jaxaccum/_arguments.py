"""Which arguments of the user's function are differentiated, split or carried, and what it
returns: the :class:`Accumulation` every pipeline stage reads."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from jaxaccum import _options, _pytrees, _validation


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """One accumulated function: ``fun``, how its arguments are used, and the options.

    Attributes:
      fun: the loss function (for carried arguments it returns ``(output, new_carry)``).
      entry: the public entry point the user called, for error messages.
      argnums: as given (an int or a tuple), so gradients come back shaped like ``jax.grad``'s.
      diff: the differentiated positions, as a tuple.
      split: the positions of the batch arguments, split into micro-batches.
      carry: the positions threaded through the micro-batches.
      options: the shared :class:`jaxaccum.Options`.
      state_name: how messages name the carried arguments, for a front end that carries
        state of its own (NNX: ``"the module's state"``); None: by ``carry_argnums``.
      takes_weights: the entry point takes ``weighted=True`` (the coupled losses do not),
        so messages may suggest it.
      state_rule: said before a carried value that came back with another structure, shape
        or dtype (what the front end's loss function must do); None: nothing.
    """

    fun: Callable[..., Any]
    entry: str
    argnums: int | tuple[int, ...]
    diff: tuple[int, ...]
    split: tuple[int, ...]
    carry: tuple[int, ...]
    options: _options.Options
    state_name: str | None = None
    state_rule: str | None = None
    takes_weights: bool = True

    @property
    def stacked(self) -> bool:
        """The batch arguments are stacks ``(K, m, ...)`` of micro-batches
        (``max_microbatches``): micro-batch ``i`` is ``data[i]``, read where it lies."""
        return self.options.max_microbatches is not None

    @property
    def microbatch_axis(self) -> int:
        """The axis of the micro-batch index in :func:`jaxaccum._pipeline.split`'s views."""
        return 0 if self.stacked else 1

    def differentiated(self, args: tuple[Any, ...]) -> Any:
        """The differentiated arguments, shaped as ``jax.grad`` returns their gradients."""
        if isinstance(self.argnums, int):
            return args[self.argnums]
        return tuple(args[i] for i in self.diff)

    def replace_differentiated(self, args: tuple[Any, ...], new: Any) -> tuple[Any, ...]:
        """``args`` with the differentiated arguments replaced by ``new``."""
        values = (new,) if isinstance(self.argnums, int) else new
        return replace(args, self.diff, values)

    def carried(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The carried arguments, as a tuple."""
        return tuple(args[i] for i in self.carry)

    def with_carry(self, args: tuple[Any, ...], carry: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` with the carried arguments replaced by ``carry``."""
        return replace(args, self.carry, carry)

    def batch(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The batch arguments, as a tuple."""
        return tuple(args[i] for i in self.split)

    def with_batch(self, args: tuple[Any, ...], batch: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` with the batch arguments replaced by ``batch`` (one micro-batch)."""
        return replace(args, self.split, batch)

    def carried_name(self, i: int) -> str:
        """How messages name carried argument ``i``."""
        return self.state_name or f"carry_argnums: argument {i}"

    def with_fun(self, fun: Callable[..., Any]) -> Accumulation:
        """The same accumulation of another function, for what wraps ``fun`` per call
        (keyword arguments bound, an Equinox module's static part put back); placements wrap
        it through :attr:`LeafOps.fun` instead."""
        return dataclasses.replace(self, fun=fun)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Accumulation:
        """Checks a call's positional count; binds keyword arguments (passed whole to every
        micro-batch: never split, never differentiated, as in ``jax.value_and_grad``)."""
        needed = max(self.diff + self.split + self.carry) + 1
        if len(args) < needed:
            raise TypeError(
                f"{self.entry}: argnums={self.argnums!r}, batch_argnums={self.split!r} need at "
                f"least {needed} positional arguments; got {len(args)} (keyword arguments are "
                "passed whole to every micro-batch: pass the batch positionally)"
            )
        if not kwargs:
            return self
        return self.with_fun(functools.partial(self.fun, **kwargs))


def filtered(acc: Accumulation, args: tuple[Any, ...]) -> tuple[Accumulation, tuple[Any, ...]]:
    """Differentiated arguments that are Equinox modules (or hold leaves that are no arrays)
    are split as ``eqx.partition(tree, eqx.is_inexact_array)``: the inexact arrays are
    differentiated, everything else is passed through; their gradients hold None there, as
    with ``eqx.filter_value_and_grad``."""
    trees = [args[i] for i in acc.diff]
    for i, tree in zip(acc.diff, trees, strict=True):
        _pytrees.check_parameters(acc.entry, tree, f"argument {i} (differentiated)")
    if not any(map(_pytrees.needs_filter, trees)):
        return acc, args
    parts = [_pytrees.partition(t) for t in trees]
    fun = acc.fun

    def with_static(*a: Any) -> Any:
        whole = [_pytrees.combine(a[i], static) for i, (_, static) in zip(acc.diff, parts,
                                                                          strict=True)]
        return fun(*replace(a, acc.diff, whole))

    return acc.with_fun(with_static), replace(args, acc.diff, [p for p, _ in parts])


def replace(args: tuple[Any, ...], at: tuple[int, ...], values: Any) -> tuple[Any, ...]:
    """``args`` with the positions ``at`` replaced by ``values``."""
    replaced = list(args)
    for i, value in zip(at, values, strict=True):
        replaced[i] = value
    return tuple(replaced)


def _described(value: Any) -> str:
    """A value a loss function returned, as a user would name it (no tracer reprs)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def split_output(acc: Accumulation, out: Any) -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """``fun``'s output as ``(loss, weight, aux, new_carry)``, its structure checked."""
    out, new_carry = _split_carry(acc, out)
    weighted, has_aux = acc.options.weighted, acc.options.aux_spec is not None
    expected = {
        (False, False): "loss",
        (True, False): "(loss, aux)",
        (False, True): "(loss, weight)",
        (True, True): "((loss, weight), aux)",
    }[has_aux, weighted]

    def pair(value: Any, what: str) -> tuple[Any, Any]:
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise TypeError(
                f"{acc.entry}: the loss function must return {expected} (has_aux="
                f"{acc.options.has_aux!r}, weighted={weighted}); {what} is "
                f"{_described(value)}. Return {expected}, or set has_aux and weighted "
                "to what it returns"
            )
        return value[0], value[1]

    aux = weight = None
    if has_aux:
        out, aux = pair(out, "its output")
    if weighted:
        out, weight = pair(out, "its output" if not has_aux else "its loss part")
    return out, weight, aux, new_carry


def _split_carry(acc: Accumulation, out: Any) -> tuple[Any, tuple[Any, ...]]:
    if not acc.carry:
        return out, ()
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            f"{acc.entry}: with carry_argnums={acc.carry}, the loss function must return "
            f"(output, new_carry); got {type(out).__name__}: {out!r}"
        )
    new = out[1] if len(acc.carry) > 1 else (out[1],)
    if not (isinstance(new, (tuple, list)) and len(new) == len(acc.carry)):
        got = type(out[1]).__name__
        if isinstance(out[1], (tuple, list)):
            got += f" of {len(out[1])}"
        raise TypeError(
            f"{acc.entry}: with carry_argnums={acc.carry}, new_carry must be a tuple of "
            f"{len(acc.carry)} values, one per carried argument; got {got}"
        )
    return out[0], tuple(new)


def make(
    entry: str,
    fun: Callable[..., Any],
    options: _options.Options,
    *,
    argnums: int | tuple[int, ...] = 0,
    batch_argnums: int | tuple[int, ...] = 1,
    carry_argnums: int | tuple[int, ...] = (),
    state_name: str | None = None,
    state_rule: str | None = None,
    takes_weights: bool = True,
) -> Accumulation:
    """Checks the argument positions and fixes them, with ``fun`` and ``options`` (and how
    messages name carried state: see :class:`Accumulation`)."""
    if not callable(fun):
        raise TypeError(f"{entry}: the loss function must be callable; got {type(fun).__name__}")
    diff = _validation.argnums_tuple(argnums, f"{entry}: argnums")
    split = _validation.argnums_tuple(batch_argnums, f"{entry}: batch_argnums")
    if set(diff) & set(split):
        raise ValueError(
            f"{entry}: argnums={argnums!r} and batch_argnums={batch_argnums!r} overlap; the "
            "batch is split and cannot be differentiated as a whole"
        )
    carry = () if carry_argnums == () else _validation.argnums_tuple(
        carry_argnums, f"{entry}: carry_argnums"
    )
    clash = set(carry) & (set(diff) | set(split))
    if clash:
        raise ValueError(
            f"{entry}: carry_argnums={carry_argnums!r} overlaps argnums={argnums!r} or "
            f"batch_argnums={batch_argnums!r} at {sorted(clash)}: a carried argument is "
            "threaded through the micro-batches, neither differentiated nor split"
        )
    return Accumulation(
        fun=fun,
        entry=entry,
        argnums=argnums if isinstance(argnums, int) else diff,
        diff=diff,
        split=split,
        carry=carry,
        options=options,
        state_name=state_name,
        state_rule=state_rule,
        takes_weights=takes_weights,
    )
