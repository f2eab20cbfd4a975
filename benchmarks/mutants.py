"""Mutation testing: does the suite catch realistic bugs in the library's core modules?

Each mutant is one textual change to one file (the bug a careless edit would make). For each,
the checkout is copied to a temporary folder, the change applied, and the tests that cover that
module are run there (``pytest -x``: the first failure kills the mutant). A mutant whose tests
all pass *survives*: a hole in the suite. Results go to ``benchmarks/results/mutants.json``.

Run: ``python benchmarks/mutants.py [--only SUBSTRING]`` (about 10-20 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

ACC = ["tests/test_accumulate.py", "tests/test_carry.py"]
TRAIN = ["tests/test_train_step.py"]
MULTI = ["tests/test_multi_steps.py"]

# (name, file, old text, new text, tests to run)
MUTANTS = [
    ("finalize divides by weight + 1", "jaxaccum/_accumulate.py",
     "mean_loss = sums.loss / sums.weight", "mean_loss = sums.loss / (sums.weight + 1)", ACC),
    ("gradient mean divided by weight + 1", "jaxaccum/_accumulate.py",
     "grads = jax.tree.map(lambda g: g / sums.weight.astype(g.dtype), sums.grads)",
     "grads = jax.tree.map(lambda g: g / (sums.weight + 1).astype(g.dtype), sums.grads)", ACC),
    ("contiguous instead of strided micro-batches", "jaxaccum/_accumulate.py",
     "return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)",
     "return x.reshape((k, x.shape[0] // k) + x.shape[1:])", ACC),
    ("remat ignored", "jaxaccum/_accumulate.py",
     "fun=_with_remat(fun, remat),", "fun=fun,", ACC),
    ("accumulator narrower than the leaf", "jaxaccum/_reductions.py",
     "return jnp.promote_types(dtype, accumulator_dtype)", "return jnp.dtype(accumulator_dtype)",
     ACC),
    ("skip checks the loss only", "jaxaccum/_accumulate.py",
     "_reductions.all_finite((loss, grads))", "_reductions.all_finite(loss)", ACC),
    ("weight-0 NaN not masked", "jaxaccum/_reductions.py",
     "term = jnp.where(weight == 0, 0, valid_weight(weight).astype(acc.dtype) * g)",
     "term = valid_weight(weight).astype(acc.dtype) * g", ACC),
    ("weight-0 NaN micro-batch counted as skipped", "jaxaccum/_reductions.py",
     "skipped = jnp.logical_and(weight != 0, jnp.logical_not(jnp.logical_and(finite, weight > 0)))",
     "skipped = jnp.logical_not(finite)", ACC),
    ("negative weight silently clipped", "jaxaccum/_reductions.py",
     "return jnp.where(weight >= 0, weight, jnp.nan)", "return jnp.maximum(weight, 0)", ACC),
    ("invalid total divides to zero", "jaxaccum/_reductions.py",
     "nonzero = total != 0", "nonzero = total > 0", ACC),
    ("weights not stopped from the gradient", "jaxaccum/_accumulate.py",
     "w = jnp.ones((), jnp.float32) if weight is None else jax.lax.stop_gradient(weight)\n"
     "        w = jnp.asarray(w)",
     "w = jnp.ones((), jnp.float32) if weight is None else weight\n        w = jnp.asarray(w)",
     ACC),
    ("gradients not cast back to the parameters' dtype", "jaxaccum/_accumulate.py",
     "return mean_loss.astype(loss.dtype), _reductions.cast_like(grads, cfg.differentiated(args))",
     "return mean_loss.astype(loss.dtype), grads", ACC),
    ("carried state not threaded", "jaxaccum/_accumulate.py",
     "args = cfg.with_carry(args, sums.carry)", "pass", ACC),
    ("skipped micro-batch's carried update kept", "jaxaccum/_accumulate.py",
     "lambda old, new: jnp.where(bad, old, new), sums.carry, new_carry",
     "lambda old, new: new, sums.carry, new_carry", ACC),
    ("aux 'last' keeps the first", "jaxaccum/_reductions.py",
     "            new.append(x.astype(acc.dtype))\n    return new, stacked",
     "            new.append(acc)\n    return new, stacked", ACC),
    ("aux 'max' takes the min", "jaxaccum/_reductions.py",
     "new.append(jnp.maximum(acc, x))", "new.append(jnp.minimum(acc, x))", ACC),
    ("k == 1 aux not stacked", "jaxaccum/_accumulate.py",
     "ys = jax.tree.map(lambda x: jnp.expand_dims(jnp.asarray(x), 0), ys)", "pass", ACC),
    ("keyword arguments dropped", "jaxaccum/_accumulate.py",
     "return dataclasses.replace(cfg, fun=functools.partial(cfg.fun, **kwargs))", "return cfg",
     ACC),
    ("zero-weight step not skipped", "jaxaccum/_train_step.py",
     "optimizer, params, opt_state, out, cfg.divides_safely",
     "optimizer, params, opt_state, out, False", TRAIN),
    ("optimizer state not donated", "jaxaccum/_train_step.py",
     "donated = (0, 1, *(i + 1 for i in cfg.carry_argnums)) if self._donate else ()",
     "donated = (0, *(i + 1 for i in cfg.carry_argnums)) if self._donate else ()", TRAIN),
    ("params not passed to the optimizer", "jaxaccum/_train_step.py",
     "updates, new_state = optimizer.update(out.grads, opt_state, params)",
     "updates, new_state = optimizer.update(out.grads, opt_state)", TRAIN),
    ("updates applied twice", "jaxaccum/_train_step.py",
     "new_params = optax.apply_updates(params, updates)",
     "new_params = optax.apply_updates(optax.apply_updates(params, updates), updates)", TRAIN),
    ("multi_steps emits one call early", "jaxaccum/_multi_steps.py",
     "emit = mini_step >= jnp.asarray(", "emit = mini_step + 1 >= jnp.asarray(", MULTI),
    ("multi_steps extra args not passed to inner", "jaxaccum/_multi_steps.py",
     "inner_state, params, **extra_args", "inner_state, params", MULTI),
    ("multi_steps steps on an empty window", "jaxaccum/_multi_steps.py",
     "step = jnp.logical_and(emit, acc_weight != 0)", "step = emit", MULTI),
]


def run(mutant: tuple, keep: pathlib.Path) -> dict:
    name, path, old, new, tests = mutant
    source = (ROOT / path).read_text()
    if source.count(old) < 1:
        return {"name": name, "file": path, "status": "not applicable (text not found)"}
    work = keep / "tree"
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__",
                                                               "results", "*.png", ".hypothesis"))
    (work / path).write_text(source.replace(old, new, 1))
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
        cwd=work, capture_output=True, text=True, timeout=1800,
        env={**__import__("os").environ, "PYTHONPATH": str(work)},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED") or "Error" in ln]
    return {
        "name": name,
        "file": path,
        "status": "killed" if proc.returncode != 0 else "survived",
        "killed_by": lines[0][:200] if lines else None,
        "seconds": round(time.time() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the mutants whose name contains this")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.only in m[0]]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mutant in chosen:
            result = run(mutant, pathlib.Path(tmp))
            results.append(result)
            print(f"{result['status']:>9}  {result['name']}  {result.get('killed_by') or ''}",
                  flush=True)
    killed = sum(r["status"] == "killed" for r in results)
    print(f"{killed} of {len(results)} mutants killed")
    out = ROOT / "benchmarks" / "results" / "mutants.json"
    out.write_text(json.dumps({"killed": killed, "total": len(results), "mutants": results},
                              indent=2))


if __name__ == "__main__":
    main()
