"""Auto axes: the pipeline runs inside a ``jax.shard_map`` manual over the data axes only;
each device scans its own share of the batch, and the sums are reduced once, after the scan
(``psum``; ``psum_scatter`` for a parameter sharded over a data axis, FSDP)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum import _context, _reductions, _specs
from jaxaccum._arguments import Accumulation
from jaxaccum._placement import base
from jaxaccum._placement._mesh import DataAxes, gather, gather_inside, is_spec
from jaxaccum._records import Result, Shapes, Sums


@dataclasses.dataclass(frozen=True)
class AutoMesh(DataAxes):
    """Auto axes: a ``shard_map`` manual over the data axes; one reduction after the scan.

    Every collective over the data axes (the gather of an FSDP parameter, the reduction of
    its gradient) runs in a nested ``shard_map`` manual over the leaf's other axes too: in a
    region where those axes are Auto, XLA would replicate the operand over them (a tensor-
    parallel kernel gathered whole on every device).

    Attributes:
      hints: the shardings of the positional arguments read before tracing (a tree per
        argument, ``NamedSharding`` or None leaves), for tracers that carry none.
    """

    hints: Any = None

    def wrap(self, per_device: base.PerDevice) -> base.Placed:
        def placed(acc: Accumulation, args: tuple[Any, ...], k: int, count: Any) -> Result:
            refuse(self, acc, args)
            args = tuple(jax.tree.map(jnp.asarray, a) for a in args)
            if self.devices == 1 and not self.dp.explicit:
                # one data device splits nothing: no shard_map (inside one over axes of size 1,
                # XLA cannot partition the collectives of a shard_map the loss makes itself)
                return per_device(acc, args, k, count, base.ONE_DEVICE)
            if self.dp.explicit:  # the coupled losses' forward pass: the batch where it splits
                args = tuple(jax.tree.map(lambda x: self.reshard(
                    x, _specs.leading(self.axes, x.ndim, acc.stacked)), a) if i in acc.split
                    else a for i, a in enumerate(args))
            specs = arg_specs(self, acc, args)
            layout: dict[str, Any] = {}  # the aux's structure, read while tracing

            def body(n: Any, *local: Any) -> tuple[Any, ...]:
                local_args, ops = self.enter(acc, local, specs)
                with _context.data_axes(self.axes):  # (told to the ops in the loss)
                    res = per_device(acc, local_args, k, n, ops)
                return (res.loss, res.grads, aux_out(acc, res, layout), res.weight,
                        res.skipped, res.noise)

            in_specs = jax.tree.map(lambda x, s: _specs.only(s, jnp.ndim(x), self.axes), args,
                                    specs)
            loss, grads, aux, weight, skipped, noise = jax.shard_map(
                body, mesh=self.dp.mesh, in_specs=(P(), *in_specs),
                out_specs=(P(), acc.differentiated(in_specs), P(_specs.entry(self.axes)), P(),
                           P(), P()),
                axis_names=set(self.axes), check_vma=False,
            )(count, *args)
            return Result(loss, grads, aux_in(self, aux, layout), weight, skipped,
                          self.devices * (k if count is None else count),
                          carry=tuple(acc.carried(args)), noise=noise,  # (carried: empty)
                          like=acc.differentiated(args),
                          may_be_empty=acc.options.divides_safely)

        return placed

    def enter(self, acc: Accumulation, args: tuple[Any, ...], specs: tuple[Any, ...]) -> tuple[
            tuple[Any, ...], base.LeafOps]:
        """Inside the ``shard_map``: the arguments with what the loop needs gathered over the
        data axes, and the leaf ops: per-device accumulators as on one device, the reduction
        over the data axes after the loop."""
        args = tuple(  # other arguments sharded over the data axes are gathered whole
            a if i in acc.split or i in acc.diff
            else jax.tree.map(self.gather, a, specs[i], is_leaf=is_spec)
            for i, a in enumerate(args)
        )
        diff = acc.differentiated(specs)

        def gather_diff(tree: Any) -> Any:
            return jax.tree.map(self.gather, tree, diff, is_leaf=is_spec)

        ops = functools.partial(
            base.LeafOps, zeros=_reductions.zeros_accumulator, add=base.add, finite=base.finite,
            reduce=functools.partial(self.reduce, specs=diff), loops=self.devices)
        if self.dp.fsdp == "microbatch":  # autodiff reduce-scatters each micro-batch's gradient
            return args, ops(fun=gather_inside(acc, gather_diff), pin_in_loop=True)
        return acc.replace_differentiated(args, gather_diff(acc.differentiated(args))), ops()

    def manual_over_rest(self, f: Callable[[jax.Array], jax.Array], x: jax.Array,
                         spec: P) -> jax.Array:
        """``f(x)``, a collective over the data axes, seeing the device's block of the other
        axes that shard ``x`` (a nested ``shard_map`` manual over them)."""
        rest = self.without_data(spec, x.ndim)
        axes = {n for e in rest for n in _specs.names(e)}
        if not axes:
            return f(x)
        return jax.shard_map(f, in_specs=rest, out_specs=rest, axis_names=axes,  # type: ignore[no-any-return]
                             check_vma=False)(x)

    def gather(self, x: jax.Array, spec: P) -> jax.Array:
        """``x`` all-gathered over the data axes that ``spec`` shards it over."""
        data = _specs.only(spec, x.ndim, self.axes)
        return self.manual_over_rest(functools.partial(gather, spec=data), x, spec)

    def reduce(self, sums: Sums, out: Shapes, specs: Any) -> Sums:
        """The per-device sums reduced over the data axes, once per step."""
        # "microbatch": autodiff already reduce-scattered over the axes the leaf is split on
        reduce = self.psum_rest if self.dp.fsdp == "microbatch" else self.reduce_local

        def one(g: jax.Array, spec: P) -> jax.Array:
            data = _specs.only(spec, g.ndim, self.axes)
            return self.manual_over_rest(functools.partial(reduce, spec=data), g, spec)

        grads = jax.tree.map(one, sums.grads, specs, is_leaf=is_spec)
        loss, weight, skipped, sq_norms = jax.lax.psum(
            (sums.loss, sums.weight, sums.skipped, sums.sq_norms), self.axes)
        aux = [a if r.stacked else r.combine(a, self.axes)
               for r, a in zip(out.aux_plan, sums.aux or [], strict=True)]
        return Sums(loss, grads, weight, skipped, sums.carry, aux or sums.aux, sq_norms)


def refuse(mesh: AutoMesh, acc: Accumulation, args: tuple[Any, ...]) -> None:
    """The options an Auto mesh cannot honour, refused before tracing."""
    if any(jax.tree.leaves(args[i]) for i in acc.carry):  # (an empty state is no state)
        what = acc.state_name or f"carry_argnums={acc.carry}"
        raise ValueError(
            f"{acc.entry}: {what} with a mesh whose data axes "
            f"{mesh.axes} are Auto: each device would see only its share of every "
            "micro-batch, so carried state (BatchNorm statistics) would differ from the "
            "single-device run; use a mesh with Explicit axes (jax.make_mesh's default)"
        )


def arg_specs(mesh: AutoMesh, acc: Accumulation, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Every argument leaf's spec: the batch split over the data axes; every other leaf
    as it is sharded (or as its hint says)."""
    out = []
    for i, a in enumerate(args):
        if i in acc.split:
            out.append(jax.tree.map(
                lambda x: _specs.leading(mesh.axes, jnp.ndim(x), acc.stacked), a))
        elif mesh.hints is None or mesh.hints[i] is None:
            out.append(jax.tree.map(lambda x: _specs.of(x, mesh.dp.mesh), a))
        else:
            out.append(jax.tree.map(
                lambda h, x: _specs.of(x, mesh.dp.mesh, h), mesh.hints[i], a,
                is_leaf=lambda h: h is None or isinstance(h, NamedSharding)))
    return tuple(out)


def aux_out(acc: Accumulation, res: Result, layout: dict[str, Any]) -> list[jax.Array]:
    """Inside the ``shard_map``: the aux leaves as the devices' shares to join on axis 0
    (``layout`` records how, for :func:`aux_in`)."""
    layout["tree"] = jax.tree.structure(res.aux)
    layout["stacked"] = [r.stacked for r in res.aux_plan]
    # a stack's concat leaves are (K, m): the devices' shares join along m
    layout["swap"] = [acc.stacked and r.per_example for r in res.aux_plan]
    return [jnp.swapaxes(x, 0, 1) if swap else x if stacked else jnp.expand_dims(x, 0)
            for stacked, swap, x in zip(layout["stacked"], layout["swap"],
                                        jax.tree.leaves(res.aux), strict=True)]


def aux_in(mesh: AutoMesh, aux: list[jax.Array], layout: dict[str, Any]) -> Any:
    """Outside the ``shard_map``: the aux as one device would have it (a reduced leaf is
    the same on every device: the first device's copy)."""
    leaves = [jnp.swapaxes(x, 0, 1) if swap else x if stacked else first(mesh, x)
              for stacked, swap, x in zip(layout["stacked"], layout["swap"], aux,
                                          strict=True)]
    return jax.tree.unflatten(layout["tree"], leaves)


def first(mesh: AutoMesh, x: jax.Array) -> jax.Array:
    """The first device's copy of a value every device holds (one per device on axis 0);
    on Explicit axes (a forward pass of the coupled losses) replicated first."""
    if mesh.dp.explicit:
        x = mesh.reshard(x, P())
    return x[0]
