"""cosmic-ray's test command: runs the tests of the mutated module and decides the verdict.

A mutant counts as *killed* only when a test fails on an assertion (an ``AssertionError``, or
pytest's own ``Failed``: a ``pytest.raises`` that did not raise): exit 1. A mutant that only
makes the library raise some other exception inside JAX is *crashed*; one that passes every
test *survived*; both exit 0, so cosmic-ray reports them as survivors, and the verdict (with
the failing test and exception) is appended to ``$JAXACCUM_MUTATION_LOG`` as one JSON line
keyed by the mutated file's diff, which ``report.py`` joins with cosmic-ray's session.

The tests of a module are chosen by module (``TESTS``): the reference-model tests first (they
cover every documented promise of the pipeline and its front ends), then the module's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

REFERENCE = ["tests/test_reference.py", "tests/test_contract.py"]
MESH = ["tests/test_reference_mesh.py"]
TESTS = {
    "jaxaccum/_reductions.py": [*REFERENCE, *MESH, "tests/test_guards.py", "tests/test_carry.py",
                                "tests/test_accumulate.py", "tests/test_frontends.py",
                                "tests/test_multi_steps.py"],
    "jaxaccum/_noise.py": [*REFERENCE, *MESH, "tests/test_noise_scale.py"],
    "jaxaccum/_microbatches.py": [*REFERENCE, *MESH, "tests/test_variable.py",
                                  "tests/test_variable_mesh.py"],
    "jaxaccum/_arguments.py": [*REFERENCE, "tests/test_carry.py", "tests/test_accumulate.py",
                               "tests/test_frontends.py"],
    "jaxaccum/_options.py": [*REFERENCE, *MESH, "tests/test_carry.py", "tests/test_accumulate.py",
                             "tests/test_frontends.py", "tests/test_data_parallel.py"],
    "jaxaccum/_coupled.py": [*REFERENCE, "tests/test_coupled.py", "tests/test_coupled_mesh.py"],
    "jaxaccum/_check.py": ["tests/test_check.py", "tests/test_contract.py",
                           "tests/test_coupled_mesh.py"],
    "jaxaccum/packing.py": ["tests/test_packing.py"],
    "jaxaccum/_placement.py": [*REFERENCE, *MESH, "tests/test_guards.py",
                               "tests/test_pipeline_placement.py", "tests/test_data_parallel.py",
                               "tests/test_variable_mesh.py", "tests/test_coupled_mesh.py"],
}
# seconds: about 4 times what the module's tests take unmutated on 2 busy cores
TIMEOUT = {"jaxaccum/packing.py": 150}
ASSERTIONS = ("AssertionError", "assert ", "Failed: DID NOT RAISE", "Regex pattern did not match")


def mutated() -> tuple[str, str]:
    names = subprocess.run(["git", "diff", "--name-only", "--", "jaxaccum"],
                           capture_output=True, text=True, check=True).stdout.split()
    diff = subprocess.run(["git", "diff", "-U0", "--", "jaxaccum"], capture_output=True,
                          text=True, check=True).stdout
    return (names[0] if names else ""), diff


def main() -> int:
    name, diff = mutated()
    tests = [*TESTS.get(name, REFERENCE), name]  # the module's own doctests too
    with tempfile.NamedTemporaryFile(suffix=".xml") as junit:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-x", "-q", "-n0", "-p", "no:cacheprovider",
                 "--no-header", f"--junitxml={junit.name}", *tests],
                capture_output=True, text=True, timeout=TIMEOUT.get(name, 240),
                env={**os.environ, "JAXACCUM_REFERENCE_EXAMPLES": "6",
                     "JAXACCUM_REFERENCE_MESH_CASES": "2"})
        except subprocess.TimeoutExpired:  # a loop that never ends: detected, not asserted
            proc = None
        verdict, where, what = "survived", "", ""
        if proc is None:
            verdict, what = "timeout", f"no result in {TIMEOUT.get(name, 240)} s"
        elif proc.returncode not in (0, 5):
            try:
                root = ET.parse(junit.name).getroot()
            except ET.ParseError:
                root = None
            for case in (root.iter("testcase") if root is not None else []):
                bad = case.find("failure")
                if bad is None:
                    bad = case.find("error")
                if bad is None:
                    continue
                where = f"{case.get('classname')}::{case.get('name')}"
                what = (bad.get("message") or "")[:300]
                verdict = "killed" if bad.tag == "failure" and what.startswith(ASSERTIONS) \
                    else "crashed"
                if verdict == "killed" and "jaxaccum refused valid input" in what:
                    verdict = "refused"  # valid input refused by the library (conftest's hook)
                if bad.tag == "error" and "SyntaxError" in (bad.text or ""):
                    verdict = "invalid"  # the mutated module does not even import
                break
            else:
                verdict, what = "crashed", proc.stdout[-300:]
    log = os.environ.get("JAXACCUM_MUTATION_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"file": name, "diff": diff, "verdict": verdict, "test": where,
                                "message": what}) + "\n")
    return 1 if verdict in ("killed", "refused", "timeout") else 0


if __name__ == "__main__":
    sys.exit(main())
