"""plan_microbatches in practice: for several budgets, the chosen k and its measured peak.

For the compute-bound model (batch 8192), each budget is given to jaxaccum.plan_microbatches
(compile-time estimates only: nothing runs, so no out-of-memory trials); then the chosen k is
run once in a fresh process and its peak measured as in memory.py. Writes
benchmarks/results/plan.json.

    python benchmarks/plan.py
"""

from __future__ import annotations

import jax
import optax
from _common import LR, MODELS, loss, machine, save
from memory import measure

import jaxaccum

BUDGETS_MIB = (256, 128, 96, 64, 48)


def main() -> None:
    model = MODELS["compute"]
    params, batch = model.params(), model.data()
    rows = []
    for mib in BUDGETS_MIB:
        budget = mib * 2**20
        try:
            plan = jaxaccum.plan_microbatches(
                loss, params, batch, memory_budget=budget, optimizer=optax.sgd(LR)
            )
        except ValueError as e:
            rows.append({"budget": budget, "chosen": None, "error": str(e)})
            print(f"budget {mib} MiB: {e}", flush=True)
            continue
        k = plan.num_microbatches
        estimate = plan.estimates[k].total_bytes
        peak = measure("jaxaccum.train_step", k, "compute")
        rows.append(
            {
                "budget": budget,
                "chosen": k,
                "estimate": estimate,
                "measured_peak": peak,
                "candidates_compiled": list(plan.estimates),
            }
        )
        print(
            f"budget {mib} MiB: k={k}, estimate {estimate / 2**20:.1f} MiB, measured peak "
            f"{peak / 2**20:.1f} MiB, within budget: {peak <= budget}",
            flush=True,
        )
    save(
        "plan",
        {"machine": machine(), "model": model.name, "backend": jax.default_backend(), "rows": rows},
    )


if __name__ == "__main__":
    main()
