"""Gradient sinks: an op that adds its parameter's gradient straight into the accumulator.

Inside the micro-batch loop, the pipeline differentiates the loss with respect to the
parameters and to their accumulators ("taps"), and registers each parameter with its tap while
the loss is traced. An op that knows how (``linear_cross_entropy``) looks its weight up with
:func:`tap_for`; given a tap, it returns the tap plus its gradient as the tap's cotangent
(summed in the accumulator's dtype, written in place chunk by chunk) and no gradient for the
weight itself. No gradient of the parameter's own size and dtype exists, so it is never rounded
to a bfloat16 parameter's dtype before it is summed, and no second weight-sized buffer is needed.

The lookup is by identity: the parameter must reach the op as the pipeline passed it (indexed
out of its pytree, not cast or transposed); anything else takes the ordinary gradient.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax

_active = threading.local()


class Taps:
    """The parameters of one traced micro-batch, their taps, and which taps were used."""

    def __init__(self, params: Sequence[Any], taps: Sequence[Any]) -> None:
        self.by_id = {id(p): (i, t) for i, (p, t) in enumerate(zip(params, taps, strict=True))}
        self.params = list(params)  # (kept alive: the ids stay theirs while tracing)
        self.used: set[int] = set()


@contextlib.contextmanager
def tapping(taps: Taps) -> Iterator[Taps]:
    """Registers ``taps`` for the loss traced inside the ``with``."""
    stack = getattr(_active, "stack", None) or []
    _active.stack = [*stack, taps]
    try:
        yield taps
    finally:
        _active.stack = stack


def tap_for(param: Any) -> jax.Array | None:
    """The accumulator to add ``param``'s gradient into, or None (no micro-batch loop is being
    traced, or ``param`` is not one of its parameters as passed)."""
    stack = getattr(_active, "stack", None)
    if not stack:
        return None
    found = stack[-1].by_id.get(id(param))
    if found is None or found[0] in stack[-1].used:
        return None  # (a second use takes the ordinary gradient: each tap is added once)
    stack[-1].used.add(found[0])
    return found[1]  # type: ignore[no-any-return]
