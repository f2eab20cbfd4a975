"""Helpers shared by the programs: jaxaccum's mesh options, JSON output, tree comparison."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, Literal, cast

import jax
import numpy as np

import jaxaccum

FsdpMode = Literal["step", "microbatch"]

# The launcher's contract with a program started as one of several processes.
COORDINATOR = "JAXACCUM_TEST_COORDINATOR"
NUM_PROCESSES = "JAXACCUM_TEST_NUM_PROCESSES"
PROCESS_ID = "JAXACCUM_TEST_PROCESS_ID"


def accumulation_options(
    mesh: jax.sharding.Mesh | None,
    data_axis: str | Sequence[str] | None = None,
    fsdp: str | Sequence[str] | None = None,
    param_shardings: Any = None,
) -> dict[str, Any]:
    """The keyword arguments that put a jaxaccum call on ``mesh`` (the only place they are
    spelled): ``mesh=jaxaccum.DataParallel(...)``. A sequence of ``fsdp`` options is
    ``plan_microbatches``' own ``fsdp=`` (the options it plans among)."""
    if mesh is None:
        return {}
    axis = data_axis if data_axis is None or isinstance(data_axis, str) else tuple(data_axis)
    options: dict[str, Any] = {}
    one = cast(FsdpMode, fsdp if isinstance(fsdp, str) else "step")  # (checked there)
    if fsdp is not None and not isinstance(fsdp, str):
        options["fsdp"] = tuple(fsdp)
    options["mesh"] = jaxaccum.DataParallel(mesh, data_axis=axis, fsdp=one,
                                            param_shardings=param_shardings)
    return options


def hlo_text(compiled: jax.stages.Compiled) -> str:
    """The compiled module's HLO text (which every backend JAX runs on provides)."""
    text = compiled.as_text()
    assert text is not None, "this backend gives no HLO text"
    return text


def memory(compiled: jax.stages.Compiled) -> Any:
    """The compiled module's memory analysis (temp, argument bytes per device)."""
    analysis = compiled.memory_analysis()
    assert analysis is not None, "this backend gives no memory analysis"
    return analysis


def emit(result: Any) -> None:
    """Prints ``result`` as one JSON line: the launcher reads the last line of stdout."""
    print(json.dumps(result), flush=True)


def arrays_to_json(tree: dict[str, Any]) -> dict[str, Any]:
    """Named arrays as nested lists (float32 values round-trip exactly through JSON)."""
    return {name: np.asarray(value).tolist() for name, value in tree.items()}


def rel_diff(actual: Any, expected: Any) -> float:
    """Max |actual - expected| over the leaves, relative to max |expected|."""
    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(e))))
        for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    )
    return diff / max(float(np.max(np.abs(np.asarray(e)))) for e in jax.tree.leaves(expected))


def process_index() -> int:
    """This process's index among the launcher's processes (0 when started alone)."""
    return int(os.environ.get(PROCESS_ID, "0"))


def initialize_distributed() -> int:
    """Joins the launcher's processes with ``jax.distributed`` (gloo collectives on CPU);
    returns this process's index."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        os.environ[COORDINATOR],
        num_processes=int(os.environ[NUM_PROCESSES]),
        process_id=process_index(),
        initialization_timeout=60,
    )
    return process_index()
