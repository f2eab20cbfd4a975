"""How close the gist MLP's k = 64 step is to the accumulator's memory-traffic bound.

With micro-batches of one example, each micro-step's gradient is an outer product and its work
is tiny; what every micro-step cannot avoid is reading and writing the parameter-sized
accumulator. The bound: a ``lax.fori_loop`` of 64 iterations that only reads and writes an
accumulator of the parameters' size (one flat buffer, ``acc * s + 1``), nothing else. Timed
interleaved with ``jaxaccum.train_step`` (SGD, k = 64), the full batch and
``optax.MultiSteps``' 64 calls, medians; writes results/accumulator_bound.json.

    python benchmarks/accumulator_bound.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from _common import GIST, LR, loss, machine, save

import jaxaccum

K = 64


def bound_step() -> Any:
    """64 passes over a parameter-sized accumulator, each reading and writing all of it (one
    multiply-add per element, one fusion per iteration, in a loop XLA cannot fold): the floor
    of 64 micro-steps (jaxaccum's has one fusion per parameter leaf, 4 here)."""
    sizes = GIST.sizes

    def step(scale: jax.Array) -> Any:
        def body(i: jax.Array, acc: jax.Array) -> jax.Array:
            return acc * scale + 1.0

        size = sum(m * n + n for m, n in zip(sizes[:-1], sizes[1:], strict=True))
        return jax.lax.fori_loop(0, K, body, jnp.zeros(size))  # one flat buffer: one fusion

    return jax.jit(step), (jnp.float32(0.5),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    params, batch = GIST.params(), GIST.data()
    opt = optax.sgd(LR)
    acc = jaxaccum.train_step(loss, opt, num_microbatches=K, donate=False)
    full = jaxaccum.train_step(loss, opt, num_microbatches=1, donate=False)
    multi = optax.MultiSteps(opt, every_k_schedule=K)

    def multi_step(p: Any, s: Any, b: Any) -> Any:
        updates, s = multi.update(jax.grad(loss)(p, b), s, p)
        return optax.apply_updates(p, updates), s

    multi_call = jax.jit(multi_step)
    bound, bound_args = bound_step()
    state, mstate = opt.init(params), multi.init(params)
    micro = [jax.tree.map(lambda x, i=i: x[i : i + 1], batch) for i in range(K)]

    def run_multi() -> Any:
        p, s = params, mstate
        for b in micro:
            p, s = multi_call(p, s, b)
        return p

    ways = {
        "accumulator bound (64 passes)": lambda: bound(*bound_args),
        "jaxaccum.train_step k=64": lambda: acc(params, state, batch),
        "full batch": lambda: full(params, state, batch),
        "optax.MultiSteps (64 calls)": run_multi,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for fn in ways.values():  # compile and warm up
        for _ in range(3):
            jax.block_until_ready(fn())
    for _ in range(args.rounds):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append((time.perf_counter() - t0) * 1e3)
    med = {name: statistics.median(t) for name, t in times.items()}
    floor = med["accumulator bound (64 passes)"]
    result = {
        "machine": machine(),
        "rounds": args.rounds,
        "model": GIST.name,
        "ms": med,
        "x_bound": {name: m / floor for name, m in med.items()},
        "param_bytes": GIST.param_bytes(),
    }
    for name, m in med.items():
        print(f"{name:40s} {m:7.3f} ms  ({m / floor:.2f}x the bound)")
    print("wrote", save("accumulator_bound", result))


if __name__ == "__main__":
    main()
