"""Where the pipeline runs: one device, an Auto mesh or an Explicit mesh (internal).

A placement is built whole by :func:`for_call`, once per call. It wraps the per-device
pipeline (``wrap``) and hands it a record of per-leaf operations (:class:`base.LeafOps`); it
never calls the pipeline back, and nothing in this package imports it. jaxaccum handles only
the mesh's *data* axes; every other axis (tensor parallel ``model``, ...) stays with the
partitioner, so parameters keep their shardings and a model's own collectives are untouched.

- :class:`base.OneDevice`: the pipeline as it is.
- :class:`AutoMesh` (Auto axes): a ``jax.shard_map`` manual over the data axes; each device
  scans its share of the batch; one reduction after the scan.
- :class:`ExplicitMesh` (Explicit axes): parameters cast to ``reduced``, gradients
  ``unreduced``, added without communication, reduced once after the scan.

``fsdp="step"`` gathers a data-sharded parameter once per step; ``"microbatch"`` gathers it in
every micro-batch, and its gradient is reduce-scattered every micro-batch (ZeRO-3).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum import _options
from jaxaccum._arguments import Accumulation
from jaxaccum._placement._auto import AutoMesh
from jaxaccum._placement._explicit import ExplicitMesh
from jaxaccum._placement.base import LeafOps, OneDevice, Placement

__all__ = ["AutoMesh", "ExplicitMesh", "LeafOps", "OneDevice", "Placement", "for_call",
           "for_forward", "mesh_context", "param_hints", "traced_hints"]

# Explicit or Auto axes is decided here, for every caller: which placement runs a call, what
# a caller reads before tracing (Auto: the arguments' shardings, which tracers do not carry)
# and what it enters while tracing (Explicit: the mesh, for JAX's sharding in types).


def for_call(acc: Accumulation, args: tuple[Any, ...], hints: Any = None) -> Placement:
    """The placement of ``acc.options.mesh`` for one call on ``args``; ``hints`` are argument
    shardings read before tracing (Auto meshes), else those of
    ``DataParallel.param_shardings``."""
    dp = acc.options.data_parallel
    if dp is None:
        return OneDevice()
    if dp.explicit:
        return ExplicitMesh(dp)
    if hints is None:
        hints = param_hints(acc.entry, dp, args, acc.argnums)
    return AutoMesh(dp, hints=hints)


def for_forward(options: _options.Options) -> Placement | None:
    """The placement of a forward-only pass (the coupled losses'): as on Auto axes even where
    they are Explicit, so each device evaluates its share of every micro-batch and the outputs
    meet once, after the loop (on Explicit axes a sum over the batch inside the function
    would be reduced over the devices in every micro-batch); None: :func:`for_call`'s."""
    dp = options.data_parallel
    return AutoMesh(dp) if dp is not None and dp.explicit else None


def traced_hints(options: _options.Options, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """On Auto axes, every argument leaf's ``NamedSharding`` (or None), read before tracing:
    traced arrays carry none there. None elsewhere."""
    dp = options.data_parallel
    if dp is None or dp.explicit:
        return None
    return tuple(jax.tree.map(_sharding_of, a) for a in args)


def _sharding_of(x: Any) -> Any:
    """A concrete array's (or ShapeDtypeStruct's) NamedSharding, else None."""
    sharding = getattr(x, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def mesh_context(options: _options.Options) -> Any:
    """What a caller enters while tracing: on Explicit axes the mesh (``jax.set_mesh``, which
    JAX's sharding in types needs), else nothing."""
    dp = options.data_parallel
    if dp is not None and dp.explicit:
        return jax.set_mesh(dp.mesh)
    return contextlib.nullcontext()


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
