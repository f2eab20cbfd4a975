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
           "param_hints"]


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
