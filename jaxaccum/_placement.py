"""Where the pipeline runs: one device, an Auto mesh or an Explicit mesh.

A placement supplies the few hooks :mod:`jaxaccum._pipeline` calls; it never assembles the
scan itself. jaxaccum handles only the mesh's *data* axes; every other axis (tensor parallel
``model``, ...) stays with the partitioner, so parameters keep their shardings and a model's
own collectives are untouched.

- :class:`OneDevice`: the hooks are the identity.
- :class:`AutoMesh` (Auto axes): the pipeline runs inside a ``jax.shard_map`` manual over the
  data axes only; each device scans its own share of the batch, and the sums are reduced after
  the scan (``psum``; ``psum_scatter`` for a parameter sharded over a data axis, FSDP).
- :class:`ExplicitMesh` (Explicit axes, sharding in types, JAX's "Autodiff and sharding"):
  each parameter is cast to ``reduced`` over the data axes, so every micro-batch's gradient is
  ``unreduced``, added without communication, and reduced once after the scan.

``fsdp="step"`` gathers a data-sharded parameter once per step; ``"microbatch"`` gathers it in
every micro-batch, and its gradient is reduce-scattered every micro-batch (ZeRO-3).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum import _options, _pipeline, _reduced, _reductions, _specs
from jaxaccum._arguments import Accumulation
from jaxaccum._hooks import Placement
from jaxaccum._records import Result, Shapes, Sums

_is_spec = lambda s: isinstance(s, P)  # noqa: E731


class OneDevice:
    """No mesh: the pipeline as it is."""

    devices = 1

    def local_batch_size(self, acc: Accumulation, batch_size: int) -> int:
        return batch_size

    def count(self, k: int) -> int:
        """The micro-batches one call evaluates, summed over devices."""
        return k

    def run(
        self, acc: Accumulation, args: tuple[Any, ...], k: int, count: Any = None
    ) -> Result:
        """The pipeline placed here (``count``: the traced number of real micro-batches)."""
        return _pipeline.per_device(acc, args, k, self, count)

    def enter(self, acc: Accumulation, args: tuple[Any, ...]) -> tuple[
            Accumulation, tuple[Any, ...], Placement]:
        """Where the parameters enter the loop: returns ``(acc, args, placement)``."""
        return acc, args, self

    def zeros(self, diff: Any, dtype: Any) -> Any:
        """The gradient accumulator, shaped like the differentiated arguments."""
        return _reductions.zeros_accumulator(diff, dtype)

    def add(self, acc: jax.Array, g: jax.Array, w: jax.Array | None) -> jax.Array:
        """``acc + w * g`` (``w`` None: every weight 1)."""
        if w is None:
            return (acc + g).astype(acc.dtype)
        return _reductions.weighted_add(acc, g, w)

    def finite(self, loss: jax.Array, grads: Any) -> tuple[jax.Array, Any]:
        """For ``skip_nonfinite``: whether a micro-batch's loss and gradient are finite (a
        boolean scalar), and the gradient to add (zeroed where it cannot be masked later)."""
        return _reductions.all_finite((loss, grads)), grads

    def reduce(self, acc: Accumulation, sums: Sums, out: Shapes) -> Sums:
        """The sums reduced over the data axes (nothing to do on one device)."""
        return sums


@dataclasses.dataclass(frozen=True)
class _Mesh(OneDevice):
    """What Auto and Explicit meshes share: the data axes and the batch's division."""

    dp: _options.DataParallel

    @property
    def axes(self) -> tuple[str, ...]:
        return self.dp.axes

    @property
    def devices(self) -> int:  # type: ignore[override]
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
            if e is not None:
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


def gather_inside(acc: Accumulation, gather_tree: Any) -> Accumulation:
    """``acc`` whose ``fun`` gathers the differentiated arguments itself, in every micro-batch,
    pinned in the loop so that XLA does not hoist the gather out of it (ZeRO-3)."""
    fun = acc.fun

    def gathered(*args: Any) -> Any:
        return fun(*acc.replace_differentiated(args, gather_tree(acc.differentiated(args))))

    return acc.with_fun(gathered, pin_in_loop=True)


@dataclasses.dataclass(frozen=True)
class AutoMesh(_Mesh):
    """Auto axes: a ``shard_map`` manual over the data axes; one reduction after the scan.

    Every collective over the data axes (the gather of an FSDP parameter, the reduction of
    its gradient) runs in a nested ``shard_map`` manual over the leaf's other axes too: in a
    region where those axes are Auto, XLA would replicate the operand over them (a tensor-
    parallel kernel gathered whole on every device).

    Attributes:
      hints: the shardings of the positional arguments read before tracing (a tree per
        argument, ``NamedSharding`` or None leaves), for tracers that carry none.
      specs: set by :meth:`run`: every argument leaf's whole spec (the batch: split over the
        data axes).
    """

    hints: Any = None
    specs: Any = None

    def count(self, k: int) -> int:
        return k * self.devices

    def arg_specs(self, acc: Accumulation, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Every argument leaf's spec: the batch split over the data axes; every other leaf
        as it is sharded (or as its hint says)."""
        out = []
        for i, a in enumerate(args):
            if i in acc.split:
                out.append(jax.tree.map(
                    lambda x: _specs.leading(self.axes, jnp.ndim(x), acc.stacked), a))
            elif self.hints is None or self.hints[i] is None:
                out.append(jax.tree.map(lambda x: _specs.of(x, self.dp.mesh), a))
            else:
                out.append(jax.tree.map(
                    lambda h, x: _specs.of(x, self.dp.mesh, h), self.hints[i], a,
                    is_leaf=lambda h: h is None or isinstance(h, NamedSharding)))
        return tuple(out)

    def data_specs(self, tree: Any, specs: Any) -> Any:
        """The data part of each spec (a ``shard_map`` in_spec manual over the data axes)."""
        return jax.tree.map(lambda x, s: _specs.only(s, jnp.ndim(x), self.axes), tree, specs)

    def run(
        self, acc: Accumulation, args: tuple[Any, ...], k: int, count: Any = None
    ) -> Result:
        if any(jax.tree.leaves(args[i]) for i in acc.carry):  # (an empty state is no state)
            what = ("the module's state other than the differentiated variables"
                    if acc.entry.startswith("jaxaccum.nnx.") else f"carry_argnums={acc.carry}")
            raise ValueError(
                f"{acc.entry}: {what} with a mesh whose data axes "
                f"{self.axes} are Auto: each device would see only its share of every "
                "micro-batch, so carried state (BatchNorm statistics) would differ from the "
                "single-device run; use a mesh with Explicit axes (jax.make_mesh's default)"
            )
        if acc.options.noise_scale and self.dp.fsdp == "microbatch":
            raise ValueError(
                f"{acc.entry}: noise_scale=True with fsdp='microbatch': each micro-batch's "
                "gradient is reduce-scattered over the devices at once, so no device holds its "
                "own micro-batch gradient to measure; use fsdp='step'"
            )
        args = tuple(jax.tree.map(jnp.asarray, a) for a in args)
        if self.dp.explicit:  # the coupled losses' forward pass: put the batch where it splits
            args = tuple(jax.tree.map(lambda x: self.reshard(
                x, _specs.leading(self.axes, x.ndim, acc.stacked)), a) if i in acc.split else a
                for i, a in enumerate(args))
        placement = dataclasses.replace(self, specs=self.arg_specs(acc, args))
        in_specs = self.data_specs(args, placement.specs)
        static: dict[str, Any] = {}  # the aux's structure, read while tracing

        def body(n: Any, *local_args: Any) -> tuple[Any, ...]:
            res = _pipeline.per_device(acc, local_args, k, placement, n)
            leaves = jax.tree.leaves(res.aux)
            static["tree"] = jax.tree.structure(res.aux)
            plan = res.aux_plan
            static["stacked"] = [r.stacked for r in plan]
            # a stack's concat leaves are (K, m): the devices' shares join along m
            static["swap"] = [acc.stacked and r is _reductions.AUX_REDUCTIONS["concat"]
                              for r in plan]
            aux = [jnp.swapaxes(x, 0, 1) if swap else x if stacked else jnp.expand_dims(x, 0)
                   for stacked, swap, x in zip(static["stacked"], static["swap"], leaves,
                                               strict=True)]
            return res.loss, res.grads, aux, res.weight, res.skipped, res.noise

        loss, grads, aux, weight, skipped, noise = jax.shard_map(
            body,
            mesh=self.dp.mesh,
            in_specs=(P(), *in_specs),
            out_specs=(P(), acc.differentiated(in_specs), P(_specs.entry(self.axes)), P(), P(),
                       P()),
            axis_names=set(self.axes),
            check_vma=False,
        )(count, *args)
        aux = [jnp.swapaxes(x, 0, 1) if swap else x if stacked else self.first(x)
               for stacked, swap, x in zip(static["stacked"], static["swap"], aux, strict=True)]
        return Result(loss, grads, jax.tree.unflatten(static["tree"], aux), weight, skipped,
                      self.count(k) if count is None else self.count(1) * count,
                      carry=tuple(acc.carried(args)), noise=noise)  # (carried: empty, as given)

    def first(self, x: jax.Array) -> jax.Array:
        """The first device's copy of a value every device holds (one per device on axis 0);
        on Explicit axes (a forward pass of the coupled losses) replicated first."""
        if self.dp.explicit:
            x = self.reshard(x, P())
        return x[0]

    def manual_over_rest(self, f: Any, x: jax.Array, spec: P) -> jax.Array:
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

    def enter(self, acc: Accumulation, args: tuple[Any, ...]) -> tuple[
            Accumulation, tuple[Any, ...], Placement]:
        args = tuple(  # other arguments sharded over the data axes are gathered whole
            a if i in acc.split or i in acc.diff
            else jax.tree.map(self.gather, a, self.specs[i], is_leaf=_is_spec)
            for i, a in enumerate(args)
        )
        specs = acc.differentiated(self.specs)

        def gather_diff(tree: Any) -> Any:
            return jax.tree.map(self.gather, tree, specs, is_leaf=_is_spec)

        if self.dp.fsdp == "microbatch":  # autodiff reduce-scatters each micro-batch's gradient
            return gather_inside(acc, gather_diff), args, self
        return acc, acc.replace_differentiated(args, gather_diff(acc.differentiated(args))), self

    def reduce(self, acc: Accumulation, sums: Sums, out: Shapes) -> Sums:
        # "microbatch": autodiff already reduce-scattered over the axes the leaf is split on
        reduce = self.psum_rest if self.dp.fsdp == "microbatch" else self.reduce_local

        def one(g: jax.Array, spec: P) -> jax.Array:
            data = _specs.only(spec, g.ndim, self.axes)
            return self.manual_over_rest(functools.partial(reduce, spec=data), g, spec)

        grads = jax.tree.map(one, sums.grads, acc.differentiated(self.specs), is_leaf=_is_spec)
        loss, weight, skipped, sq_norms = jax.lax.psum(
            (sums.loss, sums.weight, sums.skipped, sums.sq_norms), self.axes)
        aux = [a if r.stacked else r.combine(a, self.axes)
               for r, a in zip(out.aux_plan, sums.aux or [], strict=True)]
        return Sums(loss, grads, weight, skipped, sums.carry, aux or sums.aux, sq_norms)


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
class ExplicitMesh(_Mesh):
    """Explicit axes: reduced parameters, unreduced gradients, one reduction after the scan.

    Attributes:
      cast: which differentiated leaves are cast to ``reduced``: ``"all"``, ``"kernels"``
        (ndim >= 2) or ``"none"`` (their gradients are then reduced by the partitioner in
        every micro-batch).
      resolve: re-evaluate ``fun`` so that reduced parameters meet batch-sharded activations
        (:func:`jaxaccum._reduced.reduced_compatible`).
      leaves: set by :meth:`enter`: a :class:`LeafPlan` per differentiated leaf.
    """

    cast: str = "all"
    resolve: bool = False
    leaves: Any = None

    # JAX refuses some reduced types (see _reduced): the choices tried, in order. Each trial
    # traces the whole pipeline, backward pass included.
    CHOICES = (("all", False), ("all", True), ("kernels", False), ("none", False))

    def run(
        self, acc: Accumulation, args: tuple[Any, ...], k: int, count: Any = None
    ) -> Result:
        if acc.options.noise_scale:
            raise ValueError(
                f"{acc.entry}: noise_scale=True is not available on a mesh whose data axes "
                f"{self.axes} are Explicit (each device's micro-batch gradient is an unreduced "
                "partial sum there); use Auto axes (jax.make_mesh(..., axis_types=(AxisType."
                "Auto, ...))) or one device"
            )
        current = jax.sharding.get_abstract_mesh()
        if current.empty or current.shape_tuple != self.dp.mesh.abstract_mesh.shape_tuple:
            raise ValueError(
                f"{acc.entry}: the mesh has Explicit axes {self.axes}: call it inside `with "
                "jax.set_mesh(mesh):` (JAX's explicit-sharding mode needs the mesh in "
                f"context); the mesh in context is {current}"
            )
        choices = self.CHOICES
        for n, (cast, resolve) in enumerate(choices):
            placement = dataclasses.replace(self, cast=cast, resolve=resolve)
            try:
                return _pipeline.per_device(acc, args, k, placement, count)
            except Exception as error:
                if not _reduced.jax_refuses_reduced(error) or n == len(choices) - 1:
                    raise
        raise AssertionError("unreachable")

    def enter(self, acc: Accumulation, args: tuple[Any, ...]) -> tuple[
            Accumulation, tuple[Any, ...], Placement]:
        args = tuple(
            jax.tree.map(lambda x: self.reshard(
                jnp.asarray(x), _specs.leading(self.axes, jnp.ndim(x), acc.stacked)), a)
            if i in acc.split else a
            for i, a in enumerate(args)
        )
        diff = jax.tree.map(jnp.asarray, acc.differentiated(args))

        def describe(x: jax.Array) -> LeafPlan:
            spec = _specs.of(x, self.dp.mesh)
            return LeafPlan(spec, self.per_microbatch(spec, x.ndim), self.cast == "all" or (
                self.cast == "kernels" and x.ndim >= 2))

        leaves = jax.tree.map(describe, diff)
        is_leaf = _is_leaf_plan

        def cast(x: jax.Array, leaf: LeafPlan) -> jax.Array:
            axes = set(self.axes) if leaf.reduced else set()
            return self.reshard(x, P(*self.without_data(leaf.spec, x.ndim), reduced=axes))

        outside = jax.tree.map(lambda x, t: x if t.per_microbatch else cast(x, t), diff, leaves,
                               is_leaf=is_leaf)
        if self.resolve:
            acc = acc.with_fun(_reduced.reduced_compatible(acc.fun))
        if any(t.per_microbatch for t in jax.tree.leaves(leaves, is_leaf=is_leaf)):
            acc = gather_inside(acc, lambda tree: jax.tree.map(
                lambda x, t: cast(x, t) if t.per_microbatch else x, tree, leaves,
                is_leaf=is_leaf))
        placement = dataclasses.replace(self, leaves=leaves)
        return acc, acc.replace_differentiated(args, outside), placement

    def zeros(self, diff: Any, dtype: Any) -> Any:
        def zero(x: jax.Array, leaf: LeafPlan) -> jax.Array:
            spec, per_microbatch, reduced = leaf
            z = jnp.zeros(x.shape, _reductions.accumulator_dtype_for(x.dtype, dtype))
            if per_microbatch:
                return self.reshard(z, spec)
            unreduced = set(self.axes) if reduced else set()
            return self.reshard(z, P(*self.without_data(spec, x.ndim), unreduced=unreduced))

        return jax.tree.map(zero, diff, self.leaves, is_leaf=_is_leaf_plan)

    def add(self, acc: jax.Array, g: jax.Array, w: jax.Array | None) -> jax.Array:
        """An unreduced gradient admits only linear operations, so the weighted add (a
        weight-0 micro-batch adds nothing, not even the NaN of a 0/0 loss) runs on each
        device's partial sum in a ``shard_map``: no communication, the same rule as on one
        device (the weight is the same on every device)."""
        spec = jax.typeof(g).sharding.spec
        if not spec.unreduced:
            return super().add(acc, g, w)
        if w is None:
            return (acc + g).astype(acc.dtype)
        return jax.shard_map(  # type: ignore[no-any-return]
            _reductions.weighted_add, in_specs=(jax.typeof(acc).sharding.spec, spec, P()),
            out_specs=jax.typeof(acc).sharding.spec, check_vma=False)(acc, g, w)

    def reduce(self, acc: Accumulation, sums: Sums, out: Shapes) -> Sums:
        grads = jax.tree.map(self.reduce_once, sums.grads, self.leaves, is_leaf=_is_leaf_plan)
        return sums._replace(grads=grads)

    def reduce_once(self, g: jax.Array, leaf: LeafPlan) -> Any:
        """The step's one reduction of an accumulated gradient, to the leaf's own sharding.

        A reshard from unreduced does it, but XLA lowers a reshard to a data-sharded (FSDP)
        spec as an all-reduce and a slice; a ``psum_scatter`` in a ``shard_map`` manual over
        the data axes is a reduce-scatter (1/n of the traffic per device)."""
        spec, per_microbatch, reduced = leaf
        entries = _specs.padded(spec, g.ndim)
        if (per_microbatch or not reduced or not _specs.uses(spec, g.ndim, self.axes)
                or not all(map(self.data_minor, entries))):
            return self.reshard(g, spec)  # (a data axis before another one: an all-reduce)
        # unreduced in_specs need a shard_map manual over every axis; only the data axes
        # are reduced in it, each device's block of the other axes stays where it is
        out = jax.shard_map(
            functools.partial(self.reduce_local, spec=_specs.only(spec, g.ndim, self.axes)),
            in_specs=P(*self.without_data(spec, g.ndim), unreduced=set(self.axes)),
            out_specs=P(*entries),
        )(g)
        return self.reshard(out, spec)

    def data_minor(self, e: Any) -> bool:
        """Whether the data axes of a spec entry come after all its other axes."""
        data = [n in self.axes for n in _specs.names(e)]
        return data == sorted(data)

    def finite(self, loss: jax.Array, grads: Any) -> tuple[jax.Array, Any]:
        """An unreduced gradient cannot be tested as it is (the test is not linear), and
        reducing it would cost a gradient all-reduce per micro-batch. Its sum is finite when
        every partial sum is (up to an overflow of the sum itself), so each device tests its
        own partials in a ``shard_map`` and only a scalar flag is reduced; the partials of a
        non-finite micro-batch are zeroed there (``0 * NaN`` would not vanish)."""
        leaves, tree = jax.tree.flatten(grads)
        partial = [i for i, g in enumerate(leaves) if jax.typeof(g).sharding.spec.unreduced]
        if not partial:
            return super().finite(loss, grads)
        plain = [g for i, g in enumerate(leaves) if i not in partial]
        specs = tuple(jax.typeof(leaves[i]).sharding.spec for i in partial)
        names = tuple(self.dp.mesh.axis_names)

        def local(*gs: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
            bad = jax.lax.pmax(jnp.logical_not(_reductions.all_finite(gs)).astype(jnp.int32),
                               names)
            return bad, tuple(jnp.where(bad > 0, jnp.zeros_like(g), g) for g in gs)

        bad, masked = jax.shard_map(local, in_specs=specs, out_specs=(P(), specs),
                                    check_vma=False)(*(leaves[i] for i in partial))
        for i, g in zip(partial, masked, strict=True):
            leaves[i] = g
        finite = jnp.logical_and(bad == 0, _reductions.all_finite((loss, plain)))
        return finite, jax.tree.unflatten(tree, leaves)


def placement_for(options: _options.Options, hints: Any = None) -> Placement:
    """The placement of ``options.mesh``; ``hints`` are argument shardings read before tracing
    (Auto meshes), else those of ``DataParallel.param_shardings``, bound per call."""
    dp = options.data_parallel
    if dp is None:
        return OneDevice()
    if dp.explicit:
        return ExplicitMesh(dp)
    return AutoMesh(dp, hints=hints)


def param_hints(
    entry: str, dp: _options.DataParallel, args: tuple[Any, ...], argnums: int | tuple[int, ...]
) -> tuple[Any, ...] | None:
    """``DataParallel.param_shardings`` as per-argument hints (a ``PartitionSpec`` leaf is
    taken on the mesh), or None."""
    shardings = dp.param_shardings
    if shardings is None:
        return None
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    trees = (shardings,) if isinstance(argnums, int) else tuple(shardings)
    if len(trees) != len(nums):
        raise ValueError(
            f"{entry}: DataParallel.param_shardings must hold one tree per differentiated "
            f"argument (argnums={argnums}); got {len(trees)}"
        )
    is_leaf = lambda s: isinstance(s, (P, NamedSharding))  # noqa: E731
    hints: list[Any] = [None] * len(args)
    for i, tree in zip(nums, trees, strict=True):
        try:
            hints[i] = jax.tree.map(
                lambda s, _: s if isinstance(s, NamedSharding) else NamedSharding(dp.mesh, s),
                tree, args[i], is_leaf=is_leaf)
        except (ValueError, TypeError) as error:
            raise TypeError(
                f"{entry}: DataParallel.param_shardings for argument {i} must be a tree of "
                f"PartitionSpec or NamedSharding shaped like the argument "
                f"{jax.tree.structure(args[i])}; got {jax.tree.structure(tree, is_leaf=is_leaf)}"
            ) from error
    return tuple(hints)
