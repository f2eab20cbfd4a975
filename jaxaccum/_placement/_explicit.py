"""Explicit axes (sharding in types, JAX's "Autodiff and sharding"): each parameter is cast to
``reduced`` over the data axes, so every micro-batch's gradient is ``unreduced`` (per-device
partial sums), added without communication, and reduced once after the scan."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxaccum import _reductions, _specs
from jaxaccum._arguments import Accumulation
from jaxaccum._placement import base
from jaxaccum._placement._mesh import DataAxes, gather_inside
from jaxaccum._records import Result, Shapes, Sums
from jaxaccum._xla import reduced as _reduced


class Cast(NamedTuple):
    """Which differentiated leaves are cast to ``reduced``.

    Attributes:
      leaves: ``"all"``, ``"kernels"`` (ndim >= 2) or ``"none"`` (their gradients are then
        reduced by the partitioner in every micro-batch).
      resolve: re-evaluate ``fun`` so that reduced parameters meet batch-sharded activations
        (:func:`jaxaccum._xla.reduced.reduced_compatible`).
    """

    leaves: str
    resolve: bool


# JAX (0.10) refuses a reduced operand in some ops (see _reduced): the casts tried, in order,
# from one reduction per step for every leaf to the partitioner's reduction per micro-batch.
# Each trial traces the whole pipeline, backward pass included; the first JAX accepts is used.
CASTS = (Cast("all", False), Cast("all", True), Cast("kernels", False), Cast("none", False))


class LeafPlan(NamedTuple):
    """How an Explicit mesh treats one differentiated leaf.

    Attributes:
      spec: the leaf's ``PartitionSpec`` on the mesh.
      per_microbatch: gathered in every micro-batch (``fsdp="microbatch"``, ZeRO-3).
      reduced: cast to ``reduced`` over the data axes (its gradients then come out
        ``unreduced`` and are summed without communication until the one reduction).
    """

    spec: P
    per_microbatch: bool
    reduced: bool


def _is_leaf_plan(t: Any) -> bool:
    return isinstance(t, LeafPlan)


@dataclasses.dataclass(frozen=True)
class ExplicitMesh(DataAxes):
    """Explicit axes: reduced parameters, unreduced gradients, one reduction after the scan."""

    def wrap(self, per_device: base.PerDevice) -> base.Placed:
        def placed(acc: Accumulation, args: tuple[Any, ...], k: int, count: Any) -> Result:
            self.refuse(acc)
            for n, cast in enumerate(CASTS):
                try:
                    return per_device(*self.enter(acc, args, cast, k, count))
                except Exception as error:
                    if not _reduced.jax_refuses_reduced(error) or n == len(CASTS) - 1:
                        raise
            raise AssertionError("unreachable")

        return placed

    def refuse(self, acc: Accumulation) -> None:
        """A mesh not in context (the options it cannot honour are refused when they are
        built: :class:`jaxaccum.Options`)."""
        current = jax.sharding.get_abstract_mesh()
        if current.empty or current.shape_tuple != self.dp.mesh.abstract_mesh.shape_tuple:
            raise ValueError(
                f"{acc.entry}: the mesh's data axes {self.axes} are Explicit: call it inside `with "
                "jax.set_mesh(mesh):` (JAX's explicit-sharding mode needs the mesh in "
                f"context); the mesh in context is {current}"
            )

    def enter(self, acc: Accumulation, args: tuple[Any, ...], cast: Cast, k: int,
              count: Any) -> tuple[Accumulation, tuple[Any, ...], int, Any, base.LeafOps]:
        """The pipeline's arguments with ``cast`` applied: the batch split over the data
        axes, the parameters cast (or gathered in the loop, ZeRO-3), and the leaf ops."""
        args = tuple(
            jax.tree.map(lambda x: self.reshard(
                jnp.asarray(x), _specs.leading(self.axes, jnp.ndim(x), acc.stacked)), a)
            if i in acc.split else a
            for i, a in enumerate(args)
        )
        diff = jax.tree.map(jnp.asarray, acc.differentiated(args))

        def describe(x: jax.Array) -> LeafPlan:
            spec = _specs.of(x, self.dp.mesh)
            return LeafPlan(spec, self.per_microbatch(spec, x.ndim), cast.leaves == "all" or (
                cast.leaves == "kernels" and x.ndim >= 2))

        leaves = jax.tree.map(describe, diff)

        def to_type(x: jax.Array, leaf: LeafPlan) -> jax.Array:
            axes = set(self.axes) if leaf.reduced else set()
            return self.reshard(x, P(*self.without_data(leaf.spec, x.ndim), reduced=axes))

        outside = jax.tree.map(lambda x, t: x if t.per_microbatch else to_type(x, t), diff,
                               leaves, is_leaf=_is_leaf_plan)
        # the loss function re-evaluated so that reduced parameters meet batch-sharded
        # activations (cast.resolve), and gathering a ZeRO-3 parameter in every micro-batch
        fun: Callable[[Callable[..., Any]], Callable[..., Any]] = (
            _reduced.reduced_compatible if cast.resolve else base.as_it_is)
        zero3 = any(t.per_microbatch for t in jax.tree.leaves(leaves, is_leaf=_is_leaf_plan))
        if zero3:
            fun = gather_inside(acc, lambda tree: jax.tree.map(
                lambda x, t: to_type(x, t) if t.per_microbatch else x, tree, leaves,
                is_leaf=_is_leaf_plan), then=fun)
        ops = base.LeafOps(zeros=functools.partial(self.zeros, leaves=leaves), add=add,
                           finite=functools.partial(finite, tuple(self.dp.mesh.axis_names)),
                           reduce=functools.partial(self.reduce, leaves=leaves), fun=fun,
                           pin_in_loop=zero3)
        return acc, acc.replace_differentiated(args, outside), k, count, ops

    def zeros(self, diff: Any, dtype: Any, leaves: Any) -> Any:
        """The accumulators: unreduced over the data axes where the parameter is reduced."""
        def zero(x: jax.Array, leaf: LeafPlan) -> jax.Array:
            spec, per_microbatch, reduced = leaf
            z = jnp.zeros(x.shape, _reductions.accumulator_dtype_for(x.dtype, dtype))
            if per_microbatch:
                return self.reshard(z, spec)
            unreduced = set(self.axes) if reduced else set()
            return self.reshard(z, P(*self.without_data(spec, x.ndim), unreduced=unreduced))

        return jax.tree.map(zero, diff, leaves, is_leaf=_is_leaf_plan)

    def reduce(self, sums: Sums, out: Shapes, leaves: Any) -> Sums:
        """The accumulated gradients reduced once; every other sum is a global value."""
        grads = jax.tree.map(self.reduce_once, sums.grads, leaves, is_leaf=_is_leaf_plan)
        return sums._replace(grads=grads)

    def reduce_once(self, g: jax.Array, leaf: LeafPlan) -> Any:
        """The step's one reduction of an accumulated gradient, to the leaf's own sharding.

        A reshard from unreduced does it, but XLA lowers a reshard to a data-sharded (FSDP)
        spec as an all-reduce and a slice; a ``psum_scatter`` in a ``shard_map`` manual over
        the data axes is a reduce-scatter (1/n of the traffic per device)."""
        spec, per_microbatch, reduced = leaf
        entries = _specs.padded(spec, g.ndim)
        if (per_microbatch or not reduced or not _specs.uses(spec, g.ndim, self.axes)
                or not all(data_minor(e, self.axes) for e in entries)):
            return self.reshard(g, spec)  # (a data axis before another one: an all-reduce)
        # unreduced in_specs need a shard_map manual over every axis; only the data axes
        # are reduced in it, each device's block of the other axes stays where it is
        out = jax.shard_map(
            functools.partial(self.reduce_local, spec=_specs.only(spec, g.ndim, self.axes)),
            in_specs=P(*self.without_data(spec, g.ndim), unreduced=set(self.axes)),
            out_specs=P(*entries),
        )(g)
        return self.reshard(out, spec)


def add(acc: jax.Array, g: jax.Array, w: jax.Array | None) -> jax.Array:
    """An unreduced gradient admits only linear operations, so the weighted add (a
    weight-0 micro-batch adds nothing, not even the NaN of a 0/0 loss) runs on each
    device's partial sum in a ``shard_map``: no communication, the same rule as on one
    device (the weight is the same on every device)."""
    spec = jax.typeof(g).sharding.spec
    if not spec.unreduced:
        return base.add(acc, g, w)
    if w is None:
        return (acc + g).astype(acc.dtype)
    return jax.shard_map(  # type: ignore[no-any-return]
        _reductions.weighted_add, in_specs=(jax.typeof(acc).sharding.spec, spec, P()),
        out_specs=jax.typeof(acc).sharding.spec, check_vma=False)(acc, g, w)


def data_minor(e: Any, axes: tuple[str, ...]) -> bool:
    """Whether the data axes of a spec entry come after all its other axes."""
    data = [n in axes for n in _specs.names(e)]
    return data == sorted(data)


def finite(axis_names: tuple[str, ...], loss: jax.Array, grads: Any) -> tuple[jax.Array, Any]:
    """An unreduced gradient cannot be tested as it is (the test is not linear), and
    reducing it would cost a gradient all-reduce per micro-batch. Its sum is finite when
    every partial sum is (up to an overflow of the sum itself), so each device tests its
    own partials in a ``shard_map`` and only a scalar flag is reduced. The partials are
    added as they are: :func:`add`'s weight of 0 adds nothing of them, not even a NaN."""
    leaves = jax.tree.leaves(grads)
    partial = [g for g in leaves if jax.typeof(g).sharding.spec.unreduced]
    if not partial:
        return base.finite(loss, grads)
    plain = [g for g in leaves if not jax.typeof(g).sharding.spec.unreduced]

    def local(*gs: jax.Array) -> jax.Array:
        return jax.lax.pmax(  # any device's partial non-finite: every device skips
            jnp.logical_not(_reductions.all_finite(gs)).astype(jnp.int32), axis_names)

    bad = jax.shard_map(local, in_specs=tuple(jax.typeof(g).sharding.spec for g in partial),
                        out_specs=P(), check_vma=False)(*partial)
    return jnp.logical_and(bad == 0, _reductions.all_finite((loss, plain))), grads
