"""Memory per optimizer step: XLA's compile-time analysis and the measured peak, k = 1..64.

For every implementation and k: temp, argument, output and alias bytes of the program XLA runs
(for per-call ways, the per-micro-batch program, whose arguments include the persistent
accumulator), against the target temp <= 1.1 P + 1.2 A / k (P parameter bytes, A the full
batch's temp bytes). The measured peak runs each (implementation, k) of the compute-bound model
in a fresh process: on CPU the peak resident-set growth during one step (sampled every 0.2 ms,
large allocations forced to mmap so freed memory leaves the RSS); on a GPU the device's
peak_bytes_in_use. Also remat: temp bytes and step time of jaxaccum.train_step with the loss
as it is (off), wrapped in ``jax.checkpoint`` by hand (on), and with the dots_saveable policy
(the ``remat=`` option these rows measured before 0ec3eda is gone: the wrapper is what it did,
around each micro-batch's loss). Writes benchmarks/results/memory.json and memory.png.

    python benchmarks/memory.py
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import jax
from _common import (
    IMPLS,
    KS,
    MODELS,
    Full,
    TrainStep,
    loss,
    machine,
    plot_by_k,
    result_path,
    save,
)

import jaxaccum

MEASURED = (
    "full batch",
    "jaxaccum.train_step",
    "optax.microbatching",
    "optax.MultiSteps",
    "jaxaccum.multi_steps",
)


def analysis(impl: Any, params: Any, batch: Any) -> dict[str, int]:
    state = impl.init(params)
    ma = impl.lower(params, state, impl.prepare(batch)).compile().memory_analysis()
    return {
        "temp": ma.temp_size_in_bytes,
        "argument": ma.argument_size_in_bytes,
        "output": ma.output_size_in_bytes,
        "alias": ma.alias_size_in_bytes,
    }


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(impl_name: str, k: int, model_key: str) -> dict[str, Any]:
    """Runs one step of one implementation in this (fresh) process and reports its peak.

    The program is compiled ahead of time and the compiler's memory handed back to the system
    (malloc_trim) before the baseline is read, so the growth is the step's own buffers.
    """
    model = MODELS[model_key]
    impl = IMPLS[impl_name](k)
    params, batch = model.params(), model.data()
    state, data = impl.init(params), impl.prepare(batch)
    compiled = impl.lower(params, state, data).compile()

    def run() -> Any:
        if not impl.per_call:
            return compiled(params, state, data)
        p, s = params, state
        for micro in data:
            p, s = compiled(p, s, micro)
        return p

    device = jax.devices()[0]
    if device.platform != "cpu":
        jax.block_until_ready(run())
        stats = device.memory_stats() or {}
        return {"peak_bytes": stats.get("peak_bytes_in_use"), "how": "device peak_bytes_in_use"}
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base, peak, done = rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    jax.block_until_ready(run())
    done.set()
    sampler.join()
    return {"peak_bytes": max(peak[0] - base, 0), "how": "CPU RSS growth during one step"}


def measure(impl_name: str, k: int, model_key: str) -> Any:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run(
        [sys.executable, __file__, "--child", impl_name, str(k), model_key],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


def remat_rows(model: Any, ks: list[int], rounds: int = 3) -> dict[int, dict[str, Any]]:
    params, batch = model.params(), model.data()
    variants = {"off": False, "on": True, "dots_saveable": jax.checkpoint_policies.dots_saveable}
    rows: dict[int, dict[str, Any]] = {}
    for k in ks:
        rows[k] = {}
        for name, remat in variants.items():
            impl = TrainStep(k)
            if remat is not False:  # the loss wrapped by hand, as remat= did
                policy = None if remat is True else remat
                checkpointed = jax.checkpoint(loss, policy=policy)
                impl.fn = jaxaccum.train_step(
                    checkpointed, impl.optimizer, num_microbatches=k, donate=False
                )
            state = impl.init(params)
            temp = impl.lower(params, state, batch).compile().memory_analysis().temp_size_in_bytes
            jax.block_until_ready(impl.step(params, state, batch))
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                jax.block_until_ready(impl.step(params, state, batch))
                times.append(time.perf_counter() - start)
            rows[k][name] = {"temp": temp, "ms": statistics.median(times) * 1e3}
        print(
            f"remat k={k:3d} "
            + "  ".join(
                f"{n}: temp {r['temp'] / 2**20:7.2f} MiB {r['ms']:8.2f} ms"
                for n, r in rows[k].items()
            ),
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "K", "MODEL"), help=argparse.SUPPRESS)
    parser.add_argument("--ks", nargs="+", type=int, default=list(KS))
    parser.add_argument("--no-measure", action="store_true", help="compile-time analysis only")
    args = parser.parse_args()
    if args.child:
        impl_name, k, model_key = args.child
        print(json.dumps(child(impl_name, int(k), model_key)))
        return

    results: dict[str, Any] = {"machine": machine(), "models": {}}
    for key, model in MODELS.items():
        params, batch = model.params(), model.data()
        P = model.param_bytes()
        A = analysis(Full(1), params, batch)["temp"]
        rows: dict[int, Any] = {}
        for k in args.ks:
            rows[k] = {"target_temp": 1.1 * P + 1.2 * A / k}
            for name, cls in IMPLS.items():
                rows[k][name] = analysis(cls(k), params, batch)
                if key == "compute" and name in MEASURED and not args.no_measure:
                    rows[k][name]["measured_peak"] = measure(name, k, key)
            ours = rows[k]["jaxaccum.train_step"]["temp"]
            print(
                f"{model.name} k={k:3d}  target {rows[k]['target_temp'] / 2**20:8.2f} MiB  "
                + "  ".join(
                    f"{n}: temp {rows[k][n]['temp'] / 2**20:7.2f}"
                    + (
                        f" peak {rows[k][n]['measured_peak'] / 2**20:7.2f}"
                        if "measured_peak" in rows[k][n]
                        else ""
                    )
                    for n in IMPLS
                )
                + f"  ours within target: {ours <= rows[k]['target_temp']}",
                flush=True,
            )
        results["models"][key] = {
            "name": model.name,
            "param_bytes": P,
            "full_temp": A,
            "by_k": rows,
        }
    results["remat"] = {
        "model": MODELS["compute"].name,
        "by_k": remat_rows(MODELS["compute"], [k for k in args.ks if k in (1, 8, 64)]),
    }
    path = save("memory", results)
    plot(results)
    print(f"wrote {path} and {result_path('memory', 'png')}")


def plot(results: dict[str, Any]) -> None:
    mib = 2**20

    def series(entry: dict[str, Any], ks: list[int]) -> list[Any]:
        rows = entry["by_k"]
        out = [(f"{n} (temp)", ks, [rows[k][n]["temp"] / mib for k in ks], "-") for n in IMPLS]
        out.append(
            ("target 1.1 P + 1.2 A / k", ks, [rows[k]["target_temp"] / mib for k in ks], "k--")
        )
        measured = [k for k in ks if "measured_peak" in rows[k]["jaxaccum.train_step"]]
        if measured:
            peaks = [rows[k]["jaxaccum.train_step"]["measured_peak"] / mib for k in measured]
            out.append(("jaxaccum.train_step measured peak", measured, peaks, "r:"))
        return out

    plot_by_k(results["models"], series, "MiB", result_path("memory", "png"))


if __name__ == "__main__":
    main()
