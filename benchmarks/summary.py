"""The one-screen summary that opens the docs' Benchmarks page, from ``results/peers.json``.

One optimizer step at k = 16 micro-batches and at each model's largest k, as a multiple of the
full batch's step time in the same rounds, for jaxaccum and every peer of
``benchmarks/peers.py``; and whether each one's gradient is the full batch's (the padded
token-mean LM is where they differ). ``tests/test_docs.py`` checks that the page shows exactly
what this prints.

    python benchmarks/summary.py
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
PEERS = ("jaxaccum", "python_loop", "optax_multisteps", "optax_microbatching", "maxtext",
         "levanter")
NAMES = {"jaxaccum": "jaxaccum", "python_loop": "Python loop",
         "optax_multisteps": "optax.MultiSteps", "optax_microbatching": "optax microbatching",
         "maxtext": "MaxText", "levanter": "Levanter"}
SHORT = {"gist64": "MLP 784-100-10, batch 64", "gist1024": "MLP 784-100-10, batch 1024",
         "wide": "MLP 784-2048-2048-10, batch 2048", "lm": "decoder LM, token-mean loss",
         "cnn": "CNN + BatchNorm, batch 256"}
# a gradient is the full batch's when its error against the float64 full batch is within this
# factor of the float32 full batch's own error (its rounding; error analysis, not one run)
ROUNDING = 10


def summary(peers: dict[str, Any]) -> str:
    m = peers["machine"]
    head = ["model", "k", *(NAMES[p] for p in PEERS)]
    lines = [
        f"Measured on {m['backend'].upper()}, {m['cpu_count']} cores ({m['processor']}"
        f"), jax {m['jax']}, optax {m['optax']}: one optimizer step (gradient and update) as a "
        "multiple of the full batch's step in the same rounds; lower is better, the best of "
        "each row in bold. A cell marked † computes another gradient than the full batch's: "
        "its error against the float64 full batch is more than "
        f"{ROUNDING} times the float32 full batch's own. One run of `benchmarks/peers.py` "
        f"({min(e['rounds'] for e in peers['models'].values())} to "
        f"{max(e['rounds'] for e in peers['models'].values())} interleaved rounds a model): "
        "differences under about 10 % are within its spread.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + " --- |" * len(head),
    ]
    for key, entry in peers["models"].items():
        ks = sorted(int(k) for k in entry["by_k"])
        for k in sorted({16, ks[-1]} & set(ks)):
            row = entry["by_k"][str(k)]
            best = min(row[p]["ratio_to_full"] for p in PEERS)
            cells = []
            for p in PEERS:
                r = row[p]["ratio_to_full"]
                cell = f"{r:.2f}x"
                cell = f"**{cell}**" if r == best else cell
                other = row[p]["err_true"] > ROUNDING * row["full"]["err_true"]
                cells.append(cell + (" †" if other else ""))
            lines.append(f"| {SHORT.get(key, key)} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    print(summary(json.loads((RESULTS / "peers.json").read_text())), end="")


if __name__ == "__main__":
    main()
