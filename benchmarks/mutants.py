"""Mutation testing: does the suite catch realistic bugs in the library's modules?

Each mutant is one textual change to one file (the bug a careless edit would make). For each,
a clean snapshot of the *committed* tree (``git archive HEAD``: work in progress in the live
tree is never copied) gets the change, and the tests that cover the mutated code run there
(``pytest -x -q -p no:cacheprovider -rfE --tb=short``). The outcome:

- ``killed``: a test FAILED on an assertion (``AssertionError``, a ``pytest.raises`` that did
  not raise or did not match, ``pytest.fail``); ``killed_by`` names that test;
- ``crashed``: the failures are other exceptions (inside JAX, flax, the library; a
  subprocess script that died with a traceback), setup or collection errors, or a timeout.
  A crash is not a kill: the suite noticed only because something blew up. When the first
  failure is a crash the selected tests are run again without ``-x``: if one of them fails on
  an assertion (a guard for a silent variant of the bug) the mutant is ``killed`` by it and
  ``crashed_first`` keeps the crash;
- ``survived``: every selected test passed, a hole in the suite (or an equivalent mutant);
- ``not applicable``: the text is not found exactly once in the file (fix the mutant).

Results go to ``benchmarks/results/mutants.json`` (merged by name with the mutants already
there, so a rerun of a subset updates only those).

Run: ``python benchmarks/mutants.py [--only SUBSTRING] [--file SUBSTRING] [--list]``;
``--overlay PATH`` copies a working-tree file over the snapshot (to try a new, uncommitted
test before committing it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Any, NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "mutants.json"
TIMEOUT_S = 1500
FORMAT = 2  # results.json written by this runner (earlier files are not merged)


class Mutant(NamedTuple):
    name: str
    file: str
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, ``-k`` expressions


def tests(*args: str) -> tuple[str, ...]:
    return args


GUARDS = "tests/test_guards.py"
# test_accumulate without its two slowest tests (a property test, a bfloat16 comparison) unless
# a mutant is about what they check
ACC = tests("tests/test_accumulate.py", "tests/test_carry.py",
            "-k", "not property and not bfloat16")
ACC_ALL = tests("tests/test_accumulate.py", "tests/test_carry.py")
CARRY = tests("tests/test_carry.py", "-k", "carri")
SKIP = tests("tests/test_accumulate.py", "tests/test_carry.py", "-k",
             "skip or nonfinite or nan or negative")
AUX = tests("tests/test_carry.py", "tests/test_frontends.py", "-k", "aux and not tutorial",
            GUARDS, "-k", "aux and not mesh")
TRAIN = tests("tests/test_train_step.py")
MULTI = tests("tests/test_multi_steps.py", "-k", "trajectory or optax_multisteps or extra_args or "
              "chainable or zero_weight or empty or whole_window or skipped_window")
NNX = tests("tests/test_frontends.py", "-k", "nnx and not tutorial", "tests/test_flax.py", "-k",
            "nnx")
LINEN = tests("tests/test_frontends.py", "tests/test_flax.py", "-k", "linen")
PLAN = tests("tests/test_plan.py")
CONV = tests("tests/test_conv_layout.py", "-k", "exact or canonical or cond or scan")
OPTIONS = tests("tests/test_frontends.py", "-k",
                "option or entry or keyword or counts or per_device")
EQX = tests("tests/test_frontends.py", "-k", "equinox", GUARDS, "-k", "equinox")
# multi-device: the 8-CPU-device subprocess tests, scoped to the case that checks the change
SHARDED = "tests/test_sharded.py"
PIPE = "tests/test_pipeline_placement.py"  # the pipeline's placements on meshes (when merged)


def mesh(guard: str, *before: str) -> tuple[str, ...]:
    """The suite's multi-device tests ``before``, then the guard's 8-device checks: with ``-x``
    a guard only decides when the suite's own tests let the mutant through. (The two mutants
    whose suite test is a test_sharded.py case run their guard first: that program takes
    minutes, the guard's one under a minute; the suite's test runs only if the guard passes.)"""
    return (*before, PIPE, "-k", "*", GUARDS, "-k", guard)


VARIABLE = tests("tests/test_variable.py")
NOISE = tests("tests/test_noise_scale.py", "-k", "not mnist")
COUPLED = tests("tests/test_coupled.py", "-k", "not trajectory")
PACKING = tests("tests/test_packing.py", "-k", "not property")
EMIT = tests("tests/test_multi_steps.py", "-k", "emit or windows")

P = "jaxaccum/_pipeline.py"
R = "jaxaccum/_reductions.py"
PL = "jaxaccum/_placement.py"
A = "jaxaccum/_arguments.py"

MUTANTS = [
    # --- ported from _accumulate.py / _sharding.py (names kept) ------------------------------
    Mutant("finalize divides by weight + 1", P,
           "loss = sums.loss / sums.weight", "loss = sums.loss / (sums.weight + 1)", ACC),
    Mutant("gradient mean divided by weight + 1", P,
           "grads = jax.tree.map(lambda g: g / sums.weight.astype(g.dtype), sums.grads)",
           "grads = jax.tree.map(lambda g: g / (sums.weight + 1).astype(g.dtype), sums.grads)",
           ACC),
    Mutant("contiguous instead of strided micro-batches", P,
           "return x.reshape((x.shape[0] // k, k, *x.shape[1:]))",
           "return jnp.swapaxes(x.reshape((k, x.shape[0] // k, *x.shape[1:])), 0, 1)", ACC),
    Mutant("accumulator narrower than the leaf", R,
           "return jnp.promote_types(dtype, accumulator_dtype)",
           "return jnp.dtype(accumulator_dtype)", ACC_ALL),
    Mutant("skip checks the loss only", PL,
           "return _reductions.all_finite((loss, grads)), grads",
           "return _reductions.all_finite(loss), grads", SKIP),
    Mutant("weight-0 NaN not masked", R,
           "term = jnp.where(weight == 0, 0, valid_weight(weight).astype(acc.dtype) * g)",
           "term = valid_weight(weight).astype(acc.dtype) * g", ACC),
    Mutant("weight-0 NaN micro-batch counted as skipped", R,
           "skipped = jnp.logical_and(weight != 0, jnp.logical_not(jnp.logical_and(finite, "
           "weight > 0)))",
           "skipped = jnp.logical_not(finite)", ACC),
    Mutant("negative weight silently clipped", R,
           "return jnp.where(weight >= 0, weight, jnp.nan)", "return jnp.maximum(weight, 0)",
           ACC),
    Mutant("invalid total divides to zero", R, "nonzero = total != 0", "nonzero = total > 0",
           ACC),
    Mutant("weights not stopped from the gradient", P,
           "w = jnp.ones((), jnp.float32) if weight is None else jax.lax.stop_gradient(weight)",
           "w = jnp.ones((), jnp.float32) if weight is None else weight",
           ACC + (GUARDS, "-k", "outer")),
    Mutant("gradients not cast back to the parameters' dtype", P,
           "grads = _reductions.cast_like(grads, acc.differentiated(args))",
           "grads = grads", tests("tests/test_accumulate.py", "-k", "dtype or float")),
    Mutant("carried state not threaded", P,
           "args = acc.with_carry(args, sums.carry)", "pass", CARRY),
    Mutant("skipped micro-batch's carried update kept", P,
           "new_carry = jax.tree.map(lambda old, new: jnp.where(bad, old, new), sums.carry, "
           "new_carry)",
           "new_carry = jax.tree.map(lambda old, new: new, sums.carry, new_carry)", CARRY),
    Mutant("aux 'last' keeps the first", R,
           "lambda acc, x, w: x.astype(acc.dtype),", "lambda acc, x, w: acc,", AUX),
    Mutant("aux 'max' takes the min", R,
           '"max": _extremum(largest=True),', '"max": _extremum(largest=False),', AUX),
    Mutant("k == 1 aux not stacked", P,
           "return sums, jax.tree.map(lambda y: jnp.expand_dims(y, 0), ys)",
           "return sums, ys", tests("tests/test_accumulate.py", "-k", "aux")),
    Mutant("keyword arguments dropped", A,
           "return self.with_fun(functools.partial(self.fun, **kwargs))", "return self",
           tests("tests/test_accumulate.py", "-k", "keyword", GUARDS, "-k", "keyword")),
    Mutant("zero-weight step not skipped", "jaxaccum/_train_step.py",
           "optimizer, params, opt_state, res, acc.options.divides_safely, self._donate",
           "optimizer, params, opt_state, res, False, self._donate", TRAIN),
    Mutant("optimizer state not donated", "jaxaccum/_train_step.py",
           "donated = (0, 1, *(i + 1 for i in acc.carry)) if self._donate else ()",
           "donated = (0, *(i + 1 for i in acc.carry)) if self._donate else ()", TRAIN),
    Mutant("params not passed to the optimizer", "jaxaccum/_train_step.py",
           "updates, new_state = optimizer.update(res.grads, opt_state, params)",
           "updates, new_state = optimizer.update(res.grads, opt_state)", TRAIN),
    Mutant("updates applied twice", "jaxaccum/_train_step.py",
           "return optax.apply_updates(params, updates), new_state",
           "return optax.apply_updates(optax.apply_updates(params, updates), updates), new_state",
           TRAIN),
    Mutant("multi_steps emits one call early", "jaxaccum/_multi_steps.py",
           "emit = mini_step >= jnp.asarray(", "emit = mini_step + 1 >= jnp.asarray(", MULTI),
    Mutant("multi_steps extra args not passed to inner", "jaxaccum/_multi_steps.py",
           "inner_state, params, **extra_args", "inner_state, params",
           MULTI + (GUARDS, "-k", "extra_args")),
    Mutant("multi_steps steps on an empty window", "jaxaccum/_multi_steps.py",
           "step = jnp.logical_and(emit, acc_weight != 0)", "step = emit", MULTI),
    # --- the pipeline: micro-step, accumulate, finalize ---------------------------------------
    Mutant("skipped count not accumulated over micro-batches", P,
           "skipped = skipped + bad.astype(jnp.int32)", "skipped = bad.astype(jnp.int32)",
           SKIP),
    Mutant("unweighted fast path taken with skip_nonfinite", P,
           "plain = weight is None and not opts.skip_nonfinite", "plain = weight is None", SKIP),
    Mutant("divides_safely ignores skip_nonfinite", "jaxaccum/_options.py",
           "return self.weighted or self.skip_nonfinite", "return self.weighted",
           SKIP + TRAIN),
    Mutant("unroll ignored", P,
           "body, start, jnp.arange(k), unroll=acc.options.unroll)",
           "body, start, jnp.arange(k))", tests("tests/test_accumulate.py", "-k", "unroll")),
    # --- aux reductions (records) and their masking in micro_step -----------------------------
    Mutant("aux weighted_mean lets a skipped micro-batch's NaN through", P,
           "accs = [new_acc if r.stacked else jnp.where(bad, old, new_acc)",
           "accs = [new_acc if r.stacked else new_acc", AUX),
    Mutant("aux weighted_mean adds w * x unmasked", R,
           "lambda acc, x, w: weighted_add(acc, x, w),",
           "lambda acc, x, w: acc + w.astype(acc.dtype) * x,", AUX),
    Mutant("aux weighted_mean divides by the count", R,
           "lambda acc, total, count: safe_divide(acc, total),",
           "lambda acc, total, count: acc / count,", AUX),
    Mutant("aux mean divides by the total weight", R,
           "lambda acc, total, count: acc / count,", "lambda acc, total, count: acc / total,",
           AUX),
    Mutant("aux max/min start at 0", R,
           "lambda shape, dtype: jnp.full(shape, _extreme(dtype, largest=not largest), dtype),",
           "lambda shape, dtype: jnp.zeros(shape, dtype),", AUX),
    Mutant("aux max/min start at the wrong end of the range", R,
           "_extreme(dtype, largest=not largest)", "_extreme(dtype, largest=largest)", AUX),
    Mutant("aux sum in the leaf's own narrow dtype", R,
           "lambda shape, dtype: jnp.zeros(shape, _wide(dtype)),",
           "lambda shape, dtype: jnp.zeros(shape, dtype),", AUX),
    Mutant("concat aux not reordered (strided order returned)", R,
           "return jnp.swapaxes(ys, 0, 1).reshape((-1, *ys.shape[2:]))",
           "return ys.reshape((-1, *ys.shape[2:]))", AUX),
    Mutant("aux 'last' across devices takes the first device", R,
           "jax.lax.axis_index(axes) == n - 1", "jax.lax.axis_index(axes) == 0",
           mesh("auto_mesh_aux")),
    Mutant("aux max across devices summed", R,
           "jax.lax.pmax if largest else jax.lax.pmin,",
           "jax.lax.psum if largest else jax.lax.pmin,",
           mesh("auto_mesh_aux")),
    Mutant("aux mean on a mesh divided by the per-device count", P,
           "count = placement.count(k)", "count = k", mesh("auto_mesh_aux")),
    # --- carried arguments --------------------------------------------------------------------
    Mutant("carry_argnums (3, 2) threads values into the wrong arguments", A,
           "return replace(args, self.carry, carry)",
           "return replace(args, tuple(sorted(self.carry)), carry)",
           CARRY + (GUARDS, "-k", "reversed_order")),
    # --- placements ---------------------------------------------------------------------------
    Mutant("auto mesh skipped count not summed over devices", PL,
           "loss, weight, skipped = jax.lax.psum((sums.loss, sums.weight, sums.skipped), "
           "self.axes)",
           "(loss, weight), skipped = jax.lax.psum((sums.loss, sums.weight), self.axes), "
           "sums.skipped", mesh("skipped_count")),
    Mutant("device count over every mesh axis, not the data axes", PL,
           "return math.prod(self.dp.mesh.shape[a] for a in self.axes)",
           "return math.prod(self.dp.mesh.shape[a] for a in self.dp.mesh.axis_names)",
           mesh("microbatches_count_only")),
    Mutant("ZeRO-3 gather not pinned inside the loop", PL,
           "return acc.with_fun(gathered, pin_in_loop=True)",
           "return acc.with_fun(gathered, pin_in_loop=False)",
           (GUARDS, "-k", "zero3", SHARDED, "-k", "fsdp_memory_both", PIPE)),
    Mutant("explicit reduce_once always falls back to a reshard", PL,
           "if (per_microbatch or not reduced or not _specs.uses(spec, g.ndim, self.axes)",
           "if (True or per_microbatch or not reduced or not _specs.uses(spec, g.ndim, "
           "self.axes)",
           (GUARDS, "-k", "explicit_fsdp", SHARDED, "-k", "reduce_scattered and explicit")),
    Mutant("explicit finite flag: non-finite partials not zeroed", PL,
           "return bad, tuple(jnp.where(bad > 0, jnp.zeros_like(g), g) for g in gs)",
           "return bad, gs", mesh("explicit_mesh_skips")),
    Mutant("explicit finite flag not reduced over devices", PL,
           "bad = jax.lax.pmax(jnp.logical_not(_reductions.all_finite(gs)).astype(jnp.int32),\n"
           "                               names)",
           "bad = jnp.logical_not(_reductions.all_finite(gs)).astype(jnp.int32)",
           mesh("explicit_mesh_skips")),
    Mutant("explicit negative weight not poisoned", PL,
           "w_reduced = jax.reshard(_reductions.valid_weight(w), P(reduced=set(unreduced)))",
           "w_reduced = jax.reshard(w, P(reduced=set(unreduced)))", mesh("negative_weight")),
    Mutant("auto mesh accepts carried state", PL,
           "        if acc.carry:\n            raise ValueError(",
           "        if False:\n            raise ValueError(",
           (GUARDS, "-k", "refuses_carried", SHARDED, "-k", "carried_state", PIPE)),
    # --- NNX ----------------------------------------------------------------------------------
    Mutant("nnx step steps when every micro-batch is skipped", "jaxaccum/nnx.py",
           "if opts.divides_safely:  # a step of weight 0 changes nothing",
           "if opts.weighted:  # a step of weight 0 changes nothing", NNX),
    Mutant("nnx step ignores the optimizer's wrt", "jaxaccum/nnx.py",
           "optimizer.wrt if wrt is", "nnx.Param if wrt is", NNX + (GUARDS, "-k", "nnx")),
    Mutant("nnx value_and_grad does not write the carried state back", "jaxaccum/nnx.py",
           "        write_back()\n        return _value_and_grad.shape_value(acc, res, "
           "with_carry=False), res.grads",
           "        return _value_and_grad.shape_value(acc, res, with_carry=False), res.grads",
           NNX),
    Mutant("nnx graph nodes given by keyword not carried", "jaxaccum/nnx.py",
           "node_kw = tuple(k for k, v in kwargs.items() if nnx.graph.is_graph_node(v))",
           "node_kw = ()", NNX),
    # --- linen --------------------------------------------------------------------------------
    Mutant("linen step steps on a zero-weight batch", "jaxaccum/linen.py",
           "if opts.divides_safely:  # nothing to learn from",
           "if opts.skip_nonfinite:  # nothing to learn from", LINEN),
    Mutant("apply_gradients keeps the old _overwrite_with_gradient value", "jaxaccum/linen.py",
           'params, overwrite = state.params["params"], grads[OVERWRITE_WITH_GRADIENT]',
           'params, overwrite = state.params["params"], state.params[OVERWRITE_WITH_GRADIENT]',
           LINEN),
    Mutant("apply_gradients drops weight=", "jaxaccum/linen.py",
           'extra = {} if weight is None else {"weight": weight}', "extra = {}", LINEN),
    Mutant("apply_gradients counts calls, not optimizer steps", "jaxaccum/linen.py",
           "return after[0].gradient_step - before[0].gradient_step", "return 1", LINEN),
    Mutant("linen batch_stats not written back", "jaxaccum/linen.py",
           "return new if stats is None else new.replace(batch_stats=res.carry[0])",
           "return new", LINEN),
    Mutant("linen one dropout key for every micro-batch", "jaxaccum/linen.py",
           "rngs = {name: jax.random.fold_in(key, count) for name, key in keys.items()}",
           "rngs = {name: key for name, key in keys.items()}", LINEN),
    # --- plan_microbatches --------------------------------------------------------------------
    Mutant("plan_microbatches does not sort user candidates", "jaxaccum/_plan.py",
           "ks = sorted(set(candidates)) if candidates", "ks = list(candidates) if candidates",
           PLAN),
    Mutant("plan compares temp bytes only", "jaxaccum/_plan.py",
           "if estimate.total_bytes <= budget:", "if estimate.temp_bytes <= budget:", PLAN),
    Mutant("plan total ignores aliasing (donation)", "jaxaccum/_plan.py",
           "num_microbatches, argument, output, alias, temp, argument + output - alias + temp",
           "num_microbatches, argument, output, alias, temp, argument + output + temp",
           PLAN + (GUARDS, "-k", "plan_total")),
    # --- convolution layout -------------------------------------------------------------------
    Mutant("convolutions under lax.cond not rewritten", "jaxaccum/_conv_layout.py",
           "key: type(v)(map(_rewrite, v)) if isinstance(v, (tuple, list)) else _rewrite(v)",
           "key: v if isinstance(v, (tuple, list)) else _rewrite(v)", CONV),
    Mutant("canonical conv output transposed back wrong", "jaxaccum/_conv_layout.py",
           "perm[ob], perm[of] = 0, n - 1", "perm[ob], perm[of] = n - 1, 0",
           CONV + (GUARDS, "-k", "conv_rewrite")),
    Mutant("conv rewrite on every platform but CPU", "jaxaccum/_conv_layout.py",
           "cpu=rewritten, default=traced.call", "cpu=traced.call, default=rewritten", CONV),
    # --- options and front-end plumbing -------------------------------------------------------
    Mutant("Options parse does not reject a renamed option", "jaxaccum/_options.py",
           '    "fsdp": "mesh=jaxaccum.DataParallel(mesh, data_axis=..., fsdp=...)",\n', "",
           OPTIONS),
    Mutant("weighted not type-checked", "jaxaccum/_options.py",
           '    _check_bool(entry, "weighted", out.weighted)\n', "",
           OPTIONS + (GUARDS, "-k", "bools")),
    Mutant("Equinox module not filtered", "jaxaccum/_pytrees.py",
           "    return is_equinox_module(tree) or has_non_arrays(tree)",
           "    return has_non_arrays(tree)", EQX),
    # variable work per step, coupled losses
    Mutant("runtime count ignored: all K micro-batches run", P,
           "jax.lax.fori_loop(0, count, step, (start, ys))",
           "jax.lax.fori_loop(0, k, step, (start, ys))", VARIABLE),
    Mutant("micro-batch stack flattened contiguously", "jaxaccum/_microbatches.py",
           "return jnp.swapaxes(x, 0, 1).reshape((-1, *x.shape[2:]))",
           "return x.reshape((-1, *x.shape[2:]))", VARIABLE),
    Mutant("noise trace divided by m, not m - 1", "jaxaccum/_noise.py",
           "trace = (weighted_sq - big * g_big) / (m - 1.0)",
           "trace = (weighted_sq - big * g_big) / m", NOISE),
    Mutant("noise: micro-batch norms not weighted by their items", "jaxaccum/_noise.py",
           "term = jnp.stack([items * squared_norm(grads), items",
           "term = jnp.stack([squared_norm(grads), items", NOISE),
    Mutant("coupled: cotangents not scaled to the batch", "jaxaccum/_coupled.py",
           "return dot * (size / m), jnp.asarray(m, jnp.float32)",
           "return dot, jnp.asarray(m, jnp.float32)", COUPLED),
    Mutant("token_mean counts padding", "jaxaccum/packing.py",
           "    count = jnp.sum(real, dtype=acc)\n",
           "    count = jnp.sum(jnp.ones_like(real), dtype=acc)\n", PACKING),
    Mutant("emit ignored", "jaxaccum/_multi_steps.py",
           "        caller_emit = _emit_flag(emit)\n", "        caller_emit = None\n", EMIT),
]

# mutants believed equivalent (no observable change), with the reason: reported beside the result
EQUIVALENT = {
    "explicit negative weight not poisoned": "ExplicitMesh.add's valid_weight is redundant: "
    "the loss and the total weight already go through valid_weight (weighted_add, add_weight), "
    "so a negative weight makes the total NaN and finalize's safe_divide turns every gradient "
    "NaN anyway; with skip_nonfinite an invalid weight is zeroed before add",
}

# old mutants whose code is gone, with the reason
RETIRED = {
    "remat ignored": "the remat option is gone (jaxaccum.Options documents why): no code left "
    "to mutate",
}


# --- running one mutant -------------------------------------------------------------------------


def snapshot(dest: pathlib.Path, overlays: list[str]) -> None:
    """The committed tree (``git archive HEAD``) in ``dest``, plus the overlay files."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    for path in overlays:
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, target)


def environment(tree: pathlib.Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    mnist = ROOT.parent / "shared" / "mnist"  # tests/conftest.py looks beside the checkout
    if "JAXACCUM_MNIST_DIR" not in env and mnist.is_dir():
        env["JAXACCUM_MNIST_DIR"] = str(mnist)
    return env


def check_imports_from(tree: pathlib.Path) -> None:
    """The tests must import jaxaccum from the snapshot, not from an installed checkout."""
    out = subprocess.run([sys.executable, "-c", "import jaxaccum; print(jaxaccum.__file__)"],
                         cwd=tree, env=environment(tree), capture_output=True, text=True,
                         check=True).stdout.strip()
    if not pathlib.Path(out).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"jaxaccum imports from {out}, not from the snapshot {tree}")


_TRACEBACK_END = re.compile(r"^(\w+(?:\.\w+)*(?:Error|Exception|Exit|Interrupt)\b.*)$", re.M)


def outcomes(report: pathlib.Path) -> list[tuple[str, str]]:
    """``(status, test and message)`` of every failing test in pytest's JUnit XML report, in
    the order run: ``killed`` for an assertion, ``crashed`` for anything else."""
    found = []
    for case in ET.parse(report).getroot().iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is None:
                continue
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            message = node.get("message") or ""
            text = node.text or ""
            first = message.splitlines()[0][:160] if message else ""
            if tag == "error":  # setup/teardown or collection
                found.append(("crashed", f"{name} (error: {first})"))
                continue
            assertion = message.startswith(("AssertionError", "Failed:", "assert "))
            if assertion and "Traceback (most recent call last)" in message + text:
                # a subprocess script's output embedded in the assertion: did it die of an
                # exception other than an assertion?
                ends = _TRACEBACK_END.findall(message or text)
                if ends and not ends[-1].startswith("AssertionError"):
                    found.append(("crashed", f"{name} (subprocess: {ends[-1][:160]})"))
                    continue
            found.append(("killed" if assertion else "crashed", f"{name} ({first})"))
    return found or [("crashed", "no failing test in the report")]


def run(mutant: Mutant, pristine: pathlib.Path, scratch: pathlib.Path) -> dict:
    record = {"name": mutant.name, "file": mutant.file}
    source = (pristine / mutant.file).read_text()
    found = source.count(mutant.old)
    if found != 1:
        return {**record, "status": f"not applicable (text found {found} times)",
                "killed_by": None, "seconds": 0.0}
    work = scratch / "tree"
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(pristine, work)
    (work / mutant.file).write_text(source.replace(mutant.old, mutant.new, 1))
    # a test file that is not in the snapshot is left out, and said so
    missing = sorted({a.split("::")[0] for i, a in enumerate(mutant.tests)
                      if a.startswith("tests/") and (i == 0 or mutant.tests[i - 1] != "-k")
                      and not (work / a.split("::")[0]).exists()})
    paths = [a for i, a in enumerate(mutant.tests)
             if a != "-k" and (i == 0 or mutant.tests[i - 1] != "-k")
             and a.split("::")[0] not in missing]
    if not paths:
        return {**record, "status": "no tests (files missing: " + ", ".join(missing) + ")",
                "killed_by": None, "seconds": 0.0}
    select = _selection(mutant.tests, missing)
    report = scratch / "report.xml"
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE",
           "--tb=short", f"--junitxml={report}", *dict.fromkeys(paths)]
    if select:
        cmd += ["-k", select]
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=TIMEOUT_S,
                              env=environment(work))
    except subprocess.TimeoutExpired:
        return {**record, "status": "crashed", "killed_by": f"timeout after {TIMEOUT_S} s",
                "seconds": round(time.time() - start, 1)}
    seconds = round(time.time() - start, 1)
    if proc.returncode == 0:
        status, by = "survived", None
    elif proc.returncode == 5:
        status, by = "no tests collected", " ".join(cmd[-4:])
    elif report.exists():
        status, by = outcomes(report)[0]
    else:
        status, by = "crashed", (proc.stdout + proc.stderr).strip().splitlines()[-1][:200]
    out: dict[str, Any] = {**record, "status": status, "killed_by": by, "seconds": seconds}
    if status == "crashed" and report.exists():
        # the suite noticed the mutant only by an exception; do the other selected tests (a
        # guard written for a silent variant of the bug) kill it with an assertion?
        report.unlink()
        try:
            subprocess.run([a for a in cmd if a != "-x"], cwd=work, capture_output=True,
                           text=True, timeout=TIMEOUT_S, env=environment(work))
        except subprocess.TimeoutExpired:
            pass
        kills = [by for st, by in outcomes(report) if st == "killed"] if report.exists() else []
        out["crashed_first"] = by
        if kills:
            out.update(status="killed", killed_by=kills[0])
        out["seconds"] = round(time.time() - start, 1)
    if missing:
        out["missing_tests"] = missing
    return out


def _selection(args: tuple[str, ...], missing: list[str]) -> str | None:
    """One ``-k`` expression for a test list like ``(file, -k, expr, file2, file3, -k, e)``:
    each ``-k`` applies to the files since the previous one; files without one (or with
    ``-k *``) run whole. Tests are
    selected by name, so a file's expression is tied to that file's module name."""
    groups: list[tuple[list[str], str | None]] = []
    files: list[str] = []
    it = iter(args)
    for a in it:
        if a == "-k":
            groups.append((files, next(it)))
            files = []
        else:
            files.append(a)
    if files:
        groups.append((files, None))
    if all(expr is None for _, expr in groups):
        return None
    parts = []
    for group, expr in groups:
        for f in group:
            path = f.split("::")[0]
            if path in missing:
                continue
            module = pathlib.Path(path).stem
            whole = expr is None or expr == "*"
            parts.append(f"({module})" if whole else f"({module} and ({expr}))")
    return " or ".join(parts)


# --- main ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[],
                        help="run the mutants whose name contains this (repeatable)")
    parser.add_argument("--exclude", action="append", default=[],
                        help="leave out the mutants whose name contains this (repeatable)")
    parser.add_argument("--file", default="", help="run the mutants of files containing this")
    parser.add_argument("--overlay", action="append", default=[],
                        help="copy this working-tree file over the snapshot (repeatable)")
    parser.add_argument("--part", default="1/1",
                        help="I/N: run every N-th chosen mutant from the I-th (parallel runs)")
    parser.add_argument("--list", action="store_true", help="list the chosen mutants and exit")
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS,
                        help="the results file to merge into (default: %(default)s)")
    parser.add_argument("--merge", type=pathlib.Path, nargs="+", default=[],
                        help="merge these results files into --results (no mutant is run)")
    args = parser.parse_args()
    if args.merge:
        records = [r for f in args.merge for r in _load(f)]
        write(args.results, records)
        return
    chosen = [m for m in MUTANTS
              if (not args.only or any(s in m.name for s in args.only)) and args.file in m.file
              and not any(s in m.name for s in args.exclude)]
    part, parts = map(int, args.part.split("/"))
    chosen = chosen[part - 1::parts]
    if args.list:
        for m in chosen:
            print(f"{m.file:28} {m.name}")
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        scratch = pathlib.Path(tmp)
        pristine = scratch / "pristine"
        snapshot(pristine, args.overlay)
        check_imports_from(pristine)
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        for mutant in chosen:
            result = {**run(mutant, pristine, scratch), "commit": commit}
            if args.overlay:
                result["overlays"] = args.overlay
            if mutant.name in EQUIVALENT and result["status"] == "survived":
                result["equivalent"] = EQUIVALENT[mutant.name]
            results.append(result)
            print(f"{result['status']:>9}  {result['seconds']:6.1f}s  {mutant.file}: "
                  f"{mutant.name}  {result.get('killed_by') or ''}", flush=True)
            write(args.results, [result], quiet=True)  # after each: an interrupted run keeps them
    write(args.results, results)


def _load(path: pathlib.Path) -> list[dict]:
    """The mutant records of a results file this runner wrote (older formats: none)."""
    old = json.loads(path.read_text()) if path.exists() else {}
    return old.get("mutants", []) if old.get("format") == FORMAT else []


def write(path: pathlib.Path, results: list[dict], quiet: bool = False) -> None:
    """``results`` merged by name into the records already in ``path``, in MUTANTS' order."""
    previous = _load(path)
    by_name = {r["name"]: r for r in previous
               if any((m.name, m.file) == (r["name"], r["file"]) for m in MUTANTS)}
    by_name.update({r["name"]: r for r in results})
    merged = [by_name[m.name] for m in MUTANTS if m.name in by_name]
    counts: dict[str, int] = {}
    for r in merged:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    path.write_text(json.dumps({
        "format": FORMAT,  # each record names the commit it ran on (and any overlays)
        "counts": counts,
        "total": len(merged),
        "retired": RETIRED,
        "mutants": merged,
    }, indent=2) + "\n")
    if not quiet:
        print(", ".join(f"{v} {k}" for k, v in sorted(counts.items())), f"of {len(merged)}")


if __name__ == "__main__":
    main()
