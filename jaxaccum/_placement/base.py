"""The placement interface, the per-leaf operations it hands the pipeline, and one device.

A placement decides where the pipeline runs. It has three members: how many devices split
the batch, the batch size one device sees, and ``wrap``, which places a per-device function
(the pipeline) and hands it a :class:`LeafOps` record. A placement never calls the pipeline
back, and nothing here imports it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax

from jaxaccum import _reductions
from jaxaccum._arguments import Accumulation
from jaxaccum._records import Result, Shapes, Sums


def as_it_is(fun: Callable[..., Any]) -> Callable[..., Any]:
    """The loss function as it is: what one device and most placements run."""
    return fun


class LeafOps(NamedTuple):
    """What differs per leaf between placements, built whole for one call.

    Attributes:
      zeros: ``zeros(diff, dtype)``: the gradient accumulator, shaped like the
        differentiated arguments.
      add: ``add(acc, g, w)``: ``acc + w * g`` (``w`` None: every weight 1).
      finite: ``finite(loss, grads)``: whether a micro-batch's loss and gradient are finite
        (for ``skip_nonfinite``), and the gradient to add.
      reduce: ``reduce(sums, out)``: the sums reduced over the data axes, once per step.
      loops: how many copies of the micro-batch loop the reduced sums add up (one per device
        inside an Auto mesh's ``shard_map``, else 1).
      fun: ``fun(f)``: the loss function ``f`` as the placement runs it (wrapped to gather a
        ZeRO-3 parameter in every micro-batch, or to meet reduced types; else ``f``).
      pin_in_loop: tie the differentiated arguments to the loop carry, so that work on them
        inside the wrapped ``fun`` (a per-micro-batch all-gather, ZeRO-3) is not hoisted out
        of the loop.
    """

    zeros: Callable[[Any, Any], Any]
    add: Callable[[jax.Array, jax.Array, jax.Array | None], jax.Array]
    finite: Callable[[jax.Array, Any], tuple[jax.Array, Any]]
    reduce: Callable[[Sums, Shapes], Sums]
    loops: int = 1
    fun: Callable[[Callable[..., Any]], Callable[..., Any]] = as_it_is
    pin_in_loop: bool = False


class PerDevice(Protocol):
    """The pipeline on the arguments one placement sees (``count``: the traced number of real
    micro-batches, ``max_microbatches``, or None for all ``k``)."""

    def __call__(self, acc: Accumulation, args: tuple[Any, ...], k: int, count: Any,
                 ops: LeafOps) -> Result: ...


Placed = Callable[[Accumulation, tuple[Any, ...], int, Any], Result]


class Placement(Protocol):
    """Where the pipeline runs.

    Attributes:
      devices: the data-parallel devices the batch is split over (1 without a mesh).
    """

    @property
    def devices(self) -> int: ...

    def local_batch_size(self, acc: Accumulation, batch_size: int) -> int:
        """The batch size one device sees (refusing one the devices do not divide)."""
        ...

    def wrap(self, per_device: PerDevice) -> Placed:
        """``per_device`` placed here: ``placed(acc, args, k, count) -> Result``."""
        ...


def add(acc: jax.Array, g: jax.Array, w: jax.Array | None) -> jax.Array:
    """``acc + w * g`` in the accumulator's dtype (``w`` None: every weight 1)."""
    if w is None:
        return (acc + g).astype(acc.dtype)
    return _reductions.weighted_add(acc, g, w)


def finite(loss: jax.Array, grads: Any) -> tuple[jax.Array, Any]:
    """Whether a micro-batch's loss and gradient are finite (a boolean scalar), and the
    gradient to add (unchanged: a weight of 0 masks it)."""
    return _reductions.all_finite((loss, grads)), grads


def unreduced(sums: Sums, out: Shapes) -> Sums:
    """Nothing to reduce: the sums of one program over the whole batch."""
    return sums


ONE_DEVICE = LeafOps(zeros=_reductions.zeros_accumulator, add=add, finite=finite,
                     reduce=unreduced)


class OneDevice:
    """No mesh: the pipeline as it is."""

    devices = 1

    def local_batch_size(self, acc: Accumulation, batch_size: int) -> int:
        return batch_size

    def wrap(self, per_device: PerDevice) -> Placed:
        return functools.partial(per_device, ops=ONE_DEVICE)  # (no frame of its own)
