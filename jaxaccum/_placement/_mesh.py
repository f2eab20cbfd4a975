"""What Auto and Explicit meshes share: the data axes, the batch's division over them, and
the collectives over them (run inside a ``shard_map`` manual over the data axes)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum import _options, _specs
from jaxaccum._arguments import Accumulation
from jaxaccum._placement.base import as_it_is

is_spec = lambda s: isinstance(s, P)  # noqa: E731


@dataclasses.dataclass(frozen=True)
class DataAxes:
    """A mesh's data axes (``DataParallel``), which split the batch.

    Attributes:
      dp: the ``DataParallel`` option.
    """

    dp: _options.DataParallel

    @property
    def axes(self) -> tuple[str, ...]:
        return self.dp.axes

    @property
    def devices(self) -> int:
        return math.prod(self.dp.mesh.shape[a] for a in self.axes)

    def local_batch_size(self, acc: Accumulation, batch_size: int) -> int:
        if batch_size % self.devices:
            raise ValueError(
                f"{acc.entry}: the batch size {batch_size} is not divisible by the "
                f"{self.devices} devices of the data axes {self.axes}; the batch's leading axis "
                "is split over them (give a multiple of the device count)"
            )
        return batch_size // self.devices

    def reshard(self, x: Any, spec: P) -> Any:
        return jax.reshard(x, NamedSharding(self.dp.mesh, spec))

    def without_data(self, spec: P, ndim: int) -> P:
        return _specs.without(spec, ndim, self.axes)

    def per_microbatch(self, spec: P, ndim: int) -> bool:
        """Whether a leaf is gathered in every micro-batch (ZeRO-3)."""
        return self.dp.fsdp == "microbatch" and _specs.uses(spec, ndim, self.axes)

    def reduce_local(self, g: jax.Array, spec: P) -> jax.Array:
        """Inside a ``shard_map`` manual over the data axes: a per-device partial gradient
        summed over them, each dimension the (data-part) ``spec`` shards reduce-scattered."""
        for dim, e in enumerate(spec):
            if e is not None:  # tiled: each device keeps its block, as the parameter is split
                g = jax.lax.psum_scatter(g, e, scatter_dimension=dim, tiled=True)
        return self.psum_rest(g, spec)

    def psum_rest(self, g: jax.Array, spec: P) -> jax.Array:
        """``psum`` over the data axes that do not shard the leaf (the others are scattered)."""
        rest = tuple(a for a in self.axes if all(a not in _specs.names(e) for e in spec))
        return jax.lax.psum(g, rest) if rest else g


def gather(x: jax.Array, spec: P) -> jax.Array:
    """Inside a ``shard_map`` manual over the data axes: ``x`` all-gathered over the data axes
    that ``spec`` (its data part, one entry per dimension) shards it over."""
    for dim, e in enumerate(spec):
        if e is not None:
            x = jax.lax.all_gather(x, e, axis=dim, tiled=True)
    return x


def gather_inside(acc: Accumulation, gather_tree: Callable[[Any], Any],
                  then: Callable[[Callable[..., Any]], Callable[..., Any]] = as_it_is,
                  ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A :attr:`LeafOps.fun` whose function gathers the differentiated arguments itself, in
    every micro-batch (ZeRO-3; with ``pin_in_loop``, so that XLA does not hoist the gather
    out of the loop), and is ``then(fun)`` otherwise."""

    def wrap(fun: Callable[..., Any]) -> Callable[..., Any]:
        inner = then(fun)

        def gathered(*args: Any) -> Any:
            return inner(*acc.replace_differentiated(args, gather_tree(acc.differentiated(args))))

        return gathered

    return wrap
