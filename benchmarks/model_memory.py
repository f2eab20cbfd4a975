"""Temp bytes behind the README's memory findings (micro-batch split, zero-weight skip).

Compile only (``memory_analysis()``; nothing runs):

- ``value_and_grad``: the gist MLP's and the CNN's ``jaxaccum.value_and_grad`` at k = 1..64
  with the micro-batches gathered inside the loop (``gather``: the library), cut into
  contiguous blocks before it, or split by a transposed copy before it (``swapaxes``, the
  library before a4b2f71); the last two are variants of the library made by patching its
  split stage while tracing (``_variants.py``); plus the parameter bytes and the full batch's
  temp;
- ``transformer_skip``: the transformer's ``train_step`` at k = 8, with and without donation,
  with its zero-weight skip as the library makes it (since f5b5746 a ``lax.cond`` when params
  and state are donated, a select otherwise) or always as a select (before f62b962; patched
  the same way): temp and output bytes.

Time on 2 cores: ~2-3 min (compiles only; the CNN's 21 and the transformer's 4 dominate, and
it takes longer when other jobs share the cores). Writes ``results/models_memory.json``.

    python benchmarks/model_memory.py
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import jax
from _common import GIST, machine, save
from _common import loss as mlp_loss
from _variants import skip_always_select, variant
from model_zoo import cnn_data, cnn_loss, cnn_params, compile_timed, copy, families, train_step

import jaxaccum

KS = (1, 2, 4, 8, 16, 32, 64)


def measure(lm_batch: int) -> dict[str, Any]:
    out: dict[str, Any] = {"machine": machine(), "value_and_grad": {}, "transformer_skip": {}}
    cases: dict[str, tuple[Any, Any, Any]] = {
        "mlp": (mlp_loss, GIST.params(), GIST.data()),
        "cnn": (cnn_loss, cnn_params(jax.random.key(0)), cnn_data(256)),
    }
    for model, (loss, params, batch) in cases.items():
        rows: dict[str, Any] = {
            "param_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
            "full_temp_bytes": compile_timed(jax.jit(jax.value_and_grad(loss)), params, batch)[2],
        }
        for split in ("gather", "contiguous", "swapaxes"):
            for k in KS:
                fn = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k))
                with variant(split=split):
                    rows.setdefault(split, {})[k] = compile_timed(fn, params, batch)[2]
            print(f"temp {model} {split:10s} {rows[split]}", flush=True)
        out["value_and_grad"][model] = rows
    fam = families(lm_batch)["transformer"]
    skips: dict[str, Any] = {
        "library (f5b5746)": contextlib.nullcontext,
        "select always (before f62b962)": skip_always_select,
    }
    for name, context in skips.items():
        for donate in (True, False):
            params = copy(fam.params)
            state = fam.optimizer.init(params)
            program = train_step(fam, 8, donate=donate)
            with context():
                ma = program.lower(params, state, fam.batch).compile().memory_analysis()
            key = "donated" if donate else "not donated"
            out["transformer_skip"].setdefault(name, {})[key] = {
                "temp_bytes": ma.temp_size_in_bytes,
                "output_bytes": ma.output_size_in_bytes,
            }
        print(f"transformer k=8 {name}: {out['transformer_skip'][name]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-batch", type=int, default=32, help="the transformer's batch")
    args = parser.parse_args()
    print(f"wrote {save('models_memory', measure(args.lm_batch))}")


if __name__ == "__main__":
    main()
