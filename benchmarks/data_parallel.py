"""Collectives and step time under data parallelism, per k: jaxaccum vs the anchors.

On CPU the script asks XLA for 8 host devices (set before JAX starts). For each k (micro-batches
per optimizer step) it compiles one optimizer step of the gist MLP on a global batch of 512 and
counts, in the compiled HLO, the collectives *executed per optimizer step* (an op inside the
scan's loop body runs k times; a per-call transform runs its program k times):

- jaxaccum.train_step(mesh=...): each device scans its shard, one psum after the scan;
- optax.MultiSteps fed one batch-sharded micro-batch per jitted call (GSPMD reduces per call);
- a naive scan: jaxaccum.value_and_grad without a mesh, jitted over a batch-sharded array.

Writes benchmarks/results/data_parallel.json.

    python benchmarks/data_parallel.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from _common import LR, Model, loss, machine, save, split  # noqa: E402

import jaxaccum  # noqa: E402
from jaxaccum._xla.hlo import collective_counts  # noqa: E402

MODEL = Model("gist MLP 784-100-10, global batch 512", (784, 100, 10), 512)


def executed(counts: dict[str, int], k: int, calls: int = 1) -> dict[str, int]:
    """Collectives run per optimizer step: loop-body ops k times, per-call programs k calls."""
    out = {}
    for op in ("all-reduce", "all-gather"):
        outside = counts[op] - counts[f"{op} in loops"]
        out[op] = calls * (outside + k * counts[f"{op} in loops"])
    return out


def timed(fn: Any, rounds: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    n = len(jax.devices())
    explicit = jax.make_mesh((n,), ("data",))
    auto = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batch_sharding = jax.NamedSharding(auto, jax.P("data"))
    params, batch = MODEL.params(), MODEL.data()
    sharded = jax.device_put(batch, batch_sharding)
    sgd = optax.sgd(LR)
    rows: dict[int, Any] = {}
    for k in args.ks:
        ours = jaxaccum.train_step(loss, sgd, num_microbatches=k, mesh=explicit, donate=False)
        state = sgd.init(params)
        ours_counts = collective_counts(ours.lower(params, state, batch).compile().as_text())

        naive_fn = jaxaccum.train_step(loss, sgd, num_microbatches=k, donate=False)
        naive_counts = collective_counts(naive_fn.lower(params, state, sharded).compile().as_text())

        multi = optax.MultiSteps(optax.sgd(LR), k).gradient_transformation()

        @jax.jit
        def call(p: Any, s: Any, micro: Any, multi: Any = multi) -> Any:
            updates, s = multi.update(jax.grad(loss)(p, micro), s, p)
            return optax.apply_updates(p, updates), s

        micro = [jax.device_put(m, batch_sharding) for m in split(batch, k)]
        mstate = multi.init(params)
        multi_counts = collective_counts(call.lower(params, mstate, micro[0]).compile().as_text())

        def run_multi(mstate: Any = mstate, micro: Any = micro, call: Any = call) -> Any:
            # One call at a time: with 8 host devices on 2 cores, dozens of in-flight
            # collective programs can starve XLA:CPU's rendezvous threads (seen at k=64).
            p, s = params, mstate
            for m in micro:
                p, s = jax.block_until_ready(call(p, s, m))
            return p

        rows[k] = {
            "jaxaccum.train_step(mesh)": {
                "per_step": executed(ours_counts, k),
                "ms": timed(lambda f=ours, s=state: f(params, s, batch), args.rounds),
            },
            "optax.MultiSteps (per call)": {
                "per_step": executed(multi_counts, k, calls=k),
                "ms": timed(run_multi, args.rounds),
            },
            "naive sharded scan": {
                "per_step": executed(naive_counts, k),
                "ms": timed(lambda f=naive_fn, s=state: f(params, s, sharded), args.rounds),
            },
        }
        print(
            f"k={k:3d}  "
            + "  ".join(
                f"{name}: all-reduce {r['per_step']['all-reduce']:3d}, all-gather "
                f"{r['per_step']['all-gather']:3d}, {r['ms']:7.2f} ms"
                for name, r in rows[k].items()
            ),
            flush=True,
        )
    path = save(
        "data_parallel", {"machine": machine(), "devices": n, "model": MODEL.name, "by_k": rows}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
