"""Joins a cosmic-ray session with the verdicts ``verdict.py`` logged, into one report.

``python tools/mutation/report.py A/session.sqlite A/verdicts.jsonl [B/session.sqlite
B/verdicts.jsonl ...] --out tools/mutation/results/mutation.json`` writes, for the commit the
sessions ran on: the sample (seed, size, per module), each mutant's operator, place, diff and
verdict (stillborn: rejected by mypy / killed by an assertion / refused / crashed / survived /
timeout / invalid), and per module, per operator and per provider (cosmic-ray's built-in
``core`` against this project's ``jaxaccum``, ``operators.py``) the kill rate over the
non-equivalent mutants (``--equivalent FILE``: the mutants judged equivalent,
each with why).
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import sqlite3
import subprocess
from collections import Counter, defaultdict
from typing import Any

# A mutant that cannot run at all: an operator its operands do not support (Python, NumPy
# or JAX says so at once). Loud by construction; reported apart from the crashes a test
# provoked.
INCOMPETENT = ("unsupported operand type", "not supported between instances",
               "does not accept dtype", "bad operand type", "not supported for the input types",
               "unreduced rule for")  # (JAX: no such operator on an unreduced array)


def key(diff: str) -> tuple[str, ...]:
    """A mutant's identity in any diff format (cosmic-ray's, git's -U0): the file and the
    changed lines, without context or headers."""
    lines = (diff or "").splitlines()
    path = next((line[6:] for line in lines if line.startswith("+++ b/")), "")
    # (blank changed lines left out: cosmic-ray's diff of a file's last line also shows its
    # final newline as changed, git's does not)
    changed = [line.rstrip() for line in lines
               if line[:1] in "+-" and not line.startswith(("+++", "---")) and line[1:].strip()]
    return (path, *changed)


def judged_equivalent(path: str | None) -> dict[tuple[str, ...], str]:
    """The mutants judged equivalent (a JSON list of ``{"module", "changed", "why"}``: the
    changed lines, as ``key`` gives them), keyed by their identity, so a judgement holds in
    every session that makes the same mutant of the same code."""
    if not path:
        return {}
    return {(e["module"], *(c for c in e["changed"] if c[1:].strip())): e["why"]
            for e in json.load(open(path))}


def code(source: str) -> str:
    """A module's code without its docstrings (what a mutant can change), as a string that two
    versions of the module share exactly when their code is the same."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


@functools.cache
def unchanged(module: str, commit: str) -> bool:
    """Whether ``module``'s code (docstrings aside) is the same now as at ``commit``."""
    old = subprocess.run(["git", "show", f"{commit}:{module}"], capture_output=True, text=True)
    return (old.returncode == 0 and os.path.exists(module)
            and code(old.stdout) == code(open(module).read()))


def committed(commit: str) -> int:
    """The commit's time (seconds since the epoch)."""
    return int(subprocess.run(["git", "log", "-1", "--format=%ct", commit], capture_output=True,
                              text=True, check=True).stdout)


def load(session: str, log: str) -> list[dict[str, Any]]:
    db = sqlite3.connect(session)
    rows = db.execute(
        "select s.job_id, s.module_path, s.operator_name, s.start_pos_row, s.start_pos_col, "
        "r.worker_outcome, r.test_outcome, r.diff from mutation_specs s left join work_results r "
        "on s.job_id = r.job_id").fetchall()
    verdicts: dict[tuple[str, ...], dict[str, Any]] = {}
    with open(log) as f:
        for line in f:  # the newest verdict of a mutant wins (recheck.py appends)
            v = json.loads(line)
            verdicts[key(v["diff"])] = v
    out = []
    for job, path, op, row, col, worker, test, diff in rows:
        v = verdicts.get(key(diff or ""))
        if worker is None:
            verdict = "not run"
        elif worker == "abnormal" or test == "incompetent":
            verdict = "invalid"  # the mutated module does not import (a syntax error)
        elif (test or "").lower() == "killed" and v is None:
            verdict = "timeout"
        elif v is not None:
            verdict = v["verdict"]
        else:
            verdict = "survived" if (test or "").lower() == "survived" else str(test).lower()
        if verdict == "crashed" and any(t in (v or {}).get("message", "") for t in INCOMPETENT):
            verdict = "incompetent"
        out.append({"job": job, "module": path, "operator": op, "line": row, "col": col,
                    "verdict": verdict, "test": (v or {}).get("test", ""),
                    "message": (v or {}).get("message", "")[:300], "diff": diff or ""})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pairs", nargs="+")
    parser.add_argument("--out", default="tools/mutation/results/mutation.json")
    parser.add_argument("--equivalent", default=None)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--sample", required=True,
                        help="how the mutants were drawn: the sample.py command line")
    parser.add_argument("--older", nargs=3, action="append", default=[],
                        metavar=("SESSION", "LOG", "COMMIT"),
                        help="a run at an earlier commit whose modules count only where the "
                             "main pairs ran none (modules unchanged since, with their tests)")
    parser.add_argument("--older-report", action="append", default=[], metavar="REPORT",
                        help="an earlier report (this script's output): a module no run above "
                             "measured counts from the report that measured it last, where "
                             "its code (docstrings aside) is unchanged since")
    args = parser.parse_args()
    mutants: list[dict[str, Any]] = []
    for session, log in zip(args.pairs[::2], args.pairs[1::2], strict=True):
        mutants += load(session, log)
    commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                           text=True, check=True).stdout.strip()
    ran = {m["module"] for m in mutants if m["verdict"] != "not run"}
    origin = {module: commit for module in ran}
    for session, log, older in args.older:  # the newest first; shards of one commit together
        kept = [m for m in load(session, log) if m["verdict"] != "not run"
                and m["module"] not in ran and origin.get(m["module"], older) == older]
        origin.update({m["module"]: older for m in kept})
        mutants += kept
    # a module not run above counts from the earlier report that measured it last, if its code
    # is unchanged since
    olders = [json.load(open(path)) for path in args.older_report]
    newest: dict[str, tuple[int, str, dict[str, Any]]] = {}
    for older in olders:
        for module, at in older["modules_measured_at"].items():
            when = committed(at)
            if module not in origin and (module not in newest or when > newest[module][0]):
                newest[module] = (when, at, older)
    for module, (_, at, older) in sorted(newest.items()):
        if unchanged(module, at):
            origin[module] = at
            mutants += [m for m in older["mutants"]
                        if m["module"] == module and m["verdict"] != "not run"]
    equivalent = judged_equivalent(args.equivalent)
    for m in mutants:
        why = equivalent.get(key(m["diff"]))
        if m["verdict"] in ("survived", "timeout") and why:  # (a timeout: no verdict came)
            m["verdict"], m["why"] = "equivalent", why
    per: dict[str, Counter[str]] = defaultdict(Counter)
    for m in mutants:
        per[m["module"]][m["verdict"]] += 1
    def rates(c: Counter[str]) -> dict[str, Any]:
        """Killed by an assertion over every judged mutant (equivalent, invalid and not run
        left out), and over the competent ones (stillborn, which CI's type check rejects, and
        incompetent left out too); ``refused`` (valid input refused by the library, failed
        as an assertion) counted apart, and with."""
        judged = sum(c.values()) - c["equivalent"] - c["invalid"] - c["not run"]
        competent = judged - c["incompetent"] - c["stillborn"]

        def rate(n: int, d: int) -> float | None:
            return round(n / d, 3) if d else None

        return {**c, "killed_rate": rate(c["killed"], judged),
                "killed_rate_competent": rate(c["killed"], competent),
                "killed_or_refused_rate_competent": rate(c["killed"] + c["refused"], competent)}

    summary = {module: rates(c) for module, c in sorted(per.items())}
    total: Counter[str] = sum(per.values(), Counter())
    # per operator, and built-in ("core/...") against this project's own ("jaxaccum/...",
    # tools/mutation/operators.py: the slips the test suite was audited for)
    per_operator: dict[str, Counter[str]] = defaultdict(Counter)
    per_provider: dict[str, Counter[str]] = defaultdict(Counter)
    for m in mutants:
        per_operator[m["operator"]][m["verdict"]] += 1
        per_provider[m["operator"].split("/", 1)[0]][m["verdict"]] += 1
    report = {
        "commit": commit,
        "tool": "cosmic-ray 8.7 through tools/mutation/cr.py (built-in operators and "
                "this project's, tools/mutation/operators.py; "
                "tools/mutation/cosmic-ray.toml)",
        "sample": args.sample,
        "kill": "an assertion failed in any test of the module's selection (verdict.py; "
                "JAXACCUM_MUTATION_MAX_CRASHES=0 runs all of it); "
                "crashed = other exceptions only; stillborn = `mypy jaxaccum` (run by CI) "
                "rejects the mutant",
        "modules_measured_at": dict(sorted(origin.items())),
        "total": rates(total),
        "modules": summary,
        "providers": {p: rates(c) for p, c in sorted(per_provider.items())},
        "operators": {op: rates(c) for op, c in sorted(per_operator.items())},
        "mutants": sorted(mutants, key=lambda m: (m["module"], m["line"], m["col"])),
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({"commit": commit[:12], "total": report["total"]}, indent=1))
    for module, s in summary.items():
        print(module, s)
    for provider, s in report["providers"].items():
        print(provider, s)


if __name__ == "__main__":
    main()
