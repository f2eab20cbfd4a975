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
from _common import IMPLS, KS, MODELS, RESULTS, Full, machine, save


def time_k(model: Any, k: int, rounds: int, warmup: int) -> dict[str, float]:
    params, batch = model.params(), model.data()
    impls = [cls(k) for cls in IMPLS.values()]
    inputs = [(impl, impl.init(params), impl.prepare(batch)) for impl in impls]
    times: dict[str, list[float]] = {impl.name: [] for impl in impls}
    for r in range(warmup + rounds):
        for impl, state, data in inputs:
            start = time.perf_counter()
            jax.block_until_ready(impl.step(params, state, data))
            if r >= warmup:
                times[impl.name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--ks", nargs="+", type=int, default=list(KS))
    parser.add_argument("--rounds", type=int, default=None, help="default: gist 40, compute 5")
    args = parser.parse_args()

    results: dict[str, Any] = {"machine": machine(), "models": {}}
    for key in args.models:
        model = MODELS[key]
        rounds = args.rounds or (40 if key == "gist" else 5)
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
    print(f"wrote {path} and {RESULTS / 'speed.png'}")


def plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = results["models"]
    fig, axes = plt.subplots(1, len(entries), figsize=(6 * len(entries), 4), squeeze=False)
    for ax, (_, entry) in zip(axes[0], entries.items(), strict=True):
        ks = sorted(entry["by_k"])
        for name in IMPLS:
            ax.plot(ks, [entry["by_k"][k][name]["ms"] for k in ks], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("k (micro-batches per optimizer step)")
        ax.set_ylabel("median ms per optimizer step")
        ax.set_title(entry["name"])
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "speed.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
