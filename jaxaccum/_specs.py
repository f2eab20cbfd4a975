"""PartitionSpec algebra over a mesh's data axes: what part of a leaf's sharding jaxaccum
handles (the data axes) and what it leaves to the partitioner (every other axis)."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def names(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one spec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def entry(axes: tuple[str, ...]) -> Any:
    """One spec entry for ``axes``: None, a name, or a tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def padded(spec: P, ndim: int) -> list[Any]:
    """The spec's entries, one per array dimension."""
    return list(spec)[:ndim] + [None] * max(0, ndim - len(spec))


def without(spec: P, ndim: int, axes: tuple[str, ...]) -> P:
    """``spec`` with ``axes`` removed (what a leaf gathered over them is sharded over)."""
    return P(*(entry(tuple(n for n in names(e) if n not in axes)) for e in padded(spec, ndim)))


def only(spec: P, ndim: int, axes: tuple[str, ...]) -> P:
    """Only ``axes`` of ``spec`` (a ``shard_map`` in_spec manual over them)."""
    return P(*(entry(tuple(n for n in names(e) if n in axes)) for e in padded(spec, ndim)))


def uses(spec: P, ndim: int, axes: tuple[str, ...]) -> bool:
    """Whether ``spec`` shards any dimension over one of ``axes``."""
    return any(n in axes for e in padded(spec, ndim) for n in names(e))


def leading(axes: tuple[str, ...], ndim: int, stacked: bool = False) -> P:
    """The batch's spec: the leading axis split over ``axes`` (for a stack of micro-batches
    ``(K, m, ...)``, the micro-batch axis ``m``)."""
    if stacked:
        return P(None, entry(axes), *([None] * (ndim - 2)))
    return P(entry(axes), *([None] * (ndim - 1)))


def of(x: Any, mesh: jax.sharding.Mesh, hint: Any = None) -> P:
    """The leaf's PartitionSpec on ``mesh``, from ``hint`` or what the leaf carries; else P()."""
    sharding = hint
    if sharding is None and isinstance(x, jax.core.Tracer):
        sharding = getattr(jax.typeof(x), "sharding", None)
    elif sharding is None:
        sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh.shape == mesh.shape:
        return sharding.spec
    return P()
