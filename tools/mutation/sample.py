"""Keeps a seeded, stratified random sample of a cosmic-ray session's mutants.

``python tools/mutation/sample.py session.sqlite --size 300 --seed 20261201 --shard 0/2``
deletes from the session every mutant outside the sample (and outside this shard), so that
``cosmic-ray exec`` runs only the sample. Mutants inside type annotations are left out before
sampling: with ``from __future__ import annotations`` they are never evaluated (equivalent by
construction). The sample is proportional to each module's mutants, at least ``--floor`` each;
each module's mutants are drawn with their own generator (seeded by the seed and the module's
path), so a module's sample depends only on its own code and its share of the total.
``--modules a.py,b.py`` keeps only those modules' samples: to rerun the modules that changed;
``--operators jaxaccum/`` only those operators' mutants (name prefixes).

This project's operators (``operators.py``, ``jaxaccum/...`` in the session, made by
``cr.py init``) are sampled with the others, and each of them at least ``--operator-floor``
times in each module where it makes mutants (drawn by a generator of its own, seeded by the
seed, the module and the operator: a module's sample still depends only on the module). Where
one of them makes the very mutant a built-in operator makes (``operators.OVERLAPS``: a
comparison flipped in a count is also a built-in comparison replacement), the built-in one is
left out: the same mutant is run once, under the slip's name.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import sqlite3
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cosmic_ray.plugins  # noqa: E402
import operators  # noqa: E402
from cosmic_ray.mutating import mutate_code  # noqa: E402

OURS = operators.PROVIDER_NAME + "/"


def duplicates(specs: list[tuple], sources: dict[str, str]) -> set[str]:
    """The job ids of the mutants that one of ours makes too (``operators.OVERLAPS``): the
    same mutated code of the same module from an operator it overlaps, at the same place."""
    cosmic_ray.plugins.OPERATOR_PROVIDERS[operators.PROVIDER_NAME] = operators.PROVIDER
    at: dict[tuple, list[tuple]] = defaultdict(list)
    for s in specs:
        at[s[1:6]].append(s)
    dropped: set[str] = set()

    def mutant(s: tuple) -> str | None:
        return mutate_code(sources[s[1]], cosmic_ray.plugins.get_operator(s[6])(), s[7])

    for s in specs:
        prefixes = operators.OVERLAPS.get(s[6].removeprefix(OURS)) if s[6].startswith(OURS) \
            else None
        others = [o for o in at[s[1:6]] if o is not s and o[0] not in dropped and prefixes
                  and o[6].startswith(prefixes)]
        if others and s[0] not in dropped:
            ours = mutant(s)
            dropped.update(o[0] for o in others if mutant(o) == ours)
    return dropped


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("session")
    parser.add_argument("--size", type=int, default=300)
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--floor", type=int, default=20)
    parser.add_argument("--shard", default="0/1")
    parser.add_argument("--modules", default="", help="comma-separated paths (default: all)")
    parser.add_argument("--operators", default="",
                        help="comma-separated operator name prefixes kept (default: all), "
                             "e.g. jaxaccum/ for this project's only")
    parser.add_argument("--operator-floor", type=int, default=1,
                        help="each of this project's operators at least this often per module")
    args = parser.parse_args()
    db = sqlite3.connect(args.session)
    # in the order of the code (job ids are random), so a seed picks the same mutants of the
    # same code in every session
    specs = db.execute("select job_id, module_path, start_pos_row, start_pos_col, end_pos_row, "
                       "end_pos_col, operator_name, occurrence from mutation_specs order by "
                       "module_path, start_pos_row, start_pos_col, operator_name, occurrence"
                       ).fetchall()
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
        _, path, r0, c0, r1, c1 = spec[:6]
        return any((a0, b0) <= (r0, c0) and (r1, c1) <= (a1, b1) for a0, b0, a1, b1 in spans[path])

    twice = duplicates(specs, {path: open(path).read() for path in spans})
    kinds = tuple(filter(None, args.operators.split(","))) or ("",)
    live = [s for s in specs if not annotated(s) and s[0] not in twice and s[6].startswith(kinds)]
    by_module: dict[str, list[str]] = defaultdict(list)
    by_operator: dict[tuple[str, str], list[str]] = defaultdict(list)  # (module, ours)
    for s in live:
        by_module[s[1]].append(s[0])
        if s[6].startswith(OURS):
            by_operator[s[1], s[6]].append(s[0])
    total = len(live)
    only = set(filter(None, args.modules.split(",")))
    chosen: list[str] = []
    for path in sorted(by_module):
        jobs = by_module[path]  # in the order of the code
        n = min(len(jobs), max(args.floor, round(args.size * len(jobs) / total)))
        picked = random.Random(f"{args.seed}:{path}").sample(jobs, n)
        for (where, op), theirs in sorted(by_operator.items()):  # each of ours sampled
            have = set(picked) & set(theirs)
            if where == path and len(have) < args.operator_floor:
                rest = [j for j in theirs if j not in have]
                picked += random.Random(f"{args.seed}:{path}:{op}").sample(
                    rest, min(len(rest), args.operator_floor - len(have)))
        if not only or path in only:
            chosen += picked
    random.Random(args.seed).shuffle(chosen)
    index, count = map(int, args.shard.split("/"))
    keep = set(chosen[index::count])
    drop = [(s[0],) for s in specs if s[0] not in keep]
    db.executemany("delete from mutation_specs where job_id = ?", drop)
    db.executemany("delete from work_items where job_id = ?", drop)
    db.commit()
    print(f"{len(specs)} mutants, {len(twice)} made by one of ours too left out, "
          f"{len(live)} live (outside annotations, of {kinds}), {len(chosen)} sampled "
          f"(seed {args.seed}), {len(keep)} in shard {args.shard}")
    sampled = set(chosen)
    for path in sorted(by_module):
        n = sum(1 for s in specs if s[1] == path and s[0] in sampled)
        m = sum(1 for s in specs if s[1] == path and s[0] in sampled and s[6].startswith(OURS))
        print(f"  {path}: {len(by_module[path])} live, {n} sampled ({m} of ours)")


if __name__ == "__main__":
    main()
