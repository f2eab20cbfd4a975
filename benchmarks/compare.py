"""Side-by-side tables: a commit's speed.json, models.json and sharded.json against the ones in
benchmarks/results now (the old from ``git show REV:benchmarks/results/NAME.json``).

Every number printed comes from those JSON files: speed and models compare ratios to the full
batch measured in the same rounds (what the scripts interleave for); sharded compares bytes
from the compiled programs (collectives executed per step, the reductions among them, the
reductions inside loop bodies, temp bytes per device). The output is Markdown
(benchmarks/notes/pipeline_rewrite.md was written from it).

    python benchmarks/compare.py 6c39e43
    python benchmarks/compare.py 6c39e43 --only sharded
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import subprocess
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
REDUCTIONS = ("all-reduce", "reduce-scatter")


def load_old(rev: str, name: str) -> dict[str, Any]:
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:benchmarks/results/{name}.json"],
        capture_output=True, text=True, check=True,
    ).stdout
    return json.loads(text)


def load_new(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def machine_line(label: str, results: dict[str, Any], extra: str = "") -> str:
    m = results["machine"]
    devices = len(m["devices"])
    return (f"{label}: {m['backend']}, {devices} device{'s' * (devices > 1)}, "
            f"{m['cpu_count']} CPUs ({m['processor']}), jax {m['jax']}, optax {m['optax']}"
            + (f", {extra}" if extra else ""))


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def change_summary(pairs: dict[str, list[tuple[float, float]]]) -> list[str]:
    """Per implementation: the geometric mean of new / old over its rows, and the range."""
    out = []
    for name, values in pairs.items():
        rel = [new / old for old, new in values if old and new]
        if rel:
            out.append(f"- {name}: new/old geometric mean {geomean(rel):.2f} "
                       f"(min {min(rel):.2f}, max {max(rel):.2f}, {len(rel)} rows)")
    return out


# --- speed.py ---------------------------------------------------------------------------------


def speed(rev: str) -> None:
    old, new = load_old(rev, "speed"), load_new("speed")
    print("### speed.py: ratio of median step time to the full batch (same rounds)\n")
    print(machine_line(f"old ({rev})", old))
    print()
    print(machine_line("new", new))
    print()
    rows, pairs = [], {}
    for key, entry in new["models"].items():
        old_entry = old["models"].get(key, {"by_k": {}})
        for k, row in entry["by_k"].items():
            old_row = old_entry["by_k"].get(str(k), {})
            for impl, v in row.items():
                if impl == "full batch":
                    continue
                o = old_row.get(impl, {}).get("ratio_to_full")
                n = v["ratio_to_full"]
                rows.append([key, str(k), impl, ratio(o), ratio(n),
                             ratio(n / o if o else None)])
                pairs.setdefault(f"{key} {impl}", []).append((o, n))
        print(f"{entry['name']}: {old_entry.get('rounds')} rounds old, {entry['rounds']} new.  ")
    print()
    print(table(["model", "k", "implementation", "old x full", "new x full", "new / old"], rows))
    print()
    print("\n".join(change_summary(pairs)))
    print()


# --- families.py (results/models.json) ------------------------------------------------------------


def models(rev: str) -> None:
    old, new = load_old(rev, "models"), load_new("models")
    print("### models (families.py): ratio to the full batch (same rounds); temp MiB "
          "(memory_analysis, params donated)\n")
    print(machine_line(f"old ({rev})", old))
    print()
    print(machine_line("new", new))
    print()
    rows, pairs, temps = [], {}, {}
    for key, entry in new["families"].items():
        old_entry = old["families"].get(key, {"by_k": {}})
        print(f"{key}: {entry['name']}; {old_entry.get('rounds')} rounds old, "
              f"{entry['rounds']} new.  ")
        for k, row in entry["by_k"].items():
            old_row = old_entry["by_k"].get(str(k), {})
            for way, v in row.items():
                if way == "full batch":
                    continue
                o = old_row.get(way, {})
                ro, rn = o.get("ratio_to_full"), v["ratio_to_full"]
                to, tn = o.get("temp_bytes"), v["temp_bytes"]
                rows.append([key, str(k), way, ratio(ro), ratio(rn), ratio(rn / ro if ro else None),
                             "-" if to is None else f"{to / 2**20:.2f}", f"{tn / 2**20:.2f}"])
                pairs.setdefault(f"{key} {way}", []).append((ro, rn))
                if to is not None:
                    temps.setdefault(f"{key} {way}", []).append((to, tn))
    print()
    print(table(["family", "k", "way", "old x full", "new x full", "new / old", "old temp MiB",
                 "new temp MiB"], rows))
    print("\nSpeed, new / old ratio to full:\n")
    print("\n".join(change_summary(pairs)))
    print("\nTemp bytes, new / old:\n")
    print("\n".join(change_summary(temps)))
    print()


# --- sharded.py -------------------------------------------------------------------------------


def _sharded_cells(r: dict[str, Any] | None) -> tuple[Any, ...]:
    """(collective bytes/step, reduction bytes/step, reductions in loop bodies (program),
    temp bytes), or Nones for a missing or failed case."""
    if r is None or "error" in r:
        return (None, None, None, None)
    s = r["per_step"]
    reduce_bytes = sum(s["by_op"][op]["bytes"] for op in REDUCTIONS)
    in_loop = sum(1 for o in r["program_collectives"] if o["in_loop"] and o["op"] in REDUCTIONS)
    return (s["bytes"], reduce_bytes, in_loop, r["temp_bytes"])


def _bytes(x: Any) -> str:
    if x is None:
        return "-"
    if x >= 2**20:
        return f"{x / 2**20:.2f} MB"
    return f"{x / 2**10:.1f} KB" if x >= 2**10 else f"{x:.0f} B"


def sharded(rev: str) -> None:
    old, new = load_old(rev, "sharded"), load_new("sharded")
    print("### sharded.py: per optimizer step, from the compiled programs (8 host devices)\n")
    for label, r in ((f"old ({rev})", old), ("new", new)):
        src = r.get("source", {})
        print(machine_line(label, r, f"jaxaccum at {src.get('commit', '?')[:7]}"
                           + (" + uncommitted changes" if src.get("uncommitted_changes") else "")))
        print()
    rows, changed = [], []
    worst = {"old": 0.0, "new": 0.0}
    ways = ("full batch", "jaxaccum step", "jaxaccum microbatch", "naive scan",
            "optax.MultiSteps")
    for group, entry in new["by_mesh"].items():
        old_entry = old["by_mesh"].get(group, {"by_k": {}, "full": None})
        keys = [("1", "full batch")] + [(k, w) for k in entry["by_k"] for w in ways[1:]]
        for k, way in keys:
            if way == "full batch":
                n, o = entry["full"], old_entry.get("full")
            else:
                n = entry["by_k"].get(k, {}).get(way)
                o = old_entry["by_k"].get(k, {}).get(way)
            if n is None and o is None:
                continue
            oc, nc = _sharded_cells(o), _sharded_cells(n)
            diffs = [f"{label} {nv - ov:+,d}" for label, ov, nv in
                     zip(("collective B", "reduction B", "in-loop", "temp B"), oc, nc, strict=True)
                     if ov is not None and nv is not None and ov != nv]
            if not diffs and oc != nc:
                diffs = ["missing on one side"]
            if diffs:
                changed.append(f"{group} k={k} {way}")
            rows.append([group, "-" if way == "full batch" else k, way,
                         f"{_bytes(oc[0])} / {_bytes(nc[0])}",
                         f"{_bytes(oc[1])} / {_bytes(nc[1])}",
                         f"{'-' if oc[2] is None else oc[2]} / {'-' if nc[2] is None else nc[2]}",
                         f"{_bytes(oc[3])} / {_bytes(nc[3])}",
                         ", ".join(diffs) or "same"])
            if n is not None and "error" in n:
                rows[-1][-1] += f" (new error: {n['error'][:60]})"
            for label, r in (("old", o), ("new", n)):
                if r is not None and way.startswith("jaxaccum"):
                    err = r.get("params_rel_to_full_update")
                    if err is not None:
                        worst[label] = max(worst[label], err)
    print(table(["mesh/axes", "k", "way", "collective bytes/step old / new",
                 "reduction (AR+RS) bytes/step old / new", "reductions in loop body old / new",
                 "temp old / new", "new - old (exact bytes)"], rows))
    print(f"\n{len(rows) - len(changed)} of {len(rows)} rows identical in all four; changed: "
          + (", ".join(changed) or "none"))
    print(f"\nLargest |params after one step - full batch's| / |full-batch update| over the "
          f"jaxaccum rows: old {worst['old']:.1e}, new {worst['new']:.1e}.")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the commit whose results/*.json are 'old'")
    parser.add_argument("--only", nargs="+", default=["speed", "models", "sharded"],
                        choices=["speed", "models", "sharded"])
    args = parser.parse_args()
    for name in args.only:
        {"speed": speed, "models": models, "sharded": sharded}[name](args.rev)


if __name__ == "__main__":
    main()
