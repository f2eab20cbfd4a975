"""Runs the test command again on chosen mutants of a cosmic-ray session (its survivors and
crashes, by default), e.g. after the test selection in ``verdict.py`` grew: each mutant's
diff is applied to the clone, ``verdict.py`` judges it (appending to the verdict log), and the
file is restored. ``report.py`` then keeps the newest verdict of each mutant.

``python tools/mutation/recheck.py session.sqlite verdicts.jsonl`` in the clone.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys

from report import judged_equivalent, key


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("session")
    parser.add_argument("log")
    parser.add_argument("--verdicts", default="survived,crashed")
    parser.add_argument("--modules", default="", help="comma-separated paths (default: all)")
    parser.add_argument("--skip", default=None, help="equivalent.json: the mutants judged "
                        "equivalent, not rerun")
    args = parser.parse_args()
    wanted = set(args.verdicts.split(","))
    latest: dict[tuple[str, ...], str] = {}
    with open(args.log) as f:
        for line in f:
            v = json.loads(line)
            latest[key(v["diff"])] = v["verdict"]
    db = sqlite3.connect(args.session)
    skip = judged_equivalent(args.skip)
    modules = set(filter(None, args.modules.split(",")))
    diffs = [d for (d,) in db.execute("select diff from work_results where diff is not null")
             if key(d) not in skip and (not modules or key(d)[0] in modules)]
    env = {**os.environ, "JAXACCUM_MUTATION_LOG": args.log}
    for diff in diffs:
        if latest.get(key(diff), "survived") not in wanted:
            continue
        patch = diff.split("\n", 1)[1] if diff.startswith("--- mutation diff ---") else diff
        patch = patch if patch.endswith("\n") else patch + "\n"
        if subprocess.run(["git", "apply", "-"], input=patch, text=True,
                          capture_output=True).returncode and subprocess.run(
                # (a mutant of a file's last line: cosmic-ray's diff shows one blank context
                # line past the end of the file; without it, the hunk's counts recounted)
                ["git", "apply", "--recount", "-"], input=patch.removesuffix(" \n"),
                text=True).returncode:
            print("not applied:", diff.splitlines()[1:3], flush=True)
            continue
        try:
            subprocess.run([sys.executable, "tools/mutation/verdict.py"], env=env,
                           check=False)
        finally:
            subprocess.run(["git", "checkout", "--", "jaxaccum"], check=True)


if __name__ == "__main__":
    main()
