# ruff: noqa: E402  (XLA_FLAGS must be set before JAX starts)
"""Sharded training: collectives, memory and step time per optimizer step, per mesh and way.

On CPU the script asks XLA for 8 host devices (set before JAX starts). Model: an MLP
784-2048-10 with tanh and softmax cross-entropy, global batch 512, SGD with momentum (one
param-sized optimizer state). Meshes, each with Auto and with Explicit axes:

- ``data``: (8,) data parallel, parameters replicated;
- ``data_model``: (4, 2) data x model, tensor-parallel kernels (w1 P(None, 'model'),
  w2 P('model', None));
- ``fsdp``: (8,) FSDP, kernels P('data', None);
- ``data_fsdp``: (2, 4) data x fsdp (HSDP), kernels P('fsdp', None), data axes
  ``("data", "fsdp")``.

Ways, per mesh and k (micro-batches per optimizer step):

- ``jaxaccum step``: ``jaxaccum.train_step(..., mesh=jaxaccum.DataParallel(mesh,
  data_axis=..., fsdp="step"))``;
- ``jaxaccum microbatch``: the same with ``fsdp="microbatch"`` (FSDP meshes only);
- ``naive scan``: what a user writes without jaxaccum: ``jax.jit`` over a ``lax.scan`` of
  contiguous micro-batches ``x.reshape(k, B // k, ...)``, plain ``jax.grad`` in the body, one
  optax update (on Explicit meshes, where that reshape is rejected, with
  ``out_sharding=P(None, data)``: recorded per case);
- ``optax.MultiSteps``: one micro-batch per jitted call (k calls per optimizer step);
- ``full batch``: plain ``jax.jit`` of ``jax.grad`` on the whole batch, no accumulation.

Every jitted program keeps the parameters' and optimizer state's shardings (``out_shardings``),
as ``train_step`` does. On Explicit meshes the model writes its contractions with
``out_sharding=`` and the non-jaxaccum ways gather FSDP kernels themselves (``jax.reshard``).

For each case: the collectives *executed per optimizer step* from the compiled HLO
(``jaxaccum._xla.hlo``; an op in a loop body runs k times, there being no inner loop in this
model; a per-call program runs k times), counted and summed (result bytes per device) by op
and by the mesh axes they run over (read from the replica groups: ``data`` = only data axes,
``other`` = only non-data axes, e.g. the TP ``model`` axis); ``memory_analysis()`` temp and
argument bytes per device; compile time; median step time over interleaved rounds; and the
updated parameters against the full-batch step (relative to the update's size).

Writes benchmarks/results/sharded.json and sharded.png and prints Markdown tables. The JSON
records which jaxaccum was imported (file, and its git commit: to measure a commit while others
edit the working tree, extract it and put it first on PYTHONPATH, e.g.
``git archive HEAD jaxaccum | tar -x -C /tmp/snap && git rev-parse HEAD > /tmp/snap/COMMIT``).

    python benchmarks/sharded.py            # about 6 minutes on 2 CPU cores
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import math
import pathlib
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import machine, result_path, save
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._xla import hlo as _hlo

SIZES = (784, 2048, 10)
BATCH = 512
LR = 1e-2
OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
         "collective-permute": "CP"}
WAYS = ("full batch", "jaxaccum step", "jaxaccum microbatch", "naive scan", "optax.MultiSteps")

MESHES = {  # name: (shape, axis names, data axes, parameter specs)
    "data": ((8,), ("data",), ("data",),
             {"w1": P(), "b1": P(), "w2": P(), "b2": P()}),
    "data_model": ((4, 2), ("data", "model"), ("data",),
                   {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None),
                    "b2": P()}),
    "fsdp": ((8,), ("data",), ("data",),
             {"w1": P("data", None), "b1": P(), "w2": P("data", None), "b2": P()}),
    "data_fsdp": ((2, 4), ("data", "fsdp"), ("data", "fsdp"),
                  {"w1": P("fsdp", None), "b1": P("fsdp"), "w2": P("fsdp", None), "b2": P()}),
}


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    d, h, o = SIZES
    return {
        "w1": (rng.normal(size=(d, h)) / math.sqrt(d)).astype(np.float32),
        "b1": (rng.normal(size=(h,)) / 10).astype(np.float32),
        "w2": (rng.normal(size=(h, o)) / math.sqrt(h)).astype(np.float32),
        "b2": np.zeros((o,), np.float32),
    }


def init_batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.uniform(size=(BATCH, SIZES[0])).astype(np.float32)
    y = np.eye(SIZES[-1], dtype=np.float32)[rng.integers(0, SIZES[-1], BATCH)]
    return x, y


def without_data(spec: P, data_axes: tuple[str, ...]) -> P:
    def keep(entry: Any) -> Any:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        names = tuple(n for n in names if n not in data_axes)
        return None if not names else names[0] if len(names) == 1 else names

    return P(*(keep(e) for e in spec))


def make_loss(
    explicit: bool, batch_entry: Any, model: str | None, gather: dict[str, P] | None = None
) -> Callable[..., Any]:
    """The MLP's loss; on Explicit meshes written with ``out_sharding=``.

    ``gather``: specs to reshard the parameters to first (an Explicit-mesh user's FSDP gather;
    jaxaccum does it itself).
    """

    def loss(p: dict[str, jax.Array], b: tuple[jax.Array, jax.Array]) -> jax.Array:
        x, y = b
        if gather is not None:
            p = {n: jax.reshard(v, gather[n]) for n, v in p.items()}
        if explicit:
            h = jnp.einsum("bd,dh->bh", x, p["w1"], out_sharding=P(batch_entry, model))
            h = jnp.tanh(h + p["b1"])
            out = jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P(batch_entry, None))
        else:
            out = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
        out = out + p["b2"]
        return -jnp.mean(jnp.sum(y * jax.nn.log_softmax(out), axis=-1))

    return loss


# --- collectives, with the mesh axes each one runs over -------------------------------------


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _groups(line: str, n: int) -> list[list[int]] | None:
    """The device groups of a collective (lists of device positions), None if unreadable."""
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
        r"\s*\{([^}]*)\}",
        line,
    )
    if m:
        names_sizes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names = [a for a, _ in names_sizes]
        shape = [int(s) for _, s in names_sizes]
        ids = np.arange(math.prod(shape))
        if m.group(2):
            ids = ids.reshape(_ints(m.group(2)))
            if m.group(3):
                ids = ids.transpose(_ints(m.group(3)))
        ids = ids.reshape(shape)
        named = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
        rest = [i for i in range(len(shape)) if i not in named]
        size = math.prod(shape[i] for i in named)
        return ids.transpose(rest + named).reshape(-1, size).tolist()
    if "replica_groups={}" in line:
        return [list(range(n))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        ids = np.arange(n).reshape(_ints(m.group(3)))
        if m.group(4):
            ids = ids.transpose(_ints(m.group(4)))
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)+)\}", line)
    if m:
        return [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"source_target_pairs=\{((?:\{[\d,]*\},?)+)\}", line)
    if m:
        return [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return None


def _axes(groups: list[list[int]] | None, mesh: jax.sharding.Mesh) -> tuple[str, ...] | None:
    """The mesh axes along which the devices of any group differ."""
    if groups is None:
        return None
    varying: set[str] = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.array(group), mesh.devices.shape))
        varying |= {a for a, c in zip(mesh.axis_names, coords, strict=True) if len(set(c)) > 1}
    return tuple(a for a in mesh.axis_names if a in varying)


def _kind(axes: tuple[str, ...] | None, data_axes: tuple[str, ...]) -> str:
    """data: over data axes only; other: over other axes only (TP); mixed: both."""
    if axes is None:
        return "unknown"
    if not axes:
        return "none"
    if set(axes) <= set(data_axes):
        return "data"
    return "other" if not set(axes) & set(data_axes) else "mixed"


def collectives(hlo: str, mesh: jax.sharding.Mesh, data_axes: tuple[str, ...]) -> dict:
    """``_hlo.collectives`` plus the kind of axes each op runs over; loop facts."""
    rows = _hlo.collectives(hlo)
    comps = _hlo.computations(hlo)
    in_loop = _hlo._loop_computations(comps)
    kinds = []
    for name, lines in comps.items():  # the same walk as _hlo.collectives, in the same order
        for line in lines:
            op = _hlo._op_name(line)
            if op:
                axes = _axes(_groups(line, mesh.size), mesh)
                kinds.append((op, name in in_loop, axes))
    assert [(op, loop) for op, loop, _ in kinds] == [(op, loop) for op, loop, _, _ in rows]
    loops = sum(1 for lines in comps.values() for line in lines if " while(" in line)
    nested = sum(1 for name in in_loop for line in comps[name] if " while(" in line)
    return {
        "ops": [
            {"op": op, "in_loop": loop, "bytes": size, "group": group,
             "axes": "unknown" if axes is None else "+".join(axes) or "none",
             "kind": _kind(axes, data_axes)}
            for (op, loop, size, group), (_, _, axes) in zip(rows, kinds, strict=True)
        ],
        "while_loops": loops,
        "nested_while_loops": nested,
    }


def per_step(ops: list[dict], k: int, calls: int) -> dict[str, Any]:
    """Executed per optimizer step: an op in a loop body k times, a program ``calls`` times."""
    out: dict[str, Any] = {
        "by_op": {op: {"count": 0, "bytes": 0} for op in OPS},
        "by_axes": {},
        "by_kind": {},
        "count": 0,
        "bytes": 0,
        "in_loop_count": 0,
    }
    for r in ops:
        times = calls * (k if r["in_loop"] else 1)
        out["by_op"][r["op"]]["count"] += times
        out["by_op"][r["op"]]["bytes"] += times * r["bytes"]
        for key, name in (("by_axes", r["axes"]), ("by_kind", r["kind"])):
            entry = out[key].setdefault(name, {"count": 0, "bytes": 0})
            entry["count"] += times
            entry["bytes"] += times * r["bytes"]
        out["count"] += times
        out["bytes"] += times * r["bytes"]
        out["in_loop_count"] += times if r["in_loop"] else 0
    return out


# --- the ways ---------------------------------------------------------------------------------


class Case:
    """One way on one mesh at one k: compiled once, analysed, then timed."""

    def __init__(self, way: str, k: int, calls: int = 1) -> None:
        self.way, self.k, self.calls = way, k, calls
        self.record: dict[str, Any] = {}
        self.run: Callable[[], Any] | None = None
        self.times: list[float] = []


def analyse(case: Case, lower: Callable[[], Any], mesh: Any, data_axes: tuple[str, ...]) -> Any:
    start = time.perf_counter()
    compiled = lower().compile()
    case.record["compile_s"] = time.perf_counter() - start
    ma = compiled.memory_analysis()
    case.record["temp_bytes"] = ma.temp_size_in_bytes
    case.record["argument_bytes"] = ma.argument_size_in_bytes
    case.record["output_bytes"] = ma.output_size_in_bytes
    found = collectives(compiled.as_text(), mesh, data_axes)
    case.record["while_loops"] = found["while_loops"]
    case.record["nested_while_loops"] = found["nested_while_loops"]
    case.record["program_collectives"] = found["ops"]
    case.record["per_step"] = per_step(found["ops"], case.k, case.calls)
    return compiled


def build_group(
    name: str, axis_type: str, ks: list[int], params0: dict, batch0: tuple
) -> tuple[list[Case], dict[str, Any]]:
    shape, names, data_axes, specs = MESHES[name]
    explicit = axis_type == "explicit"
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(names)
    mesh = jax.make_mesh(shape, names, axis_types=types)
    model = "model" if "model" in names else None
    batch_entry = data_axes if len(data_axes) > 1 else data_axes[0]
    fsdp_mesh = any(
        n in data_axes for s in specs.values() for e in s
        for n in (() if e is None else (e,) if isinstance(e, str) else e)
    )
    p_shard = {n: NamedSharding(mesh, s) for n, s in specs.items()}
    b_shard = NamedSharding(mesh, P(batch_entry))
    params = {n: jax.device_put(v, p_shard[n]) for n, v in params0.items()}
    batch = jax.device_put(batch0, b_shard)
    opt = optax.sgd(LR, momentum=0.9)
    state = opt.init(params)
    s_shard = jax.tree.map(lambda a: a.sharding, state)
    acc_loss = make_loss(explicit, batch_entry, model)  # jaxaccum gathers FSDP leaves itself
    user_loss = make_loss(
        explicit, batch_entry, model,
        {n: without_data(s, data_axes) for n, s in specs.items()} if explicit else None,
    )

    def update(o: Any, p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        updates, s = o.update(g, s, p)
        return optax.apply_updates(p, updates), s

    cases: list[Case] = []
    first: dict[str, Any] = {}  # one step from (params, state) per case, for the check

    def add(case: Case, lower: Callable[[], Any], run: Callable[[], Any],
            result: Callable[[Any], Any]) -> None:
        try:
            compiled = analyse(case, lower, mesh, data_axes)
            case.run = lambda: run(compiled)
            first[id(case)] = jax.tree.map(np.asarray, result(jax.block_until_ready(case.run())))
        except Exception as error:  # recorded, not fatal: a way may not work on a mesh
            case.record["error"] = f"{type(error).__name__}: {str(error)[:600]}"
            case.run = None
            print(f"  {name}/{axis_type} {case.way} k={case.k}: {case.record['error'][:200]}",
                  flush=True)
        cases.append(case)

    with jax.set_mesh(mesh):
        full = Case("full batch", 1)
        full_fn = jax.jit(lambda p, s, b: update(opt, p, s, jax.grad(user_loss)(p, b)),
                          out_shardings=(p_shard, s_shard))
        add(full, lambda: full_fn.lower(params, state, batch),
            lambda c: c(params, state, batch), lambda out: out[0])
        for k in ks:
            for mode in ("step", "microbatch") if fsdp_mesh else ("step",):
                case = Case(f"jaxaccum {mode}", k)
                dp = jaxaccum.DataParallel(mesh, data_axis=data_axes, fsdp=mode)
                step = jaxaccum.train_step(acc_loss, opt, num_microbatches=k, mesh=dp,
                                           donate=False)
                add(case, lambda step=step: step.lower(params, state, batch),
                    lambda c: c(params, state, batch), lambda out: out[0])

            case = Case("naive scan", k)
            naive = naive_step(k, opt, user_loss, update, explicit, batch_entry, p_shard,
                               s_shard, case.record)
            add(case, lambda naive=naive: naive.lower(params, state, batch),
                lambda c: c(params, state, batch), lambda out: out[0])

            case = Case("optax.MultiSteps", k, calls=k)
            multi = optax.MultiSteps(opt, k).gradient_transformation()
            mstate = multi.init(params)
            m_shard = jax.tree.map(lambda a: a.sharding, mstate)
            call = jax.jit(
                lambda p, s, b, multi=multi: update(multi, p, s, jax.grad(user_loss)(p, b)),
                out_shardings=(p_shard, m_shard),
            )
            m = BATCH // k  # contiguous micro-batches, each sharded over the data axes
            micro = [jax.device_put(tuple(a[i * m:(i + 1) * m] for a in batch0), b_shard)
                     for i in range(k)]

            def run_multi(c: Any, mstate: Any = mstate, micro: Any = micro) -> Any:
                # One call at a time (8 host devices on 2 cores: see data_parallel.py).
                p, s = params, mstate
                for mb in micro:
                    p, s = jax.block_until_ready(c(p, s, mb))
                return p, s

            add(case, lambda call=call, mstate=mstate, micro=micro:
                call.lower(params, mstate, micro[0]), run_multi, lambda out: out[0])

    # Correctness: each way's one-step parameters against the full-batch step's.
    ref = first.get(id(full))
    if ref is not None:
        scale = max(float(np.max(np.abs(ref[n] - params0[n]))) for n in ref)
        for case in cases:
            got = first.get(id(case))
            if got is not None:
                case.record["params_rel_to_full_update"] = max(
                    float(np.max(np.abs(got[n] - ref[n]))) for n in ref) / scale
    info = {"mesh_shape": dict(zip(names, shape, strict=True)), "data_axes": list(data_axes),
            "param_specs": {n: str(s) for n, s in specs.items()}}
    return cases, info


def naive_step(k: int, opt: Any, loss: Any, update: Any, explicit: bool, batch_entry: Any,
               p_shard: Any, s_shard: Any, record: dict[str, Any]) -> Any:
    """jit(scan over x.reshape(k, B // k, ...)) with plain jax.grad, one optax update.

    On an Explicit mesh the plain reshape may be rejected (or give a micro-batch axis the scan
    cannot slice); then the user adds ``out_sharding=P(None, data)``: recorded in ``record``.
    """

    def make(out_sharding: bool) -> Any:
        def split(x: jax.Array) -> jax.Array:
            shape = (k, x.shape[0] // k, *x.shape[1:])
            if out_sharding:
                return jnp.reshape(x, shape, out_sharding=P(None, batch_entry))
            return x.reshape(shape)

        def step(p: Any, s: Any, b: Any) -> Any:
            micro = jax.tree.map(split, b)

            def body(acc: Any, mb: Any) -> tuple[Any, None]:
                return jax.tree.map(jnp.add, acc, jax.grad(loss)(p, mb)), None

            acc, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), micro)
            return update(opt, p, s, jax.tree.map(lambda g: g / k, acc))

        return jax.jit(step, out_shardings=(p_shard, s_shard))

    plain = make(False)
    if not explicit:
        record["split"] = "x.reshape(k, B // k, ...)"
        return plain

    class Fallback:
        def lower(self, *args: Any) -> Any:
            try:
                lowered = plain.lower(*args)
                record["split"] = "x.reshape(k, B // k, ...)"
                return lowered
            except Exception as error:
                record["plain_reshape_error"] = f"{type(error).__name__}: {str(error)[:400]}"
                record["split"] = "jnp.reshape(x, (k, B // k, ...), out_sharding=P(None, data))"
                return make(True).lower(*args)

    return Fallback()


# --- timing, output ---------------------------------------------------------------------------


def time_group(cases: list[Case], rounds: int) -> None:
    runnable = [c for c in cases if c.run is not None]
    for _ in range(rounds):  # interleaved: every case once per round
        for case in runnable:
            start = time.perf_counter()
            jax.block_until_ready(case.run())
            case.times.append(time.perf_counter() - start)
    if rounds < 1:
        return
    full = next((c for c in runnable if c.way == "full batch"), None)
    for case in runnable:
        case.record["ms"] = statistics.median(case.times) * 1e3
        case.record["ms_all"] = [t * 1e3 for t in case.times]
        if full is not None:  # ratio of medians from the same interleaved rounds
            case.record["ratio_to_full"] = statistics.median(
                a / b for a, b in zip(case.times, full.times, strict=True))


def mb(x: float) -> str:
    return f"{x / 2**20:.2f}"


def size(x: float) -> str:
    if x >= 2**20:
        return f"{x / 2**20:.2f} MB"
    return f"{x / 2**10:.1f} KB" if x >= 2**10 else f"{x:.0f} B"


def ops_text(step: dict[str, Any]) -> str:
    parts = [f"{v['count']} {SHORT[op]}" for op, v in step["by_op"].items() if v["count"]]
    return ", ".join(parts) or "0"


def axes_text(step: dict[str, Any]) -> str:
    parts = [f"{axes}: {size(v['bytes'])}" for axes, v in
             sorted(step["by_axes"].items(), key=lambda kv: -kv[1]["bytes"]) if v["count"]]
    return ", ".join(parts) or "0"


def table(results: dict[str, Any], k: int) -> str:
    header = ["mesh", "axis types", "way", "collectives / step", "bytes / step", "by mesh axes",
              "temp MB", "arg MB", "compile s", "ms (x full)"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for group, entry in results.items():
        mesh, axis_type = group.split("/")
        for way in WAYS:
            r = entry["by_k"].get(str(k), {}).get(way) if way != "full batch" else entry["full"]
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {mesh} | {axis_type} | {way} | error: "
                             f"{r['error'][:80].replace('|', '/')} |" + " |" * 6)
                continue
            s = r["per_step"]
            label = way + (" (out_sharding)" if "plain_reshape_error" in r else "")
            ms = f"{r['ms']:.1f} ({r.get('ratio_to_full', float('nan')):.2f}x)"
            lines.append(
                f"| {mesh} | {axis_type} | {label} | {ops_text(s)} | {size(s['bytes'])} | "
                f"{axes_text(s)} | {mb(r['temp_bytes'])} | {mb(r['argument_bytes'])} | "
                f"{r['compile_s']:.2f} | {ms} |"
            )
    return "\n".join(lines)


def plot(results: dict[str, Any], ks: list[int], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [k for k in ks if k > 1] or ks
    metrics = [("collective MB executed / step", lambda r: r["per_step"]["bytes"] / 2**20),
               ("temp MB / device", lambda r: r["temp_bytes"] / 2**20),
               ("ms / step (median)", lambda r: r.get("ms", np.nan))]
    groups = list(results)
    fig, axes = plt.subplots(len(metrics), len(shown), figsize=(7 * len(shown), 10),
                             squeeze=False)
    width = 0.8 / len(WAYS)
    for col, k in enumerate(shown):
        for row, (label, value) in enumerate(metrics):
            ax = axes[row][col]
            for i, way in enumerate(WAYS):
                ys = []
                for g in groups:
                    r = (results[g]["full"] if way == "full batch"
                         else results[g]["by_k"].get(str(k), {}).get(way))
                    ys.append(np.nan if r is None or "error" in r else value(r))
                ax.bar(np.arange(len(groups)) + (i - len(WAYS) / 2 + 0.5) * width, ys, width,
                       label=way)
            ax.set_xticks(np.arange(len(groups)))
            ax.set_xticklabels(groups, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(label)
            if row == 0:
                ax.set_yscale("log")
                ax.set_title(f"k = {k} (MLP 784-2048-10, batch {BATCH}, 8 CPU devices)")
            ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(WAYS), fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def source() -> dict[str, Any]:
    """Which jaxaccum ran: its directory, commit, and whether it differs from that commit."""
    where = pathlib.Path(jaxaccum.__file__).resolve().parent
    out: dict[str, Any] = {"jaxaccum": str(where)}
    stamp = where.parent / "COMMIT"  # an extracted snapshot (see the module docstring)
    if stamp.exists():
        out["commit"] = stamp.read_text().strip()
        return out
    try:
        git = ["git", "-C", str(where.parent)]
        out["commit"] = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True,
                                       text=True, check=True).stdout.strip()
        out["uncommitted_changes"] = bool(subprocess.run(
            git + ["status", "--porcelain", "--", "jaxaccum"], capture_output=True, text=True,
            check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--meshes", nargs="+", default=list(MESHES))
    parser.add_argument("--axis-types", nargs="+", default=["auto", "explicit"])
    args = parser.parse_args()
    assert len(jax.devices()) == 8, "needs 8 devices (XLA_FLAGS host platform device count)"
    params0, batch0 = init_params(), init_batch()
    results: dict[str, Any] = {}
    start = time.perf_counter()
    for name in args.meshes:
        for axis_type in args.axis_types:
            t0 = time.perf_counter()
            cases, info = build_group(name, axis_type, args.ks, params0, batch0)
            time_group(cases, args.rounds)
            entry: dict[str, Any] = {**info, "full": None, "by_k": {}}
            for case in cases:
                if case.way == "full batch":
                    entry["full"] = case.record
                else:
                    entry["by_k"].setdefault(str(case.k), {})[case.way] = case.record
            results[f"{name}/{axis_type}"] = entry
            print(f"{name}/{axis_type}: {time.perf_counter() - t0:.1f} s", flush=True)
    payload = {
        "machine": machine(),
        "devices": len(jax.devices()),
        "source": source(),
        "model": f"MLP {'-'.join(map(str, SIZES))} tanh, softmax cross-entropy, "
                 f"global batch {BATCH}, sgd(momentum=0.9)",
        "rounds": args.rounds,
        "ks": args.ks,
        "notes": {
            "per_step": "collectives executed per optimizer step: an op inside a while body "
                        "counts k times (this model has no inner loop: see while_loops and "
                        "nested_while_loops), a per-call program (optax.MultiSteps) k times",
            "bytes": "each op's result bytes per device (a reduce-scatter's result is its "
                     "shard, an all-gather's the gathered array)",
            "axes": "by_axes: the mesh axes an op's device groups span (from the replica "
                    "groups or source-target pairs); by_kind: data = data axes only, other = "
                    "non-data axes only (TP 'model'), mixed = both, none = groups of one",
            "memory": "compiled.memory_analysis() per device; for optax.MultiSteps the "
                      "per-call program (its arguments include the accumulator)",
            "params_rel_to_full_update": "max |params after one step - full-batch step's| / "
                                         "max |full-batch update|",
        },
        "by_mesh": results,
        "total_s": time.perf_counter() - start,
    }
    path = save("sharded", payload)
    plot(results, args.ks, result_path("sharded", "png"))
    for k in args.ks:
        if k > 1:
            print(f"\n**k = {k}** (per optimizer step; full batch repeated for reference)\n")
            print(table(results, k))
    print(f"\nwrote {path} in {payload['total_s']:.0f} s")


if __name__ == "__main__":
    main()
