"""Prints the saved benchmark results (benchmarks/results/*.json) as Markdown tables.

Reads only the JSON files (no JAX; a second or so): speed, memory, plan, data_parallel and
dropout; the model families (``models.json``, families.py), the README's targets for them
(CPU only: from ``models_cnn_r12``, ``models_cnn_r30``, ``models_transformer_r8``,
``models_mlp_r600``, ``models`` and ``models_compile``) and the loop study (``models_loops``,
loops.py). Writes nothing.

    python benchmarks/report.py                          # the CPU results
    python benchmarks/report.py gpu                      # results/*-gpu.json (benchmarks/gpu.sh)
    python benchmarks/report.py --models models_cnn_r12  # one model-family run's tables only
"""

from __future__ import annotations

import argparse
import json
import pathlib
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


# --- the model families (families.py), their targets, the loop study (loops.py) ---------------

FULL, STEP, LOOP = "full batch", "jaxaccum.train_step", "Python loop"


def _ms(ms: float) -> str:
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def _where(results: dict[str, Any], name: str) -> str:
    m = results["machine"]
    return f"`{name}.json`: {m['backend']}, {m['cpu_count']} CPUs, jax {m['jax']}"


def families(results: dict[str, Any], name: str) -> None:
    """Per family: ms per step (ratios), then temp MiB and compile seconds, per way and k."""
    for entry in results["families"].values():
        by_k = {int(k): row for k, row in entry["by_k"].items()}
        names = list(by_k[min(by_k)])
        mib, P = 2**20, entry["param_bytes"]
        A = entry["full_temp_bytes"]
        print(
            f"\n**{entry['name']}** ({_where(results, name)}, {entry['rounds']} rounds): "
            f"ms per step (x full batch, x Python loop); {entry['unit']}/s in the plot\n"
        )
        rows = []
        for k, row in sorted(by_k.items()):
            cells = [
                f"{_ms(v['ms'])} ({v['ratio_to_full']:.2f}x, {v['ratio_to_loop']:.2f}x)"
                for v in row.values()
            ]
            rows.append([str(k), *cells])
        print(table(["k", *names], rows))
        A0 = entry.get("full_temp_bytes_undonated") or A
        print(
            f"\ntemp MiB with params donated (without), P = {P / mib:.2f} MiB, A = "
            f"{A / mib:.2f} ({A0 / mib:.2f}) MiB: the full batch's temp; compile s\n"
        )
        rows = []
        for k, row in sorted(by_k.items()):
            t, t0 = (1.1 * P + 1.2 * A / k) / mib, (1.1 * P + 1.2 * A0 / k) / mib
            target = f"{t:.2f} ({t0:.2f})"
            cells = []
            for v in row.values():
                undonated = v.get("temp_bytes_undonated")
                extra = "" if undonated is None else f" ({undonated / mib:.2f})"
                cells.append(f"{v['temp_bytes'] / mib:.2f}{extra} / {v['compile_s']:.1f}s")
            rows.append([str(k), target, *cells])
        print(table(["k", "1.1P+1.2A/k", *names], rows))


def _by_k(results: dict[str, Any], key: str) -> dict[int, Any]:
    return {int(k): row for k, row in results["families"][key]["by_k"].items()}


def targets() -> None:
    """The issue's targets, each from the run that decides it: the CNN, transformer and gist
    MLP speed ratios from the repeat runs (``models_cnn_r12``, ``models_cnn_r30`` where the
    ratio is close, ``models_transformer_r8``, ``models_mlp_r600``), bf16 and temp bytes from
    ``models``, compile times from ``models_compile``."""
    rows = []
    for key, name in (
        ("cnn", "models_cnn_r12"),
        ("cnn", "models_cnn_r30"),
        ("transformer", "models_transformer_r8"),
        ("transformer_bf16", "models"),
    ):
        results = load(name)
        if not results or key not in results["families"]:
            continue
        batch = results["families"][key]["batch"]
        cells = []
        for k, row in sorted(_by_k(results, key).items()):
            if batch // k < 4:
                continue
            ratio = row[STEP]["ms"] / min(row[FULL]["ms"], row[LOOP]["ms"])
            cells.append(f"k={k}: {ratio:.2f}")
        rounds = results["families"][key]["rounds"]
        rows.append(
            [f"{key}: train_step / min(full, loop)", f"`{name}.json` ({rounds} rounds)", *cells]
        )
    mlp = load("models_mlp_r600")
    if mlp:
        rows_k = _by_k(mlp, "mlp")
        rounds = mlp["families"]["mlp"]["rounds"]
        where = f"`models_mlp_r600.json` ({rounds} rounds)"
        rows.append(
            ["mlp: train_step / full (k <= 8)", where]
            + [f"k={k}: {rows_k[k][STEP]['ratio_to_full']:.2f}" for k in (1, 2, 4, 8)]
        )
        ms = rows_k[64]
        rows.append(
            ["mlp k=64: optax.MultiSteps / train_step", where]
            + [f"{ms['optax.MultiSteps']['ms'] / ms[STEP]['ms']:.1f}x faster"]
        )
    compiled = load("models_compile")
    if compiled:
        for key, entry in compiled["families"].items():
            ks = sorted(int(k) for k in entry["by_k"])
            lo, hi = (entry["by_k"][str(k)]["min_s"] for k in (ks[0], ks[-1]))
            rows.append(
                [
                    f"{key}: compile s (min of {compiled['repeats']}), k={ks[-1]} / k={ks[0]}",
                    "`models_compile.json`",
                    f"{hi:.2f} / {lo:.2f} = {hi / lo:.2f}",
                ]
            )
    results = load("models")
    if results:
        for key, entry in results["families"].items():
            rk = _by_k(results, key)
            P, A = entry["param_bytes"], entry["full_temp_bytes"]
            A0 = entry.get("full_temp_bytes_undonated") or A
            cells, below = [], []
            for k, row in sorted(rk.items()):
                t, t0 = row[STEP]["temp_bytes"], row[STEP].get("temp_bytes_undonated")
                cell = f"k={k}: {t / (1.1 * P + 1.2 * A / k):.2f}"
                if t0:
                    cell += f" ({t0 / (1.1 * P + 1.2 * A0 / k):.2f})"
                cells.append(cell)
                if "optax.microbatching" in row and k > 1:
                    mb = row["optax.microbatching"]
                    below.append(f"k={k}: {t / mb['temp_bytes']:.2f}")
            rows.append([f"{key}: temp / (1.1P + 1.2A/k), donated (not)", "`models.json`", *cells])
            if below:
                rows.append([f"{key}: temp / optax.microbatching's", "`models.json`", *below])
            ks = sorted(k for k in rk if k >= 2)
            if len(ks) >= 2 and not compiled:
                lo, hi = rk[ks[0]][STEP]["compile_s"], rk[ks[-1]][STEP]["compile_s"]
                rows.append(
                    [f"{key}: compile s, k={ks[-1]} / k={ks[0]}", "`models.json`"]
                    + [f"{hi:.2f} / {lo:.2f} = {hi / lo:.2f}"]
                )
    width = max(len(r) for r in rows) if rows else 0
    rows = [r + [""] * (width - len(r)) for r in rows]
    print("\n**targets** (ratios; each row from the JSON named)\n")
    print(table(["target", "from", *[""] * (width - 2)], rows))


def loop_study(loops: dict[str, Any], name: str) -> None:
    """The loop study's tables: ms (x full batch) / temp MiB per way and k; compile seconds."""
    for model in ("cnn", "mlp"):
        by_k = {int(k): row for k, row in loops[model]["by_k"].items()}
        names = list(dict.fromkeys(n for _, row in sorted(by_k.items()) for n in row))
        old = any("proposed" in n for n in names)
        print(
            f"\n**loop study, {loops[model]['model']}** ({_where(loops, name)}): ms (x full "
            "batch) / temp MiB"
            + (
                "; measured before a4b2f71 by benchmarks/models.py loops: `jaxaccum` is the "
                "library as it was, `proposed` the prototype of what the library is now"
                if old
                else ""
            )
            + "\n"
        )
        rows = []
        for k, row in sorted(by_k.items()):
            rows.append(
                [str(k)]
                + [
                    f"{_ms(row[n]['ms'])} ({row[n]['ratio_to_full']:.2f}x) / "
                    f"{row[n]['temp_bytes'] / 2**20:.2f}"
                    if n in row
                    else ""
                    for n in names
                ]
            )
        print(table(["k", *names], rows))
    for model, rows_by_name in loops.get("compile", {}).items():
        print(f"\n**compile seconds ({model}, value_and_grad), min over repeats**\n")
        print(
            table(
                ["way", "k=2", "k=8", "k=64", "k=64 / k=2"],
                [
                    [
                        way,
                        *(f"{row[str(k)]['min_s']:.2f}" for k in (2, 8, 64)),
                        f"{row['ratio_64_to_2']:.2f}",
                    ]
                    for way, row in rows_by_name.items()
                ],
            )
        )


def models(name: str, suffix: str, with_targets: bool) -> None:
    """The model families' tables of results/NAME(-SUFFIX).json, then (CPU) the targets and
    the loop study."""
    results = load(name, suffix)
    if results:
        print(f"\n### model families ({name}{suffix}.json)")
        families(results, name + suffix)
    if with_targets:
        targets()
    loops = load("models_loops", suffix)
    if loops and with_targets:
        loop_study(loops, "models_loops" + suffix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suffix", nargs="?", default="",
                        help="read results/NAME-SUFFIX.json (gpu: benchmarks/gpu.sh's results)")
    parser.add_argument("--models", metavar="NAME",
                        help="print only the model-family tables of results/NAME.json")
    args = parser.parse_args()
    suffix = f"-{args.suffix}" if args.suffix else ""
    if args.models:
        models(args.models, suffix, with_targets=False)
        return
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
    models("models", suffix, with_targets=not suffix)


if __name__ == "__main__":
    main()
