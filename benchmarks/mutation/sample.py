"""Keeps a seeded, stratified random sample of a cosmic-ray session's mutants.

``python benchmarks/mutation/sample.py session.sqlite --size 300 --seed 20261201 --shard 0/2``
deletes from the session every mutant outside the sample (and outside this shard), so that
``cosmic-ray exec`` runs only the sample. Mutants inside type annotations are left out before
sampling: with ``from __future__ import annotations`` they are never evaluated (equivalent by
construction). The sample is proportional to each module's mutants, at least ``--floor`` each;
each module's mutants are drawn with their own generator (seeded by the seed and the module's
path), so a module's sample depends only on its own code and its share of the total.
``--modules a.py,b.py`` keeps only those modules' samples: to rerun the modules that changed.
"""

from __future__ import annotations

import argparse
import ast
import random
import sqlite3
from collections import defaultdict


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("session")
    parser.add_argument("--size", type=int, default=300)
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--floor", type=int, default=20)
    parser.add_argument("--shard", default="0/1")
    parser.add_argument("--modules", default="", help="comma-separated paths (default: all)")
    args = parser.parse_args()
    db = sqlite3.connect(args.session)
    # in the order of the code (job ids are random), so a seed picks the same mutants of the
    # same code in every session
    specs = db.execute("select job_id, module_path, start_pos_row, start_pos_col, end_pos_row, "
                       "end_pos_col from mutation_specs order by module_path, start_pos_row, "
                       "start_pos_col, operator_name, occurrence").fetchall()
    spans: dict[str, list[tuple[int, int, int, int]]] = {}
    for path in {s[1] for s in specs}:
        tree = ast.parse(open(path).read())
        found = []
        for node in ast.walk(tree):
            notes = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                notes += [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs,
                                                 a.vararg, a.kwarg) if x and x.annotation]
                notes.append(node.returns)
            elif isinstance(node, ast.AnnAssign):
                notes.append(node.annotation)
            found += [(n.lineno, n.col_offset, n.end_lineno, n.end_col_offset) for n in notes
                      if n is not None]
        spans[path] = found

    def annotated(spec: tuple) -> bool:
        _, path, r0, c0, r1, c1 = spec
        return any((a0, b0) <= (r0, c0) and (r1, c1) <= (a1, b1) for a0, b0, a1, b1 in spans[path])

    live = [s for s in specs if not annotated(s)]
    by_module: dict[str, list[str]] = defaultdict(list)
    for s in live:
        by_module[s[1]].append(s[0])
    total = len(live)
    only = set(filter(None, args.modules.split(",")))
    chosen: list[str] = []
    for path in sorted(by_module):
        jobs = by_module[path]  # in the order of the code
        n = min(len(jobs), max(args.floor, round(args.size * len(jobs) / total)))
        picked = random.Random(f"{args.seed}:{path}").sample(jobs, n)
        if not only or path in only:
            chosen += picked
    random.Random(args.seed).shuffle(chosen)
    index, count = map(int, args.shard.split("/"))
    keep = set(chosen[index::count])
    drop = [(s[0],) for s in specs if s[0] not in keep]
    db.executemany("delete from mutation_specs where job_id = ?", drop)
    db.executemany("delete from work_items where job_id = ?", drop)
    db.commit()
    print(f"{len(specs)} mutants, {len(specs) - len(live)} in annotations left out, "
          f"{len(chosen)} sampled (seed {args.seed}), {len(keep)} in shard {args.shard}")
    for path in sorted(by_module):
        n = sum(1 for s in specs if s[1] == path and s[0] in set(chosen))
        print(f"  {path}: {len(by_module[path])} live, {n} sampled")


if __name__ == "__main__":
    main()
