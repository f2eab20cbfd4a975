"""cosmic-ray's test command: runs the tests of the mutated module and decides the verdict.

A mutant that CI's type check (``mypy jaxaccum``) rejects is *stillborn*: it never lands, and
its tests are not run. Otherwise a mutant counts as *killed* only when a test fails on an
assertion (an ``AssertionError``, pytest's own ``Failed``: a ``pytest.raises`` that did not
raise, a doctest whose output differs), in any test of its selection: the session goes on past
a test that failed on another exception (up to 5) and stops at the first assertion
(``first_assertion.py``). A mutant that only makes the library raise other exceptions is
*crashed*; one that passes every test *survived*; both exit 0, so cosmic-ray reports them
as survivors, and the verdict (with the failing test and exception) is appended to
``$JAXACCUM_MUTATION_LOG`` as one JSON line keyed by the mutated file's diff, which
``report.py`` joins with cosmic-ray's session.

The tests of a module are chosen by module (``TESTS``): the reference-model tests first (they
cover every documented promise of the pipeline and its front ends), then the module's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

REFERENCE = ["tests/test_reference.py", "tests/test_contract.py", "tests/test_domains.py"]
MESH = ["tests/test_reference_mesh.py"]
# (written in the same issue as these lines: a selection takes them once they exist)
PRECISION = [t for t in ["tests/test_precision.py"] if os.path.exists(t)]
MESH_PARITY = [t for t in ["tests/test_mesh_parity.py"] if os.path.exists(t)]
PAIR = ["tests/test_contrastive.py", "tests/test_ring.py", "tests/test_coupled.py",
        "tests/test_coupled_mesh.py"]
TESTS = {
    "jaxaccum/_reductions.py": [*REFERENCE, *MESH, "tests/test_error_messages.py",
                                "tests/test_precision.py", "tests/test_carry.py",
                                "tests/test_accumulate.py", "tests/test_frontends.py",
                                "tests/test_multi_steps.py"],
    "jaxaccum/_noise.py": [*REFERENCE, *MESH, "tests/test_noise_scale.py"],
    "jaxaccum/_microbatches.py": [*REFERENCE, *MESH, "tests/test_runtime_count.py",
                                  "tests/test_runtime_count_mesh.py"],
    "jaxaccum/_arguments.py": [*REFERENCE, "tests/test_one_way_through.py", "tests/test_carry.py",
                               "tests/test_accumulate.py",
                               "tests/test_frontends.py", "tests/test_pipeline_placement.py"],
    "jaxaccum/_options.py": [*REFERENCE, *MESH, "tests/test_carry.py", "tests/test_accumulate.py",
                             "tests/test_frontends.py", "tests/test_data_parallel.py",
                             "tests/test_noise_scale.py"],
    "jaxaccum/_coupled.py": [*REFERENCE, "tests/test_coupled.py", "tests/test_coupled_mesh.py",
                             "tests/test_error_messages.py"],
    "jaxaccum/_check.py": ["tests/test_check.py", "tests/test_contract.py", "tests/test_domains.py",
                           "tests/test_coupled_mesh.py"],
    # packing's domain tests first: a few seconds, and a refusal of valid input is an
    # assertion there (elsewhere it is recorded and the run goes on, past the timeout)
    "jaxaccum/packing/": [*(f"tests/test_domains.py::{name}" for name in (
        "test_a_sequence_is_taken_exactly_when_it_is_1d_integer_ids_that_fit",
        "test_a_stream_state_is_taken_exactly_when_it_is_one_and_resumes_exactly",
        "test_packed_microbatches_takes_exactly_the_array_fields",
        "test_packed_losses_take_exactly_one_shape_with_a_length_axis",
        "test_attention_mask_takes_exactly_ids_with_a_length_axis")),
        "tests/test_packing.py", "tests/test_grain.py"],
    # (a package: every module in it)
    "jaxaccum/_placement/": [*REFERENCE, *MESH, "tests/test_one_way_through.py",
                            "tests/test_pipeline_placement.py",
                            "tests/test_data_parallel.py",
                            "tests/test_runtime_count_mesh.py", "tests/test_coupled_mesh.py",
                            "tests/test_sharded.py::test_explicit_parameters_mixed_with_activations",
                            "tests/test_noise_scale.py::"
                            "test_noise_scale_refuses_explicit_axes_and_per_microbatch_fsdp",
                            # (one data device: no shard_map of the step's around the loss's own)
                            "tests/test_lm_head_mesh.py::"
                            "test_one_data_device_and_the_vocabulary_over_eight",
                            *MESH_PARITY],
    # the reference model does not cover the pair losses, Grain or MultiSteps: their own tests
    "jaxaccum/contrastive/__init__.py": [*PAIR, *PRECISION],
    "jaxaccum/contrastive/_tiles.py": [*PAIR, *PRECISION],
    "jaxaccum/contrastive/_ring.py": [*PAIR, *PRECISION],
    "jaxaccum/grain.py": ["tests/test_grain.py"],
    "jaxaccum/_pipeline.py": [*REFERENCE, "tests/test_carry.py", *MESH, *PRECISION, *MESH_PARITY,
                              # (the micro-step's sink path: the op adds into the accumulator)
                              "tests/test_linear_cross_entropy.py"],
    "jaxaccum/_multi_steps.py": ["tests/test_multi_steps.py", *PRECISION],
    # the gradient sources' results, divided once where they are used; the step written once
    "jaxaccum/_records.py": [*REFERENCE, *MESH, "tests/test_noise_scale.py",
                             "tests/test_coupled.py", "tests/test_carry.py", *PRECISION],
    "jaxaccum/_train_step.py": [*REFERENCE, "tests/test_train_step.py", "tests/test_flax.py",
                                "tests/test_runtime_count.py", "tests/test_carry.py",
                                *PRECISION],
    # the chunked cross-entropy and the sink it adds into: their own tests against float64
    "jaxaccum/_cross_entropy/": ["tests/test_linear_cross_entropy.py",
                                 "tests/test_lm_head_mesh.py"],
    "jaxaccum/_sink.py": ["tests/test_linear_cross_entropy.py", "tests/test_one_way_through.py"],
    "jaxaccum/_context.py": ["tests/test_lm_head_mesh.py"],
    # the public entry and the front ends: the reference model drives every one of them
    "jaxaccum/_value_and_grad.py": [*REFERENCE, *MESH, "tests/test_frontends.py",
                                    "tests/test_one_way_through.py", "tests/test_carry.py",
                                    "tests/test_error_messages.py", *PRECISION],
    "jaxaccum/nnx.py": [*REFERENCE, "tests/test_flax.py", "tests/test_frontends.py",
                        "tests/test_one_way_through.py", "tests/test_train_step.py", *PRECISION],
    "jaxaccum/linen.py": [*REFERENCE, "tests/test_flax.py", "tests/test_frontends.py",
                          "tests/test_one_way_through.py", "tests/test_train_step.py",
                          *PRECISION],
    "jaxaccum/__init__.py": [*REFERENCE, "tests/test_docs.py"],
    # argument checks: the domain tests draw what each check must take and refuse
    "jaxaccum/_validation.py": ["tests/test_domains.py", "tests/test_error_messages.py",
                                "tests/test_carry.py",
                                "tests/test_contract.py", "tests/test_frontends.py",
                                "tests/test_multi_steps.py"],
    "jaxaccum/_pytrees.py": [*REFERENCE, "tests/test_frontends.py", "tests/test_carry.py",
                             "tests/test_accumulate.py"],
    "jaxaccum/_keys.py": ["tests/test_keys.py", *REFERENCE, "tests/test_accumulate.py"],
    "jaxaccum/_plan.py": ["tests/test_plan.py"],
    # sharding specs and the XLA workarounds: the programs on 8 host devices
    "jaxaccum/_specs.py": [*MESH, "tests/test_sharded.py", "tests/test_pipeline_placement.py",
                           "tests/test_runtime_count_mesh.py", "tests/test_coupled_mesh.py",
                           "tests/test_data_parallel.py", "tests/test_lm_head_mesh.py",
                           *MESH_PARITY],
    "jaxaccum/_xla/": ["tests/test_hlo.py", "tests/test_conv_layout.py", "tests/test_check.py",
                       "tests/test_accumulate.py", *MESH, "tests/test_sharded.py",
                       "tests/test_pipeline_placement.py", "tests/test_lm_head_mesh.py"],
}
for _module in ("jaxaccum/_reductions.py", "jaxaccum/_microbatches.py", "jaxaccum/_options.py",
                "jaxaccum/_coupled.py", "jaxaccum/packing/"):
    TESTS[_module] += PRECISION  # bfloat16 inputs, against the float64 model
for _module in ("jaxaccum/_reductions.py", "jaxaccum/_microbatches.py", "jaxaccum/_options.py"):
    TESTS[_module] += MESH_PARITY  # every option on a mesh, the paths only taken there
# seconds: about 4 times what the module's tests take unmutated on 2 busy cores
# (the pair losses' tests: 1,240 s unmutated on the 2 busy cores, 280 s of CPU)
TIMEOUT = {**{f"jaxaccum/packing/{m}.py": 420 for m in ("_layout", "_stream", "_losses")},
           "jaxaccum/contrastive/__init__.py": 1500, "jaxaccum/contrastive/_tiles.py": 1500,
           "jaxaccum/contrastive/_ring.py": 1500,
           **{f"jaxaccum/_cross_entropy/{m}.py": 480
              for m in ("__init__", "_checks", "_chunks", "_split", "_vjp")},
           "jaxaccum/_sink.py": 480, "jaxaccum/_context.py": 480,
           # (the reference model through every front end: 90 s unmutated on an idle machine)
           **{f"jaxaccum/{m}.py": 480 for m in ("_value_and_grad", "nnx", "linen", "__init__",
                                                "_pytrees", "_keys", "_specs")},
           **{f"jaxaccum/_xla/{m}.py": 480 for m in ("conv_layout", "hlo", "jaxpr", "reduced")}}


# One compilation cache for every mutant of a run (tests/conftest.py makes one per session
# otherwise): a program a mutant leaves unchanged, the same HLO, is compiled once in the run.
CACHE = {"JAX_COMPILATION_CACHE_DIR": os.environ.get(
             "JAX_COMPILATION_CACHE_DIR",
             os.path.join(tempfile.gettempdir(), f"jaxaccum-mutation-jit-{os.getuid()}")),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def mutated() -> tuple[str, str]:
    names = subprocess.run(["git", "diff", "--name-only", "--", "jaxaccum"],
                           capture_output=True, text=True, check=True).stdout.split()
    diff = subprocess.run(["git", "diff", "-U0", "--", "jaxaccum"], capture_output=True,
                          text=True, check=True).stdout
    return (names[0] if names else ""), diff


def typecheck() -> str:
    """mypy's complaint about the mutated library, as CI runs it ("" if none)."""
    # (no cache: a file restored within the second its mutant was written keeps the mutant's
    # size and modification time, and mypy's cache would go on reporting the mutant's errors)
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "jaxaccum"],
                          capture_output=True, text=True)
    return "" if proc.returncode == 0 else proc.stdout.strip().splitlines()[0][:300]


def judge(failures: list[dict[str, Any]], timeout: float | None) -> tuple[str, str, str]:
    """(verdict, test, message) from the failures the plugin recorded, in the order seen;
    ``timeout``: the seconds after which the run was stopped (None if it ended)."""
    for wanted, verdict in (("killed", "killed"), ("refused", "refused")):
        for f in failures:
            if f["asserted"] and (f["refused"] if wanted == "refused" else not f["refused"]):
                return verdict, f["test"], f"{f['exception']}: {f['message']}"
    if failures:
        f = failures[0]
        invalid = f["exception"] == "SyntaxError"  # the mutated module does not even import
        return ("invalid" if invalid else "crashed"), f["test"], \
            f"{f['exception']}: {f['message']}"
    if timeout is not None:  # a loop that never ends: detected, not asserted
        return "timeout", "", f"no result in {timeout:g} s"
    return "survived", "", ""


def main() -> int:
    name, diff = mutated()
    complaint = typecheck()
    if complaint:  # CI's type check rejects it: it never lands, so it is not run
        verdict, where, what = "stillborn", "mypy jaxaccum", complaint
    else:
        # (a module of a package: the package's selection) and the module's own doctests too
        tests = [*TESTS.get(name, TESTS.get(os.path.dirname(name) + "/", REFERENCE)), name]
        here = os.path.dirname(os.path.abspath(__file__))
        with tempfile.NamedTemporaryFile(suffix=".jsonl") as record:
            env = {**os.environ, **CACHE, "JAXACCUM_REFERENCE_EXAMPLES": "6",
                   "JAXACCUM_REFERENCE_MESH_CASES": "2",
                   "JAXACCUM_HYPOTHESIS_PROFILE": "no-shrink",
                   "JAXACCUM_MUTATION_FAILURES": record.name,
                   "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider",
                     "-p", "first_assertion", "--no-header", *tests],
                    capture_output=True, text=True, timeout=TIMEOUT.get(name, 240), env=env)
                # (a stopped run: the timeout; the failures it recorded still count)
                timeout, code, out = None, proc.returncode, proc.stdout
            except subprocess.TimeoutExpired:
                timeout, code, out = TIMEOUT.get(name, 240), 0, ""
            failures = [json.loads(line) for line in open(record.name) if line.strip()]
        verdict, where, what = judge(failures, timeout)
        if verdict == "survived" and code not in (0, 5):  # pytest itself failed
            verdict, what = "crashed", out[-300:]
    log = os.environ.get("JAXACCUM_MUTATION_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"file": name, "diff": diff, "verdict": verdict, "test": where,
                                "message": what}) + "\n")
    return 1 if verdict in ("killed", "refused", "timeout", "stillborn") else 0


if __name__ == "__main__":
    sys.exit(main())
