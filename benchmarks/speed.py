"""Time per optimizer step, k = 1..64, for every implementation, side by side.

Implementations are interleaved round by round (each round times one step of each), so slow
drifts of the machine hit all of them alike; we report medians and ratios to the full batch
measured in the same rounds. Writes benchmarks/results/speed.json and speed.png.

    python benchmarks/speed.py                    # both models, all k
    python benchmarks/speed.py --models gist --rounds 50
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
from _common import IMPLS, KS, MODELS, Full, machine, plot_by_k, result_path, save


def time_k(model: Any, k: int, rounds: int, warmup: int) -> dict[str, float]:
    params, batch = model.params(), model.data()
    impls = [cls(k) for cls in IMPLS.values()]
    # each implementation trains its own copy, outputs threaded through (some donate)
    carry = [[jax.tree.map(jnp.copy, params), impl.init(params)] for impl in impls]
    data = [impl.prepare(batch) for impl in impls]
    times: dict[str, list[float]] = {impl.name: [] for impl in impls}
    for r in range(warmup + rounds):
        for impl, c, d in zip(impls, carry, data, strict=True):
            start = time.perf_counter()
            out = jax.block_until_ready(impl.step(c[0], c[1], d))
            if r >= warmup:
                times[impl.name].append(time.perf_counter() - start)
            c[0], c[1] = out[0], out[1]
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--ks", nargs="+", type=int, default=list(KS))
    parser.add_argument("--rounds", type=int, default=None, help="default: gist 40, compute 9")
    args = parser.parse_args()

    results: dict[str, Any] = {"machine": machine(), "models": {}}
    for key in args.models:
        model = MODELS[key]
        rounds = args.rounds or (40 if key == "gist" else 9)
        rows = {}
        for k in args.ks:
            med = time_k(model, k, rounds, warmup=2)
            full = med[Full.name]
            rows[k] = {name: {"ms": t * 1e3, "ratio_to_full": t / full} for name, t in med.items()}
            print(
                f"{model.name}  k={k:3d}  "
                + "  ".join(
                    f"{name}: {t * 1e3:8.2f} ms ({t / full:5.2f}x)" for name, t in med.items()
                ),
                flush=True,
            )
        results["models"][key] = {"name": model.name, "rounds": rounds, "by_k": rows}
    path = save("speed", results)
    plot(results)
    print(f"wrote {path} and {result_path('speed', 'png')}")


def plot(results: dict[str, Any]) -> None:
    def series(entry: dict[str, Any], ks: list[int]) -> list[Any]:
        return [(name, ks, [entry["by_k"][k][name]["ms"] for k in ks], "-") for name in IMPLS]

    plot_by_k(
        results["models"], series, "median ms per optimizer step", result_path("speed", "png")
    )


if __name__ == "__main__":
    main()
