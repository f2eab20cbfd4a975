"""Model families: time per optimizer step, temp bytes and compile time, per way and k.

Families (``model_zoo.py``): the gist MLP (batch 64, SGD), a CNN (batch 256, SGD), a
token-weighted decoder LM (batch 32, Adam) and the same LM with bfloat16 parameters.

Ways, all making the same optimizer step on the same batch: ``full batch`` (one jitted gradient
and update), ``jaxaccum.train_step`` (the library as it is), ``Python loop`` (k jitted
micro-batch gradient calls summed on device, one jitted update), ``optax.MultiSteps`` (one
jitted call per micro-batch), ``optax.microbatching`` (``microbatch`` around the gradient in
one jitted step); the bf16 LM only the first three, at k = 1 and 8. Ways run interleaved round
by round; medians; ratios within the same rounds. Every program is compiled ahead of time
once: its compile time (lower + compile) and ``memory_analysis()`` temp bytes are recorded
(per-call ways: their per-micro-batch program), with params and state donated and (not with
``--quick``) without.

Time on 2 cores: ~8 min (default rounds: MLP 30, CNN 4, transformers 3); ``--quick`` ~2.5 min
(k = 1, 4, 16, 64, a third of the rounds). Writes ``results/OUT.json`` and ``OUT.png``
(``--out``, default ``models``; ``--quick`` writes ``models_quick``; the repeat runs
``models_cnn_r12``, ``models_transformer_r8``, ``models_mlp_r600``... came from ``--out``).
Print them with ``python benchmarks/report.py`` (``--models OUT`` for a repeat run).

    python benchmarks/families.py
    python benchmarks/families.py --quick
    python benchmarks/families.py --families cnn --rounds 12 --out models_cnn_r12
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from _common import Impl, apply_update, machine, result_path, save
from model_zoo import (
    FAMILIES,
    KS,
    Family,
    compile_timed,
    copy,
    families,
    strided_micro_batches,
    train_step,
)


def _value(fam: Family) -> Callable[..., Any]:
    """The loss as ``jax.value_and_grad`` of the full batch wants it (weight dropped)."""
    if fam.weighted:
        return lambda p, b: fam.loss(p, b)[0]
    return fam.loss


def _donate(donate: bool) -> tuple[int, ...]:
    return (0, 1) if donate else ()


class Way(Impl):
    """An ``_common.Impl`` on a model family: the family's loss, optimizer and weighting.

    ``build`` compiles ahead of time (timed; temp bytes), ``step`` runs one optimizer step on
    ``prepare(batch)`` (per-call ways: the strided micro-batches, as jaxaccum splits). A
    single-program way says what it compiles in ``program(donate)``.
    """

    def __init__(self, fam: Family, k: int) -> None:
        super().__init__(k)
        self.fam, self.optimizer = fam, fam.optimizer
        self.compile_s = 0.0
        self.temp = 0
        self.temp_undonated: int | None = None

    def prepare(self, batch: Any) -> Any:
        return strided_micro_batches(batch, self.k) if self.per_call else batch

    def program(self, donate: bool) -> Any:
        """The single jitted program (donating params and state, or not); None if per call."""
        return None

    def build(self, params: Any, state: Any) -> None:
        self.fn = self._compile(self.program(donate=True), params, state, self.fam.batch)

    def measure_undonated(self, params: Any, state: Any) -> None:
        """Temp bytes of the same program without donation (as benchmarks/memory.py measures:
        with donation XLA:CPU keeps one more gradient-sized buffer in every way, the full batch
        included, because the update cannot overwrite a parameter still being read)."""
        program = self.program(donate=False)
        if program is not None:
            self.temp_undonated = compile_timed(program, params, state, self.fam.batch)[2]

    def _compile(self, jitted: Any, *args: Any) -> Any:
        compiled, seconds, temp = compile_timed(jitted, *args)
        self.compile_s += seconds
        self.temp = max(self.temp, temp)
        return compiled


class Full(Way):
    name = "full batch"

    def program(self, donate: bool) -> Any:
        apply, value = apply_update(self.optimizer), _value(self.fam)
        return jax.jit(
            lambda p, s, b: apply(p, s, jax.grad(value)(p, b)), donate_argnums=_donate(donate)
        )


class TrainStep(Way):
    name = "jaxaccum.train_step"

    def program(self, donate: bool) -> Any:
        return train_step(self.fam, self.k, donate)


class PythonLoop(Way):
    """k jitted calls ``acc <- acc + w * grad(micro-batch)`` (acc donated), one jitted update."""

    name = "Python loop"
    per_call = True

    def build(self, params: Any, state: Any) -> None:
        fam, apply = self.fam, apply_update(self.optimizer)

        def add(p: Any, acc: Any, micro: Any) -> Any:
            if fam.weighted:
                (_, w), g = jax.value_and_grad(fam.loss, has_aux=True)(p, micro)
            else:
                w, g = jnp.ones(()), jax.grad(fam.loss)(p, micro)
            grads, total = acc
            grads = jax.tree.map(lambda a, x: a + w * x.astype(jnp.float32), grads, g)
            return grads, total + w

        def update(p: Any, s: Any, acc: Any) -> Any:
            grads, total = acc
            return apply(p, s, jax.tree.map(lambda a, x: (a / total).astype(x.dtype), grads, p))

        zeros = jax.jit(
            lambda p: (jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p), jnp.zeros(()))
        )
        self.zeros = self._compile(zeros, params)
        acc = self.zeros(params)
        micro = self.prepare(fam.batch)[0]
        self.add = self._compile(jax.jit(add, donate_argnums=1), params, acc, micro)
        self.update = self._compile(jax.jit(update, donate_argnums=(0, 1)), params, state, acc)

    def step(self, params: Any, state: Any, micro_batches: Any) -> Any:
        acc = self.zeros(params)
        for micro in micro_batches:
            acc = self.add(params, acc, micro)
        return self.update(params, state, acc)


class OptaxMultiSteps(Way):
    """optax.MultiSteps, one jitted call per micro-batch (params and state donated). It averages
    micro-batch mean gradients: with token weights (the transformer) it is not the exact
    token mean, only the same amount of work."""

    name = "optax.MultiSteps"
    per_call = True

    def __init__(self, fam: Family, k: int) -> None:
        super().__init__(fam, k)
        self.optimizer = optax.MultiSteps(fam.optimizer, k).gradient_transformation()

    def build(self, params: Any, state: Any) -> None:
        apply, value = apply_update(self.optimizer), _value(self.fam)
        fn = jax.jit(lambda p, s, b: apply(p, s, jax.grad(value)(p, b)), donate_argnums=(0, 1))
        self.fn = self._compile(fn, params, state, self.prepare(self.fam.batch)[0])

    def step(self, params: Any, state: Any, micro_batches: Any) -> Any:
        for micro in micro_batches:
            params, state = self.fn(params, state, micro)
        return params, state


class OptaxMicrobatching(Way):
    """optax.microbatching.microbatch around the gradient (a fori_loop), one update, one jit;
    weighted: it sums (w * grad, w) and divides, which is exact."""

    name = "optax.microbatching"

    def program(self, donate: bool) -> Any:
        fam, apply, size = self.fam, apply_update(self.optimizer), self.fam.size // self.k
        mb = optax.microbatching

        def weighted_grads(p: Any, batch: Any) -> Any:
            (_, w), g = jax.value_and_grad(fam.loss, has_aux=True)(p, batch)
            return jax.tree.map(lambda x: w * x.astype(jnp.float32), g), w

        def step(p: Any, s: Any, batch: Any) -> Any:
            if fam.weighted:
                summed = mb.microbatch(
                    weighted_grads,
                    argnums=1,
                    microbatch_size=size,
                    accumulator=mb.AccumulationType.SUM,
                )
                g, total = summed(p, batch)
                grads = jax.tree.map(lambda a, x: (a / total).astype(x.dtype), g, p)
            else:
                grads = mb.microbatch(
                    jax.grad(fam.loss),
                    argnums=1,
                    microbatch_size=size,
                    accumulator=mb.AccumulationType.MEAN,
                )(p, batch)
            return apply(p, s, grads)

        return jax.jit(step, donate_argnums=_donate(donate))


WAYS = (Full, TrainStep, PythonLoop, OptaxMultiSteps, OptaxMicrobatching)


def run_k(
    fam: Family, k: int, ways: tuple[type[Way], ...], rounds: int, undonated: bool
) -> dict[str, Any]:
    """Builds every way for this k, then times them interleaved, round by round."""
    built = []
    for cls in ways:
        way = cls(fam, k)
        params = copy(fam.params)
        state = way.init(params)
        way.build(params, state)
        if undonated:
            way.measure_undonated(params, state)
        built.append([way, params, state, way.prepare(fam.batch)])
    times: dict[str, list[float]] = {w.name: [] for w, *_ in built}
    for r in range(rounds + 1):  # the first round warms up
        for entry in built:
            way, params, state, data = entry
            start = time.perf_counter()
            out = jax.block_until_ready(way.step(params, state, data))
            if r:
                times[way.name].append(time.perf_counter() - start)
            entry[1], entry[2] = out[0], out[1]
    row = {}
    base = {n: statistics.median(times[n]) for n in times}
    for way, *_ in built:
        t = base[way.name]
        row[way.name] = {
            "ms": t * 1e3,
            "items_per_s": fam.items / t,
            "ratio_to_full": t / base[Full.name] if Full.name in base else None,
            "ratio_to_loop": t / base[PythonLoop.name] if PythonLoop.name in base else None,
            "temp_bytes": way.temp,
            "temp_bytes_undonated": way.temp_undonated,
            "compile_s": way.compile_s,
        }
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    fams = families(args.lm_batch)
    results: dict[str, Any] = {"machine": machine(), "quick": args.quick, "families": {}}
    for key in args.families:
        fam = fams[key]
        ways: tuple[type[Way], ...] = WAYS
        ks = fam.ks(args.ks)
        if key == "transformer_bf16":
            ways = (Full, TrainStep, PythonLoop)
            ks = [k for k in ks if k in (1, 8)]
        if args.quick:
            ks = [k for k in ks if k in (1, 4, 16, 64)]
        rounds = args.rounds or {"mlp": 30, "cnn": 4}.get(key, 3)
        if args.quick:
            rounds = max(1, rounds // 3)
        entry: dict[str, Any] = {
            "name": fam.name,
            "unit": fam.unit,
            "batch": fam.size,
            "items_per_step": fam.items,
            "rounds": rounds,
            "param_bytes": fam.param_bytes(),
            "by_k": {},
        }
        for k in ks:
            row = run_k(fam, k, ways, rounds, undonated=not args.quick)
            if k == ks[0]:
                entry["full_temp_bytes"] = row[Full.name]["temp_bytes"]
                entry["full_temp_bytes_undonated"] = row[Full.name]["temp_bytes_undonated"]
            entry["by_k"][k] = row
            print(
                f"{key:16s} k={k:3d} "
                + "  ".join(
                    f"{n}: {v['ms']:.1f}ms {v['temp_bytes'] / 2**20:.2f}MiB {v['compile_s']:.1f}s"
                    for n, v in row.items()
                ),
                flush=True,
            )
        results["families"][key] = entry
    return results


def plot(results: dict[str, Any], name: str = "models") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = results["families"]
    fig, axes = plt.subplots(2, len(entries), figsize=(5 * len(entries), 8), squeeze=False)
    for col, entry in enumerate(entries.values()):
        by_k = {int(k): row for k, row in entry["by_k"].items()}
        ks = sorted(by_k)
        for way in by_k[ks[0]]:
            axes[0][col].plot(ks, [by_k[k][way]["items_per_s"] for k in ks], marker="o", label=way)
            axes[1][col].plot(
                ks, [by_k[k][way]["temp_bytes"] / 2**20 for k in ks], marker="o", label=way
            )
        target = [
            (1.1 * entry["param_bytes"] + 1.2 * entry["full_temp_bytes"] / k) / 2**20 for k in ks
        ]
        axes[1][col].plot(ks, target, "k--", label="target 1.1P + 1.2A/k")
        axes[0][col].set_title(entry["name"], fontsize=8)
        axes[0][col].set_ylabel(f"{entry['unit']} per second")
        axes[1][col].set_ylabel("temp MiB (memory_analysis, params donated)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("k")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=6)
    axes[1][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(result_path(name, "png"), dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--ks", nargs="+", type=int, default=list(KS))
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds (default: MLP 30, CNN 4, transformers 3)")
    parser.add_argument("--quick", action="store_true",
                        help="k = 1, 4, 16, 64, a third of the rounds, no undonated temp")
    parser.add_argument("--lm-batch", type=int, default=32, help="the transformers' batch")
    parser.add_argument("--out", default="models", help="results/OUT.json and OUT.png")
    args = parser.parse_args()
    if not args.out.startswith("models"):
        parser.error("--out must start with 'models'")
    if args.quick and args.out == "models":
        args.out = "models_quick"  # never overwrite the full run's results
    results = run(args)
    path = save(args.out, results)
    plot(results, args.out)
    print(f"wrote {path} and {result_path(args.out, 'png')}")


if __name__ == "__main__":
    main()
