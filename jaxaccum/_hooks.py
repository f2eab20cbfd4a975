"""The placement interface: the hooks :mod:`jaxaccum._pipeline` calls, declared once.

A placement decides where the pipeline runs (one device, an Auto mesh, an Explicit mesh);
:mod:`jaxaccum._placement` holds the three implementations. The pipeline imports only this
protocol, so neither module imports the other for its types.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from jaxaccum._arguments import Accumulation
from jaxaccum._records import Result, Shapes, Sums


class Placement(Protocol):
    """Where the pipeline runs, as the hooks it calls in order: ``local_batch_size`` and
    ``run`` (per call), ``enter`` (the parameters enter the loop), ``zeros`` (accumulators),
    ``add`` and ``finite`` (per micro-batch), ``reduce`` (once, after the loop) and
    ``count`` (the micro-batches evaluated over all devices).

    Attributes:
      devices: the data-parallel devices the batch is split over (1 without a mesh).
    """

    @property
    def devices(self) -> int: ...

    def local_batch_size(self, acc: Accumulation, batch_size: int) -> int:
        """The batch size one device sees (refusing one the devices do not divide)."""
        ...

    def count(self, k: int) -> int:
        """The micro-batches one call evaluates, summed over devices."""
        ...

    def run(self, acc: Accumulation, args: tuple[Any, ...], k: int,
            count: Any = None) -> Result:
        """The pipeline placed here (``count``: the traced number of real micro-batches)."""
        ...

    def enter(self, acc: Accumulation, args: tuple[Any, ...]) -> tuple[
            Accumulation, tuple[Any, ...], Placement]:
        """Where the parameters enter the loop: ``(acc, args, placement)``."""
        ...

    def zeros(self, diff: Any, dtype: Any) -> Any:
        """The gradient accumulator, shaped like the differentiated arguments."""
        ...

    def add(self, acc: jax.Array, g: jax.Array, w: jax.Array | None) -> jax.Array:
        """``acc + w * g`` (``w`` None: every weight 1)."""
        ...

    def finite(self, loss: jax.Array, grads: Any) -> tuple[jax.Array, Any]:
        """Whether a micro-batch's loss and gradient are finite, and the gradient to add."""
        ...

    def reduce(self, acc: Accumulation, sums: Sums, out: Shapes) -> Sums:
        """The sums reduced over the data axes, once per step."""
        ...
