"""Prints the saved benchmark results (benchmarks/results/*.json) as Markdown tables.

python benchmarks/report.py          # the CPU results
python benchmarks/report.py gpu      # results/*-gpu.json (benchmarks/gpu.sh)

The model families and the loop study: ``python benchmarks/models.py report``.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
IMPLS = (
    "full batch",
    "jaxaccum.train_step",
    "jaxaccum.multi_steps",
    "optax.MultiSteps",
    "optax.microbatching",
    "naive Python loop",
)


def load(name: str, suffix: str = "") -> dict[str, Any] | None:
    path = RESULTS / f"{name}{suffix}.json"
    return json.loads(path.read_text()) if path.exists() else None


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def speed(results: dict[str, Any]) -> None:
    for entry in results["models"].values():
        print(f"\n**{entry['name']}**: median ms per optimizer step (ratio to the full batch)\n")
        rows = []
        for k, row in sorted(entry["by_k"].items(), key=lambda kv: int(kv[0])):
            rows.append(
                [k] + [f"{row[n]['ms']:.2f} ({row[n]['ratio_to_full']:.2f}x)" for n in IMPLS]
            )
        print(table(["k", *IMPLS], rows))


def memory(results: dict[str, Any]) -> None:
    mib = 2**20
    for entry in results["models"].values():
        print(
            f"\n**{entry['name']}**: temp MiB from `memory_analysis()` (measured peak MiB); "
            f"P = {entry['param_bytes'] / mib:.2f} MiB, A = {entry['full_temp'] / mib:.2f} MiB\n"
        )
        rows = []
        for k, row in sorted(entry["by_k"].items(), key=lambda kv: int(kv[0])):
            cells = []
            for n in IMPLS:
                cell = f"{row[n]['temp'] / mib:.2f}"
                if "measured_peak" in row[n]:
                    cell += f" ({row[n]['measured_peak'] / mib:.1f})"
                cells.append(cell)
            rows.append([k, f"{row['target_temp'] / mib:.2f}", *cells])
        print(table(["k", "target 1.1P+1.2A/k", *IMPLS], rows))
    if "remat" in results:
        print(f"\n**remat** ({results['remat']['model']}): temp MiB / ms per step\n")
        rows = []
        for k, row in sorted(results["remat"]["by_k"].items(), key=lambda kv: int(kv[0])):
            rows.append([k] + [f"{v['temp'] / mib:.2f} / {v['ms']:.0f}" for v in row.values()])
        names = list(next(iter(results["remat"]["by_k"].values())))
        print(table(["k", *(f"remat={n}" for n in names)], rows))


def plan(results: dict[str, Any]) -> None:
    mib = 2**20
    print(f"\n**plan_microbatches** ({results['model']}, budget covers the whole train step)\n")
    rows = [
        [
            f"{p['budget'] / mib:.0f}",
            str(p["chosen"]),
            f"{p['estimate'] / mib:.1f}",
            f"{p['measured_peak'] / mib:.1f}",
            str(p["measured_peak"] <= p["budget"]),
        ]
        if p["chosen"]
        else [f"{p['budget'] / mib:.0f}", "error", "-", "-", "-"]
        for p in results["rows"]
    ]
    print(table(["budget MiB", "chosen k", "estimate MiB", "measured peak MiB", "within"], rows))


def data_parallel(results: dict[str, Any]) -> None:
    print(
        f"\n**{results['model']}**, {results['devices']} devices: collectives executed per "
        "optimizer step, and median ms per step\n"
    )
    names = list(next(iter(results["by_k"].values())))
    rows = []
    for k, row in sorted(results["by_k"].items(), key=lambda kv: int(kv[0])):
        rows.append(
            [k]
            + [
                f"{row[n]['per_step']['all-reduce']} all-reduce, "
                f"{row[n]['per_step']['all-gather']} all-gather, {row[n]['ms']:.2f} ms"
                for n in names
            ]
        )
    print(table(["k", *names], rows))


def dropout(results: dict[str, Any]) -> None:
    by_impl = results["by_impl"]
    first = next(iter(by_impl.values()))
    masks = list(next(iter(next(iter(first["models"].values())).values())))
    print(
        f"\n**per-example dropout**: ms per step (ratio to one key per micro-batch), "
        f"{results['rounds']} rounds; k-invariant: the masks are equal split in 1 or 8\n"
    )
    rows = []
    for impl, out in by_impl.items():
        for model, table_ in out["models"].items():
            for way, row in table_.items():
                cells = [f"{row[m]['ms']:.1f} ({row[m]['ratio_to_baseline']:.2f}x)" for m in masks]
                rows.append([impl, model.split(",")[0], way, *cells])
        rows.append([impl, "k-invariant", ""] + [str(out["invariance"].get(m, "")) for m in masks])
    print(table(["PRNG", "model", "way", *masks], rows))


def main() -> None:
    suffix = f"-{sys.argv[1]}" if len(sys.argv) > 1 else ""
    for name, fn in (
        ("speed", speed),
        ("memory", memory),
        ("plan", plan),
        ("data_parallel", data_parallel),
        ("dropout", dropout),
    ):
        results = load(name, suffix)
        if results:
            print(
                f"\n### {name} ({results['machine']['backend']}, "
                f"{results['machine']['cpu_count']} CPUs, jax {results['machine']['jax']})"
            )
            fn(results)


if __name__ == "__main__":
    main()
