"""The data axes: where the batch is split, where gradients are reduced (once per step).

jaxaccum handles only the mesh's *data* axes; every other axis (tensor parallel ``model``, ...)
stays with the partitioner, so a model's own collectives are untouched. Two mechanisms, chosen
by the mesh's axis types (both measured in ``benchmarks/sharded.py``):

- **Explicit axes** (``jax.make_mesh``'s default): sharding-in-types, as in JAX's "Autodiff and
  sharding" page. Each differentiated leaf is cast to ``reduced`` over the data axes (free for a
  leaf replicated over them; one all-gather per step for an FSDP leaf sharded over them), so
  every micro-batch's gradient comes out ``unreduced``: per-device partial sums that the scan
  adds without communication. After the scan one reshard to the leaf's own sharding performs
  the step's only gradient reduction: an all-reduce, or for an FSDP leaf a ``psum_scatter``
  in a ``shard_map`` over the data axes (XLA lowers a reshard to a data-sharded spec as an
  all-reduce and a slice; the shard_map gives a reduce-scatter).
  Models written for Explicit axes (``out_sharding=``) work unchanged. JAX rejects an
  elementwise op between a reduced parameter and a batch-sharded activation (a bias add, a
  LayerNorm scale); :func:`reduced_compatible` re-evaluates the model so that the parameter is
  resharded like the activation there (free, and its gradient stays unreduced). That works at
  the model's top level and in nested ``jit``s; inside the model's own loops (a ``lax.scan``
  over layers) such parameters fall back to the partitioner's reduction per micro-batch.
- **Auto axes**: a ``jax.shard_map`` that is manual over the data axes only
  (``axis_names=``); each device scans its own share of the batch, and the sums are reduced
  after the scan with one ``psum`` (``psum_scatter`` for FSDP leaves). Parameter shardings are
  read from the arrays passed in (under your own ``jit`` an Auto-mode tracer carries none: the
  leaf is then taken as replicated over the data axes, which is correct but gathers FSDP
  leaves; :func:`jaxaccum.train_step` reads the shardings before it traces).

``fsdp="step"`` (default) gathers each data-sharded parameter once per step (transient full
parameter and gradient per device); ``fsdp="microbatch"`` gathers it inside each micro-batch
and reduce-scatters each micro-batch's gradient into a sharded accumulator (ZeRO-3: less
memory, k times the traffic).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum import _accumulate, _jaxpr, _reductions, _validation

FSDP_MODES = ("step", "microbatch")


def data_axes(
    mesh: jax.sharding.Mesh | None, data_axis: str | tuple[str, ...] | None
) -> tuple[str, ...] | None:
    """Checks the data-parallel arguments; returns the data axes as a tuple (None: no mesh)."""
    if mesh is None:
        if data_axis is not None:
            raise ValueError(f"data_axis={data_axis!r} was given without a mesh")
        return None
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    if data_axis is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(
                f"data_axis must name the batch axis of a mesh with several axes; mesh axes are "
                f"{mesh.axis_names}"
            )
        return tuple(mesh.axis_names)
    axes = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing or not axes:
        raise ValueError(
            f"data_axis={data_axis!r} is not an axis of the mesh; mesh axes are {mesh.axis_names}"
        )
    return axes


def _names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(names: tuple[str, ...]) -> Any:
    return None if not names else names[0] if len(names) == 1 else names


def padded(spec: P, ndim: int) -> list[Any]:
    """The spec's entries, one per array dimension."""
    return list(spec)[:ndim] + [None] * max(0, ndim - len(spec))


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """A mesh and its data axes: how the batch is split and the gradients reduced.

    Attributes:
      mesh: the device mesh.
      axes: the data axes (the batch's leading axis is split over them, in this order).
      fsdp: ``"step"`` or ``"microbatch"``: when data-sharded parameters are gathered.
      hints: the shardings of the arguments as read before tracing (one tree per positional
        argument; a leaf is a ``NamedSharding`` or None), for Auto-axis meshes whose tracers
        carry none. Set by :class:`jaxaccum._train_step.TrainStep`.
    """

    mesh: jax.sharding.Mesh
    axes: tuple[str, ...]
    fsdp: str = "step"
    hints: Any = None

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    @property
    def explicit(self) -> bool:
        types = dict(zip(self.mesh.axis_names, self.mesh.axis_types, strict=True))
        return all(types[a] == jax.sharding.AxisType.Explicit for a in self.axes)

    def with_param_shardings(
        self, shardings: Any, args: tuple[Any, ...], argnums: int | tuple[int, ...]
    ) -> DataParallel:
        """This mesh with ``hints`` for the differentiated arguments (value_and_grad's
        ``param_shardings``); a ``PartitionSpec`` leaf is taken on this mesh."""
        if shardings is None:
            return self
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        trees = (shardings,) if isinstance(argnums, int) else tuple(shardings)
        if len(trees) != len(nums):
            raise ValueError(
                f"param_shardings must hold one tree per differentiated argument (argnums="
                f"{argnums}); got {len(trees)}"
            )
        is_leaf = lambda s: isinstance(s, (P, NamedSharding))  # noqa: E731
        hints: list[Any] = [None] * len(args)
        for i, tree in zip(nums, trees, strict=True):
            try:
                hints[i] = jax.tree.map(
                    lambda s, _: s if isinstance(s, NamedSharding) else NamedSharding(self.mesh, s),
                    tree, args[i], is_leaf=is_leaf)
            except (ValueError, TypeError) as error:
                raise TypeError(
                    f"param_shardings for argument {i} must be a tree of PartitionSpec or "
                    f"NamedSharding shaped like the argument {jax.tree.structure(args[i])}; "
                    f"got {jax.tree.structure(tree, is_leaf=is_leaf)}"
                ) from error
        return dataclasses.replace(self, hints=tuple(hints))

    # --- specs ------------------------------------------------------------------------------

    def spec_of(self, x: Any, hint: Any = None) -> P:
        """The leaf's PartitionSpec on this mesh, if it carries one (or a hint); else P()."""
        sharding = hint
        if sharding is None and isinstance(x, jax.core.Tracer):
            sharding = getattr(jax.typeof(x), "sharding", None)
        elif sharding is None:
            sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.shape == self.mesh.shape:
            return sharding.spec
        return P()

    def argument_specs(self, i: int, arg: Any) -> Any:
        """The data part of every leaf's spec in positional argument ``i`` (a spec tree)."""
        hints = None if self.hints is None else self.hints[i]
        if hints is None:
            return jax.tree.map(lambda x: self.data_part(self.spec_of(x), jnp.ndim(x)), arg)
        return jax.tree.map(
            lambda h, x: self.data_part(self.spec_of(x, h), jnp.ndim(x)),
            hints,
            arg,
            is_leaf=lambda h: h is None or isinstance(h, NamedSharding),
        )

    def without_data(self, spec: P, ndim: int) -> P:
        """``spec`` with the data axes removed (what a gathered leaf is sharded over)."""
        return P(
            *(_entry(tuple(n for n in _names(e) if n not in self.axes)) for e in padded(spec, ndim))
        )

    def data_part(self, spec: P, ndim: int) -> P:
        """Only the data axes of ``spec`` (a partial-manual ``shard_map`` in_spec)."""
        return P(
            *(_entry(tuple(n for n in _names(e) if n in self.axes)) for e in padded(spec, ndim))
        )

    def sharded_over_data(self, spec: P, ndim: int) -> bool:
        return any(n in self.axes for e in padded(spec, ndim) for n in _names(e))

    def batch_spec(self, ndim: int) -> P:
        return P(_entry(self.axes), *([None] * (ndim - 1)))

    def _psum_rest(self, g: jax.Array, spec: P) -> jax.Array:
        """``psum`` over the data axes that do not shard the leaf (the others are scattered)."""
        rest = tuple(a for a in self.axes if all(a not in _names(e) for e in spec))
        return jax.lax.psum(g, rest) if rest else g

    def _reduce_local(self, g: jax.Array, spec: P) -> jax.Array:
        """Inside a ``shard_map`` manual over the data axes: a per-device partial gradient
        summed over them, each dimension the (data-part) ``spec`` shards reduce-scattered."""
        for dim, entry in enumerate(spec):
            if entry is not None:
                g = jax.lax.psum_scatter(g, entry, scatter_dimension=dim, tiled=True)
        return self._psum_rest(g, spec)

    def _reshard(self, x: Any, spec: P) -> Any:
        return jax.reshard(x, NamedSharding(self.mesh, spec))

    # --- the pipeline -----------------------------------------------------------------------

    def accumulate(
        self,
        cfg: _accumulate.Config,
        args: tuple[Any, ...],
        batch_size: int,
        num_microbatches: int | None,
        microbatch_size: int | None,
    ) -> _accumulate.Accumulated:
        if batch_size % self.devices:
            raise ValueError(
                f"the batch size {batch_size} is not divisible by the {self.devices} devices of "
                f"mesh axis data_axis={self.axes if len(self.axes) > 1 else self.axes[0]!r}"
            )
        local = batch_size // self.devices
        k = _validation.resolve_num_microbatches(local, num_microbatches, microbatch_size)
        if self.explicit:
            current = jax.sharding.get_abstract_mesh()
            if current.empty or current.shape_tuple != self.mesh.abstract_mesh.shape_tuple:
                raise ValueError(
                    f"mesh has Explicit axes {self.axes}: call value_and_grad inside "
                    "`with jax.set_mesh(mesh):` (JAX's explicit-sharding mode needs the mesh in "
                    f"context); the mesh in context is {current}"
                )
            return self._explicit(cfg, args, k)
        return self._auto(cfg, args, k)

    # Explicit axes: reduced parameters, unreduced gradients, one reshard after the scan.
    def _explicit(
        self, cfg: _accumulate.Config, args: tuple[Any, ...], k: int
    ) -> _accumulate.Accumulated:
        args = tuple(
            jax.tree.map(lambda x: self._reshard(jnp.asarray(x), self.batch_spec(jnp.ndim(x))), a)
            if i in cfg.split_argnums
            else a
            for i, a in enumerate(args)
        )
        diff = jax.tree.map(jnp.asarray, cfg.differentiated(args))
        specs = jax.tree.map(lambda x: self.spec_of(x), diff)
        batches = _accumulate.split_microbatches(cfg, args, k)
        batches = jax.tree.map(
            lambda x: self._reshard(x, P(None, *self.batch_spec(x.ndim - 1))), batches
        )
        # Which leaves can be cast to reduced. JAX rejects an elementwise op between a reduced
        # array and one sharded over the same axes (a bias added to a batch-sharded
        # activation); `reduced_compatible` re-evaluates fun so that such an op reshards the
        # parameter first, which resolves it at the top level of fun (and in nested jits), not
        # inside its own loops (a scan over layers). So: every leaf; every leaf with fun
        # re-evaluated; kernels only (ndim >= 2); none. A leaf left replicated has its gradient
        # reduced by the partitioner in every micro-batch. A finiteness test (skip_nonfinite)
        # is not linear: then nothing is left unreduced. Each trial traces the whole scan
        # (the backward pass too: it can fail where the forward pass did not).
        choices: list[tuple[bool | str, bool]] = (
            [(False, False)]
            if cfg.skip_nonfinite
            else [(True, False), (True, True), ("kernels", False), (False, False)]
        )
        for n, (which, resolve) in enumerate(choices):
            reduced = jax.tree.map(functools.partial(_cast_to_reduced, which=which), diff)
            trial_cfg = cfg
            if resolve:
                trial_cfg = dataclasses.replace(cfg, fun=reduced_compatible(cfg.fun))
            try:
                return self._explicit_scan(trial_cfg, args, k, diff, specs, reduced, batches)
            except Exception as error:
                if not _is_sharding_type_error(error) or n == len(choices) - 1:
                    raise
        raise AssertionError("unreachable")

    def _explicit_scan(
        self,
        cfg: _accumulate.Config,
        args: tuple[Any, ...],
        k: int,
        diff: Any,
        specs: Any,
        reduced: Any,
        batches: Any,
    ) -> _accumulate.Accumulated:
        """The scan with the ``reduced`` leaves cast to reduced, then one reshard per leaf."""
        inner_cfg, cast_args, per_microbatch = self._explicit_args(cfg, args, diff, specs, reduced)
        loss, aux_like = _accumulate.check_output(inner_cfg, cast_args, batches)

        def zeros(x: Any, spec: P, m: bool, r: bool) -> jax.Array:
            dtype = _reductions.accumulator_dtype_for(x.dtype, cfg.accumulator_dtype)
            z = jnp.zeros(x.shape, dtype)
            if m:
                return self._reshard(z, spec)
            unreduced = set(self.axes) if r else set()
            return self._reshard(z, P(*self.without_data(spec, x.ndim), unreduced=unreduced))

        sums = _accumulate.zero_sums(cfg, cast_args, loss, aux_like)._replace(
            grads=jax.tree.map(zeros, diff, specs, per_microbatch, reduced)
        )
        scanned = _accumulate.scan_microbatches(inner_cfg, cast_args, k, sums, batches)
        sums = scanned.sums
        grads = jax.tree.map(self._reduce_once, sums.grads, specs, per_microbatch, reduced)
        mean_loss, grads = _accumulate.finalize(cfg, sums._replace(grads=grads), args, loss)
        aux = _accumulate.finish_aux(cfg, scanned, sums.weight, k)
        return _accumulate.Accumulated(
            mean_loss, grads, aux, sums.weight, sums.skipped, k, sums.carry
        )

    def _reduce_once(self, g: jax.Array, spec: P, per_microbatch: bool, reduced: bool) -> Any:
        """The step's one reduction of an accumulated gradient, to the leaf's own sharding.

        A reshard from unreduced does it, but XLA lowers a reshard to a data-sharded (FSDP)
        spec as an all-reduce and a slice; a ``psum_scatter`` in a ``shard_map`` manual over
        the data axes is a reduce-scatter (1/n of the traffic per device)."""
        if per_microbatch or not reduced or not self.sharded_over_data(spec, g.ndim):
            return self._reshard(g, spec)
        data_spec = self.data_part(spec, g.ndim)
        out = jax.shard_map(
            functools.partial(self._reduce_local, spec=data_spec),
            in_specs=P(*([None] * g.ndim), unreduced=set(self.axes)),
            out_specs=data_spec,
            axis_names=set(self.axes),
        )(g)
        return self._reshard(out, spec)

    def _explicit_args(
        self, cfg: _accumulate.Config, args: tuple[Any, ...], diff: Any, specs: Any, reduced: Any
    ) -> tuple[_accumulate.Config, tuple[Any, ...], Any]:
        """The config and arguments with each differentiated leaf cast for the scan."""

        def cast(x: jax.Array, spec: P, r: bool) -> jax.Array:
            unreduced = set(self.axes) if r else set()
            return self._reshard(x, P(*self.without_data(spec, x.ndim), reduced=unreduced))

        per_microbatch = jax.tree.map(
            lambda x, s: self.fsdp == "microbatch" and self.sharded_over_data(s, x.ndim),
            diff,
            specs,
        )
        outside = jax.tree.map(
            lambda x, s, m, r: x if m else cast(x, s, r), diff, specs, per_microbatch, reduced
        )
        inner_cfg = cfg
        if any(jax.tree.leaves(per_microbatch)):
            inner_cfg = _gather_inside(
                cfg,
                lambda tree: jax.tree.map(
                    lambda x, s, m, r: cast(x, s, r) if m else x,
                    tree,
                    specs,
                    per_microbatch,
                    reduced,
                ),
            )
        return inner_cfg, _accumulate.replace_differentiated(cfg, args, outside), per_microbatch

    # Auto axes: shard_map manual over the data axes only; one psum (or psum_scatter) after.
    def _auto(
        self, cfg: _accumulate.Config, args: tuple[Any, ...], k: int
    ) -> _accumulate.Accumulated:
        if cfg.carry_argnums:
            raise ValueError(
                f"carry_argnums={cfg.carry_argnums} with a mesh whose data axes {self.axes} are "
                "Auto: each device would see only its share of every micro-batch, so carried "
                "state (BatchNorm statistics) would differ from the single-device run; use a "
                "mesh with Explicit axes (jax.make_mesh's default), where every micro-batch is "
                "one global array"
            )
        args = tuple(jax.tree.map(jnp.asarray, a) for a in args)
        in_specs = tuple(
            jax.tree.map(lambda x: self.batch_spec(x.ndim), a)
            if i in cfg.split_argnums
            else self.argument_specs(i, a)
            for i, a in enumerate(args)
        )
        diff_specs = cfg.differentiated(in_specs)
        is_spec = lambda s: isinstance(s, P)  # noqa: E731

        def gather(x: jax.Array, spec: P) -> jax.Array:
            for dim, entry in enumerate(spec):
                if entry is not None:
                    x = jax.lax.all_gather(x, entry, axis=dim, tiled=True)
            return x

        def gather_tree(tree: Any, spec_tree: Any) -> Any:
            return jax.tree.map(gather, tree, spec_tree, is_leaf=lambda s: isinstance(s, P))

        per_microbatch = self.fsdp == "microbatch"

        def local(*local_args: Any) -> tuple[Any, ...]:
            local_args = tuple(
                a
                if i in cfg.split_argnums or i in cfg.diff_argnums
                else gather_tree(a, in_specs[i])
                for i, a in enumerate(local_args)
            )
            inner_cfg = cfg
            if per_microbatch:  # gathered inside fun: autodiff reduce-scatters per micro-batch
                inner_cfg = _gather_inside(
                    cfg,
                    lambda tree: jax.tree.map(
                        gather, tree, diff_specs, is_leaf=lambda s: isinstance(s, P)
                    ),
                )
            else:
                local_args = _accumulate.replace_differentiated(
                    cfg,
                    local_args,
                    jax.tree.map(
                        gather,
                        cfg.differentiated(local_args),
                        diff_specs,
                        is_leaf=lambda s: isinstance(s, P),
                    ),
                )
            scanned = _accumulate.scan_microbatches(inner_cfg, local_args, k)
            sums, loss = scanned.sums, scanned.loss
            if cfg.stacks_all_aux:
                per_device = scanned.ys
            else:  # stacked leaves, and each reduced leaf's raw accumulator, stacked per device
                traced["aux"] = scanned.aux
                per_device = [
                    ys if acc is None else jnp.expand_dims(acc, 0)
                    for ys, acc in zip(scanned.ys, sums.aux, strict=True)
                ]
            if per_microbatch:  # already reduce-scattered over the axes the leaf is split on
                grads = jax.tree.map(
                    lambda g, s: self._psum_rest(g, s), sums.grads, diff_specs, is_leaf=is_spec
                )
            else:
                grads = jax.tree.map(self._reduce_local, sums.grads, diff_specs, is_leaf=is_spec)
            totals = jax.lax.psum((sums.loss, sums.weight, sums.skipped), self.axes)
            sums = _accumulate.Sums(totals[0], grads, totals[1], totals[2])
            mean_loss, grads = _accumulate.finalize(cfg, sums, local_args, loss)
            return mean_loss, grads, per_device, sums.weight, sums.skipped

        traced: dict[str, Any] = {}

        out = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=(P(), diff_specs, P(_entry(self.axes)), P(), P()),
            axis_names=set(self.axes),
            check_vma=False,
        )(*args)
        loss, grads, aux, weight, skipped = out
        if not cfg.stacks_all_aux:
            aux = _combine_aux(cfg, traced["aux"], aux, weight, k * self.devices)
        return _accumulate.Accumulated(loss, grads, aux, weight, skipped, k * self.devices)


def _cast_to_reduced(x: jax.Array, which: bool | str) -> bool:
    return x.ndim >= 2 if which == "kernels" else bool(which)


def _is_sharding_type_error(error: Exception) -> bool:
    """JAX refused a reduced/unreduced type: ShardingTypeError (not public in jax), or a
    primitive with no rule for them yet (jax 0.10: ``conv_general_dilated``)."""
    if type(error).__name__ == "ShardingTypeError":
        return True
    return isinstance(error, NotImplementedError) and "unreduced/reduced rule" in str(error)


def _reduced(x: Any) -> bool:
    sharding = getattr(jax.typeof(x), "sharding", None)
    return bool(sharding is not None and sharding.spec.reduced)


def _without_reduced(x: Any) -> jax.ShapeDtypeStruct:
    """``x``'s type with its ``reduced`` axes dropped (the same data: a replicated array)."""
    sharding = jax.typeof(x).sharding
    spec = P(*sharding.spec.partitions, unreduced=sharding.spec.unreduced)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(sharding.mesh, spec))


def _resolve_reduced(eqn: Any, invals: list[Any]) -> list[Any] | None:
    """An elementwise op between a reduced operand (a parameter) and an operand sharded over
    the same axes (a batch-sharded activation): the reduced one is broadcast to the output's
    shape and resharded like the other, a free slice whose transpose keeps the gradient
    unreduced. JAX's own error message suggests this reshard."""
    try:
        return _jaxpr.bind(eqn, invals)
    except Exception as error:
        if not _is_sharding_type_error(error):
            raise
        shape = eqn.outvars[0].aval.shape if len(eqn.outvars) == 1 else None
        like = [v for v in invals if not _reduced(v) and jnp.shape(v) == shape]
        if shape is None or not like or not any(map(_reduced, invals)):
            raise
        target = jax.typeof(like[0]).sharding
        return _jaxpr.bind(eqn, [_sharded_like(v, shape, target) if _reduced(v) else v
                                 for v in invals])


def _sharded_like(v: jax.Array, shape: tuple[int, ...], target: NamedSharding) -> jax.Array:
    """A reduced ``v`` broadcast to ``shape`` with the sharding ``target``, never materialised
    whole: along a dimension sharded over n devices that ``v`` broadcasts (size 1), ``v`` is
    broadcast to n, resharded (each device keeps one copy) and expanded locally. Under
    transposition the gradient is summed locally and stays unreduced, n values per device."""
    v = jnp.reshape(v, (1,) * (len(shape) - jnp.ndim(v)) + jnp.shape(v))
    spec = padded(P(*target.spec.partitions), len(shape))
    split = {}
    for d, entry in enumerate(spec):
        n = math.prod(target.mesh.shape[a] for a in _names(entry))
        if n > 1 and v.shape[d] == 1 and shape[d] % n == 0:
            split[d] = n
    small = tuple(split.get(d, size) for d, size in enumerate(shape))
    v = jax.reshard(jnp.broadcast_to(v, small), target)
    if not split:
        return v
    ones = [s for d, size in enumerate(small) for s in ((size, 1) if d in split else (size,))]
    full = [s for d, size in enumerate(small)
            for s in ((size, shape[d] // size) if d in split else (size,))]
    return jnp.broadcast_to(v.reshape(ones), full).reshape(shape)


def reduced_compatible(fun: Any) -> Any:
    """``fun`` for reduced parameters: the ops that mix a reduced parameter with a data-sharded
    activation (a bias add, a LayerNorm scale) reshard the parameter there (see
    :func:`_resolve_reduced`); nested ``jit`` calls are inlined. Traced once as written with
    plain (replicated) types, then re-evaluated on the reduced arguments."""

    def wrapped(*args: Any) -> Any:
        traced = _jaxpr.trace(fun, args, as_type=_without_reduced)
        return traced.evaluate(*traced.arrays, rule=_resolve_reduced, inline=lambda eqn: True)

    return wrapped


def _combine_aux(
    cfg: _accumulate.Config, like: Any, per_device: list[Any], total: Any, k: int
) -> Any:
    """Reduced aux leaves: combines the devices' raw accumulators (stacked on axis 0)."""
    plan = _reductions.aux_plan(cfg.aux_reduce, like)
    accs: list[Any] = []
    stacked: list[Any] = []
    for name, value in zip(plan, per_device, strict=True):
        if name == "stack":
            accs.append(None)
            stacked.append(value)
            continue
        stacked.append(None)
        if name in ("sum", "mean", "weighted_mean"):
            accs.append(jnp.sum(value, axis=0))
        elif name == "max":
            accs.append(jnp.max(value, axis=0))
        elif name == "min":
            accs.append(jnp.min(value, axis=0))
        else:  # last: the last device holds the last examples
            accs.append(value[-1])
    leaves = _reductions.aux_finalize(plan, accs, stacked, jax.tree.leaves(like), total, k)
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def _gather_inside(cfg: _accumulate.Config, gather: Any) -> _accumulate.Config:
    """A config whose ``fun`` gathers the differentiated arguments itself (per micro-batch)."""
    fun = cfg.fun

    def gathered_fun(*args: Any) -> Any:
        return fun(*_accumulate.replace_differentiated(cfg, args, gather(cfg.differentiated(args))))

    return dataclasses.replace(cfg, fun=gathered_fun, pin_in_loop=True)


def data_parallel(
    mesh: jax.sharding.Mesh | None,
    data_axis: str | tuple[str, ...] | None,
    fsdp: str = "step",
) -> DataParallel | None:
    """The :class:`DataParallel` for ``mesh`` and ``data_axis``, or None without a mesh."""
    if fsdp not in FSDP_MODES:
        raise ValueError(f"fsdp must be one of {FSDP_MODES}; got fsdp={fsdp!r}")
    axes = data_axes(mesh, data_axis)
    if axes is None:
        return None
    assert mesh is not None
    return DataParallel(mesh, axes, fsdp)
