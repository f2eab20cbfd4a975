"""Compile time of ``jaxaccum.train_step`` per model family and k: does it stay flat in k?

Lower + compile seconds of ``jaxaccum.train_step`` (donating, as families.py runs it) for each
family of ``model_zoo.py`` at k = 2, 8 and the largest k that divides its batch (64; the
transformers, batch 32: 32). ``--rounds`` (default 5) fresh jits of every (family, k),
interleaved round by round; the minimum is the least disturbed by other load. Nothing is run,
only compiled.

Time on 2 cores: ~2-3 min (the transformers' ~3 s compiles dominate). Writes
``results/models_compile.json`` (``families.KEY.by_k.K.min_s``/``all_s``, ``ratio_top_to_2``).

    python benchmarks/compile_times.py
    python benchmarks/compile_times.py --families mlp cnn --rounds 3
"""

from __future__ import annotations

import argparse
from typing import Any

from _common import machine, save
from model_zoo import FAMILIES, compile_timed, copy, families, train_step


def measure(keys: list[str], repeats: int, lm_batch: int) -> dict[str, Any]:
    fams = families(lm_batch)
    cases = []
    for key in keys:
        top = max(fams[key].ks())
        cases += [(key, k) for k in (2, 8, top)]
    seconds: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    for _ in range(repeats):
        for key, k in cases:
            fam = fams[key]
            params = copy(fam.params)
            state = fam.optimizer.init(params)
            program = train_step(fam, k, donate=True)
            seconds[(key, k)].append(compile_timed(program, params, state, fam.batch)[1])
    out: dict[str, Any] = {"machine": machine(), "repeats": repeats, "families": {}}
    for key in keys:
        ks = [k for f, k in cases if f == key]
        row: dict[int, dict[str, Any]] = {
            k: {"min_s": min(seconds[(key, k)]), "all_s": seconds[(key, k)]} for k in ks
        }
        ratio = row[ks[-1]]["min_s"] / row[ks[0]]["min_s"]
        out["families"][key] = {"name": fams[key].name, "by_k": row, "ratio_top_to_2": ratio}
        print(
            f"compile {key:16s} "
            + "  ".join(f"k={k}: {row[k]['min_s']:.2f}s" for k in ks)
            + f"  k={ks[-1]}/k=2: {ratio:.2f}",
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--rounds", type=int, default=5, help="fresh jits per (family, k)")
    parser.add_argument("--lm-batch", type=int, default=32, help="the transformers' batch")
    args = parser.parse_args()
    out = measure(args.families, args.rounds, args.lm_batch)
    print(f"wrote {save('models_compile', out)}")


if __name__ == "__main__":
    main()
