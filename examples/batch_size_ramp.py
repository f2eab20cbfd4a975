"""A batch-size ramp driven by the gradient noise scale, in one compiled program (MNIST).

The step is built once with ``max_microbatches=K`` and ``noise_scale=True``: each call takes
a ``(K, m, ...)`` stack of micro-batches of which the first ``count`` are real, ``count``
being traced, so every batch size ``count * m`` runs the same compiled program. The ramp keeps
an EMA of the step's ``trace`` and ``gradient_sq`` estimates, reads ``B_simple = trace /
gradient_sq`` (McCandlish et al. 2018) and every few steps sets ``count = clip(round(B_simple /
m), 2, K)``, never shrinking. Two fixed-batch runs (``count = 2`` and ``count = K``) see the
same examples in the same order, same model, same optimizer (Adam, one learning rate for all).
This is an example policy, not part of the library.

    python examples/batch_size_ramp.py            # full run, ~1 min on 2 CPU cores
    python examples/batch_size_ramp.py --smoke    # a few steps of each run, < 30 s

The full run writes ``ramp.json`` (the per-step series) and ``ramp.png`` (the plot) to
``--out`` (default: ``results/`` in the repository, which git ignores); ``--smoke`` writes
nothing. MNIST is read as ``jaxaccum-gist`` reads it: prepared once by tensorflow-datasets in
its data_dir (``--data-dir``, default ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``) and
reused by every later run; the first run downloads the four MNIST files, or offline takes them
from ``--manual-dir`` (default ``$JAXACCUM_MNIST_DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tensorflow_datasets as tfds

import jaxaccum
from jaxaccum.experiment import data as mnist_data
from jaxaccum.experiment import gist, models

ROOT = Path(__file__).resolve().parents[1]
M, K = 16, 64  # micro-batch of 16 examples, at most 64 of them: batch sizes 32 .. 1024
LR, EMA, UPDATE_EVERY, SEED = 1e-3, 0.95, 10, 0
TRACES = [0]  # how many times the loss function was traced (once per compiled program)


def load(args) -> gist.Mnist:
    """MNIST as jaxaccum-gist loads it: prepared once in TFDS' data_dir, then reused."""
    tfds.disable_progress_bar()
    try:
        return gist.load(args)
    except gist.DataUnavailable as e:  # offline without the files, a bad file: one line
        raise SystemExit(f"batch_size_ramp.py: {e}") from None


def tidy(v):
    """JSON-friendly: ints as they are, floats to 6 digits, NaN as null."""
    return v if isinstance(v, int) else None if v != v else float(f"{v:.6g}")


def run(name, step, params, data, order, budget, eval_at, policy):
    """Trains until ``budget`` examples are seen; ``policy`` is a fixed count or "ramp"."""
    evaluate, (xs, ys) = data
    params = jax.tree.map(jnp.array, params)  # a fresh copy: the step donates its arguments
    opt_state = optax.adam(LR).init(params)
    count = 2 if policy == "ramp" else policy
    ema_trace = ema_gsq = 0.0
    rows, evals, seen, t0 = [], [], 0, time.perf_counter()
    while seen < budget:
        idx = order[seen:seen + count * M]  # every run reads the same example sequence
        mb = jaxaccum.microbatches((xs[idx], ys[idx]), microbatch_size=M, max_microbatches=K)
        params, opt_state, loss, info = step(params, opt_state, mb)
        seen += count * M
        ns = info.noise_scale  # needs count >= 2: one small batch has nothing to compare with
        ema_trace = EMA * ema_trace + (1 - EMA) * float(ns.trace)
        ema_gsq = EMA * ema_gsq + (1 - EMA) * float(ns.gradient_sq)
        # the EMAs' common bias (1 - EMA^t) cancels in the ratio
        b_simple = ema_trace / ema_gsq if ema_gsq > 0 else float("nan")
        rows.append({"step": len(rows) + 1, "loss": float(loss), "seen": seen,
                     "count": int(info.num_microbatches), "b_simple": b_simple})
        if np.any((eval_at > seen - count * M) & (eval_at <= seen)) or seen >= budget:
            test_loss, acc = evaluate(params)
            evals.append({"step": len(rows), "seen": seen, "test_loss": float(test_loss),
                          "test_acc": float(acc)})
        if policy == "ramp" and len(rows) % UPDATE_EVERY == 0 and b_simple > 0:
            count = max(count, int(np.clip(round(b_simple / M), 2, K)))  # only grows
    last = evals[-1]
    print(f"{name:>12}: {len(rows):5d} steps, {seen} examples, test loss "
          f"{last['test_loss']:.5f}, acc {last['test_acc']:.4f}, final batch "
          f"{rows[-1]['count'] * M}, {time.perf_counter() - t0:.1f} s")
    columns = {k: [tidy(r[k]) for r in rows] for k in rows[0]}  # the per-step series
    return {"steps": columns, "evals": evals, "seconds": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps of each run")
    parser.add_argument("--seed", type=int, default=SEED, help="seed of the example order")
    parser.add_argument("--epochs", type=float, default=2.0, help="training epochs per run")
    parser.add_argument("--out", type=Path, default=ROOT / "results",
                        help="folder for ramp.json and ramp.png of the full run (default: "
                        "results/ in the repository, ignored by git)")
    mnist_data.add_arguments(parser)  # --data-dir, --manual-dir: those of jaxaccum-gist
    args = parser.parse_args()

    mnist = load(args)
    apply, params = models.functional(models.GistMLP())
    test_x, test_y = mnist.test_images[:5000], mnist.test_labels[:5000]  # fixed test subset

    def loss_fn(p, batch):
        TRACES[0] += 1  # Python side effect: runs only while tracing
        x, y = batch
        return models.mse_one_hot(apply(p, x), y)

    @jax.jit
    def evaluate(p):
        out = apply(p, test_x)
        return models.mse_one_hot(out, test_y), jnp.mean(jnp.argmax(out, -1) == test_y)

    # One step object, hence one program, for all three runs.
    step = jaxaccum.train_step(loss_fn, optax.adam(LR), max_microbatches=K, noise_scale=True)
    budget = 4 * K * M if args.smoke else int(args.epochs * len(mnist.train_labels))
    # test-set evaluations at a geometric grid of examples seen (the same for every run)
    eval_at = np.unique(np.geomspace(4 * M, budget, 12 if args.smoke else 60).astype(int))
    rng = np.random.default_rng(args.seed)  # the example order: reshuffled every epoch
    epochs = budget // len(mnist.train_labels) + 2
    order = np.concatenate([rng.permutation(len(mnist.train_labels)) for _ in range(epochs)])
    data = (evaluate, (mnist.train_images, mnist.train_labels))

    runs = {"ramp": run("ramp", step, params, data, order, budget, eval_at, "ramp")}
    traces = TRACES[0]
    assert step.num_programs == 1, "ramp recompiled"  # every count ran the same program
    runs["fixed_small"] = run("fixed 32", step, params, data, order, budget, eval_at, 2)
    runs["fixed_large"] = run("fixed 1024", step, params, data, order, budget, eval_at, K)
    assert step.num_programs == 1 and TRACES[0] == traces, "a fixed run recompiled"
    counts = sorted(set(runs["ramp"]["steps"]["count"]))
    print(f"one compiled program for all three runs (loss traced {traces}x, all while "
          f"compiling the first step); the ramp's batch took {len(counts)} sizes, "
          f"{counts[0] * M}..{counts[-1] * M}")
    done = (f"GistMLP 784-100-10 on MNIST, {budget:,} examples a run (Adam {LR:g}): the batch "
            f"followed the noise scale {counts[0] * M} -> {counts[-1] * M} in one compiled "
            "program")
    if args.smoke:
        print(f"OK: {done}")
        return
    assert len(counts) > 1, "the ramp never grew"
    summary = report(runs)

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    machine = {"cpu": next((ln.split(":", 1)[1].strip() for ln in lines
                            if ln.startswith("model name")), platform.processor()),
               "cores": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
               "python": platform.python_version()}
    config = {"microbatch_size": M, "max_microbatches": K, "optimizer": f"adam({LR})",
              "ema": EMA, "update_every": UPDATE_EVERY, "examples_per_run": budget,
              "eval_at_examples": eval_at.tolist(), "test_examples": len(test_y),
              "model": "GistMLP 784-100-10, MSE on one-hot", "seed": args.seed,
              "ramp": "count = max(count, clip(round(B_simple_ema / m), 2, K)) every 10 steps"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ramp.json").write_text(json.dumps(
        {"config": config, "machine": machine, "summary": summary, "runs": runs},
        separators=(",", ":")))
    plot(runs, args.out / "ramp.png")
    print(f"wrote {args.out / 'ramp.json'} and {args.out / 'ramp.png'}")
    print(f"OK: {done}; it ended below fixed 1024's test loss in fewer steps than fixed 32")


def first(evals, target):
    """The first evaluation at or below ``target`` test loss, or None."""
    return next((e for e in evals if e["test_loss"] <= target), None)


def report(runs) -> dict:
    """Prints the comparison, asserts the parts of it this example claims, returns it."""
    final = {k: r["evals"][-1]["test_loss"] for k, r in runs.items()}
    out = {"final_test_loss": final, "steps": {k: len(r["steps"]["step"]) for k, r in runs.items()}}
    # steps and examples each run needed to reach the fixed-large and the ramp final losses
    for target in ("fixed_large", "ramp"):
        hits = {k: first(r["evals"], final[target]) for k, r in runs.items()}
        out[f"to_reach_{target}_final"] = {k: h and {"step": h["step"], "seen": h["seen"]}
                                          for k, h in hits.items()}
        said = ["never" if h is None else f"{h['step']} steps / {h['seen']} examples"
                for h in hits.values()]
        print(f"to reach test loss {final[target]:.5f} ({target}'s final): "
              + ", ".join(f"{k} {w}" for k, w in zip(hits, said, strict=True)))
    # The claims: for the same examples the ramp ends below the large batch, and it needs
    # several times fewer optimizer steps than the small batch to reach that loss.
    reach = out["to_reach_fixed_large_final"]
    assert final["ramp"] < final["fixed_large"], "the ramp did no better than fixed 1024"
    assert reach["ramp"]["step"] < reach["fixed_small"]["step"], "ramp needed more steps"
    return out


def plot(runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = {"ramp": "ramp (32 → ≤1024)", "fixed_small": "fixed 32", "fixed_large": "fixed 1024"}
    for key, r in runs.items():
        ev = r["evals"]
        for ax, x in zip(axes[:2], ("step", "seen"), strict=True):
            ax.plot([e[x] for e in ev], [e["test_loss"] for e in ev], label=labels[key])
    for ax, xl in zip(axes[:2], ("optimizer steps", "examples seen"), strict=True):
        ax.set(xlabel=xl, ylabel="test loss (MSE)", xscale="log", yscale="log")
        ax.legend()
    ramp = runs["ramp"]["steps"]
    axes[2].plot(ramp["seen"], np.multiply(ramp["count"], M), label="batch size")
    axes[2].plot(ramp["seen"], ramp["b_simple"], alpha=0.6, label="B_simple (EMA)")
    axes[2].set(xlabel="examples seen", ylabel="examples", yscale="log", title="ramp")
    axes[2].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
