"""The loop study: which loop form makes the CNN's accumulated gradient fast on XLA:CPU?

Jitted ``value_and_grad`` (no optimizer) of the CNN (batch 256), its flax NNX twin (k = 8) and
the gist MLP (batch 64), per k: the full batch; the library (``jaxaccum.value_and_grad``) with
``unroll`` 1, 2, 4 and k; a hand-written ``lax.scan`` (contiguous micro-batches); a Python loop
of k jitted micro-batch calls; and (CNN only) the library with its micro-batches split before
the loop, by a transposed copy (``swapaxes``, as before a4b2f71) or in contiguous blocks: these
two are the library with its split stage swapped while tracing (``_variants.py``, which checks
that the patched names exist and were called). Each program is compiled ahead of time (compile
seconds, temp bytes, ``hlo_summary``: where its convolutions and dots run), checked against the
full batch (``max_abs_diff``), then timed interleaved round by round (medians). Also the
compile time of the library with ``unroll`` 1 and k at k = 2, 8, 64 (``compile``).

Time on 2 cores: ~15 min (``--quick``: k = 1, 8, 64 and fewer rounds; not timed, about a
third). Writes ``results/OUT.json`` (``--out``, default ``models_loops``: keys ``cnn``,
``mlp`` with ``by_k.K.WAY`` = ``ms``, ``temp_bytes``, ``compile_s``, ``max_abs_diff``,
``hlo``, ``ratio_to_full``, ``ratio_to_loop``; ``nnx``; ``compile``).

The committed ``results/models_loops.json`` is evidence from before a4b2f71, made by this
study's earlier version (``benchmarks/models.py loops``), and its way names are those of that
time: ``jaxaccum`` is the library as it was then, ``proposed`` the prototype of what it is now
(benchmarks/notes/cnn_loops.md). A rerun measures the ways above, under other names, and would
replace it: give ``--out models_loops_rerun`` to keep both.

    python benchmarks/loops.py --quick --out models_loops_quick
    python benchmarks/loops.py --out models_loops_rerun
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from _common import GIST, machine, save
from _common import loss as mlp_loss
from _variants import variant
from model_zoo import (
    KS,
    cnn_data,
    cnn_loss,
    cnn_params,
    compile_timed,
    nnx_cnn,
    strided_micro_batches,
)

import jaxaccum
from jaxaccum._xla import hlo as _hlo

CNN = "CNN (2 conv + BatchNorm eval), 28x28x1, batch 256"


def _hand_scan(loss: Callable[..., Any], k: int) -> Callable[..., Any]:
    """The textbook loop: contiguous micro-batches, one lax.scan, a tree sum, one division."""

    def fn(params: Any, batch: Any) -> Any:
        xs = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)

        def body(acc: Any, micro: Any) -> Any:
            return jax.tree.map(jnp.add, acc, jax.value_and_grad(loss)(params, micro)), None

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
        (value, grads), _ = jax.lax.scan(body, zero, xs)
        return value / k, jax.tree.map(lambda g: g / k, grads)

    return fn


class _LoopVG:
    """A Python loop of k jitted micro-batch value_and_grad calls, summed on device."""

    def __init__(self, loss: Callable[..., Any], k: int) -> None:
        self.k = k
        self.add = jax.jit(
            lambda acc, p, b: jax.tree.map(jnp.add, acc, jax.value_and_grad(loss)(p, b)),
            donate_argnums=0,
        )
        self.first = jax.jit(jax.value_and_grad(loss))
        self.scale = jax.jit(lambda acc: jax.tree.map(lambda x: x / k, acc), donate_argnums=0)

    def compile(self, params: Any, batch: Any) -> tuple[Callable[..., Any], float, int]:
        micro = strided_micro_batches(batch, self.k)
        first, s1, t1 = compile_timed(self.first, params, micro[0])
        acc = first(params, micro[0])
        add, s2, t2 = compile_timed(self.add, acc, params, micro[0])
        scale, s3, _ = compile_timed(self.scale, acc)

        def run(params: Any, micro_batches: Any) -> Any:
            acc = first(params, micro_batches[0])
            for m in micro_batches[1:]:
                acc = add(acc, params, m)
            return scale(acc)

        return run, s1 + s2 + s3, max(t1, t2)


def hlo_summary(hlo: str) -> dict[str, Any]:
    """What the compiled program runs where: each convolution/dot counted by (where it sits:
    in the entry or inside a while loop) x (how it runs: ``ynn`` = a YNNPACK fusion, ``loop``
    = an XLA loop fusion, ``thunk`` = its own thunk, Eigen when canonical, naive loops
    otherwise) x (convolutions: canonical NHWC/HWIO dimension labels or not); plus the
    transposes/copies in loop bodies and in the entry."""
    comps = _hlo.computations(hlo)
    parent: dict[str, tuple[str, str]] = {}
    for name, lines in comps.items():
        for line in lines:
            for callee in re.findall(r"calls=%?([\w.\-]+)", line):
                kind = "ynn" if "__ynn_fusion" in line else "fusion"
                parent[callee] = (kind, name)
            for callee in re.findall(r"body=%?([\w.\-]+)", line):
                parent[callee] = ("while", name)

    def path(comp: str) -> list[str]:
        out = []
        while comp in parent:
            kind, comp = parent[comp]
            out.append(kind)
        return out

    ops: dict[str, int] = {}
    moves: dict[str, int] = {}
    for name, lines in comps.items():
        where = "loop" if "while" in path(name) else "entry"
        for line in lines:
            op = re.search(r"= \S+ (convolution|dot|transpose|copy)\(", line)
            if not op:
                continue
            if op.group(1) in ("transpose", "copy"):
                key = f"{op.group(1)} in {where}"
                moves[key] = moves.get(key, 0) + 1
                continue
            kinds = path(name)
            runs = kinds[0] if kinds and kinds[0] != "while" else "thunk"
            label = ""
            if op.group(1) == "convolution":
                dims = re.search(r"dim_labels=([^ ,]+)", line)
                labels = dims.group(1) if dims else "?"
                canonical = re.fullmatch(r"b(0?1?2?)f_\1io->b\1f", labels)
                label = " canonical" if canonical else f" {labels}"
            key = f"{op.group(1)}{label} {runs} in {where}"
            ops[key] = ops.get(key, 0) + 1
    return {"ops": ops, "moves": moves}


def _loop_variants(loss: Callable[..., Any], k: int, splits: bool) -> dict[str, Any]:
    """name -> (jitted value_and_grad or a _LoopVG, the context to trace it in)."""
    vg = lambda **kw: jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k, **kw))  # noqa: E731
    none = contextlib.nullcontext
    out: dict[str, Any] = {
        "full batch": (jax.jit(jax.value_and_grad(loss)), none),
        "hand-written lax.scan": (jax.jit(_hand_scan(loss, k)), none),
        "Python loop": (_LoopVG(loss, k), none),
        "jaxaccum": (vg(), none),
    }
    if k >= 2:
        out["jaxaccum unroll=2"] = (vg(unroll=2), none)
    if k >= 4:
        out["jaxaccum unroll=4"] = (vg(unroll=4), none)
    if k >= 2:
        out["jaxaccum unroll=k"] = (vg(unroll=k), none)
    if splits:
        for split in ("swapaxes", "contiguous"):
            out[f"jaxaccum, {split} split"] = (vg(), functools.partial(variant, split=split))
    return out


def study(
    loss: Callable[..., Any],
    params: Any,
    batch: Any,
    k: int,
    variants: dict[str, Any],
    rounds: int,
) -> dict[str, Any]:
    """Compiles every variant (timed, temp bytes, HLO summary), checks it against the full
    batch's value and gradient, then times them interleaved, round by round."""
    reference = jax.jit(jax.value_and_grad(loss))(params, batch)
    built = {}
    for name, (fn, context) in variants.items():
        if isinstance(fn, _LoopVG):
            run, seconds, temp = fn.compile(params, batch)
            data, hlo = strided_micro_batches(batch, k), None
        else:
            with context():
                compiled, seconds, temp = compile_timed(fn, params, batch)
            run, data, hlo = compiled, batch, hlo_summary(compiled.as_text())
        out = run(params, data)
        err = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(reference), strict=True)
        )
        info: dict[str, Any] = {
            "temp_bytes": temp, "compile_s": seconds, "max_abs_diff": err, "hlo": hlo
        }
        built[name] = (run, data, info)
    times: dict[str, list[float]] = {name: [] for name in built}
    for r in range(rounds + 1):  # the first round warms up
        for name, (run, data, _) in built.items():
            start = time.perf_counter()
            jax.block_until_ready(run(params, data))
            if r:
                times[name].append(time.perf_counter() - start)
    row: dict[str, dict[str, Any]] = {
        name: {"ms": statistics.median(times[name]) * 1e3, **info}
        for name, (_, _, info) in built.items()
    }
    for name in row:
        row[name]["ratio_to_full"] = row[name]["ms"] / row["full batch"]["ms"]
        row[name]["ratio_to_loop"] = row[name]["ms"] / row["Python loop"]["ms"]
    for name, v in row.items():
        print(
            f"k={k:3d} {name:30s} {v['ms']:9.2f} ms ({v['ratio_to_full']:5.2f}x full, "
            f"{v['ratio_to_loop']:5.2f}x loop)  temp {v['temp_bytes'] / 2**20:7.2f} MiB  "
            f"compile {v['compile_s']:5.2f} s  diff {v['max_abs_diff']:.1e}",
            flush=True,
        )
    return row


def compile_study(repeats: int = 3) -> dict[str, Any]:
    """Lower + compile seconds (the minimum over ``repeats`` fresh jits, the least disturbed by
    other load) of the CNN's and the gist MLP's value_and_grad at k = 2, 8, 64."""
    out: dict[str, Any] = {}
    cases = {
        "cnn": (cnn_loss, cnn_params(jax.random.key(0)), cnn_data(256)),
        "mlp": (mlp_loss, GIST.params(), GIST.data()),
    }
    for model, (loss, params, batch) in cases.items():
        rows: dict[str, Any] = {}
        for name, unroll in (("jaxaccum", False), ("jaxaccum unroll=k", True)):
            for k in (2, 8, 64):
                seconds = []
                for _ in range(repeats):
                    kw = {"unroll": k} if unroll else {}
                    fn = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k, **kw))
                    seconds.append(compile_timed(fn, params, batch)[1])
                rows.setdefault(name, {})[k] = {"min_s": min(seconds), "all_s": seconds}
            ratio = rows[name][64]["min_s"] / rows[name][2]["min_s"]
            rows[name]["ratio_64_to_2"] = ratio
            print(
                f"compile {model} {name:18s} "
                + "  ".join(f"k={k}: {rows[name][k]['min_s']:.2f}s" for k in (2, 8, 64))
                + f"  k=64/k=2: {ratio:.2f}",
                flush=True,
            )
        out[model] = rows
    return out


def run(ks: list[int], rounds: int | None, quick: bool) -> dict[str, Any]:
    ks = [k for k in ks if not quick or k in (1, 8, 64)]
    cnn_rounds = rounds or (2 if quick else 4)
    results: dict[str, Any] = {"machine": machine(), "cnn": {}, "mlp": {}, "nnx": {}}
    params, batch = cnn_params(jax.random.key(0)), cnn_data(256)
    results["cnn"] = {"model": CNN, "rounds": cnn_rounds, "by_k": {}}
    for k in ks:
        variants = _loop_variants(cnn_loss, k, splits=True)
        results["cnn"]["by_k"][k] = study(cnn_loss, params, batch, k, variants, cnn_rounds)
    nnx_loss, nnx_params = nnx_cnn()
    none = contextlib.nullcontext
    nnx_variants = {
        "full batch": (jax.jit(jax.value_and_grad(nnx_loss)), none),
        "Python loop": (_LoopVG(nnx_loss, 8), none),
        "jaxaccum": (jax.jit(jaxaccum.value_and_grad(nnx_loss, num_microbatches=8)), none),
    }
    results["nnx"] = {
        "model": "the same CNN in flax NNX (nnx.Conv, nnx.BatchNorm eval)",
        "k": 8,
        "row": study(nnx_loss, nnx_params, batch, 8, nnx_variants, cnn_rounds),
    }
    mlp_rounds = 10 if quick else 40
    results["mlp"] = {
        "model": f"gist MLP 784-100-10, batch {GIST.batch}",
        "rounds": mlp_rounds,
        "by_k": {},
    }
    for k in ks:
        variants = _loop_variants(mlp_loss, k, splits=False)
        results["mlp"]["by_k"][k] = study(
            mlp_loss, GIST.params(), GIST.data(), k, variants, mlp_rounds
        )
    results["compile"] = compile_study(repeats=2 if quick else 3)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", nargs="+", type=int, default=list(KS))
    parser.add_argument("--rounds", type=int, default=None,
                        help="the CNNs' timed rounds (default 4; --quick 2); the MLP: 40 (10)")
    parser.add_argument("--quick", action="store_true", help="k = 1, 8, 64 and fewer rounds")
    parser.add_argument("--out", default="models_loops",
                        help="results/OUT.json (default: the committed evidence, replaced)")
    args = parser.parse_args()
    if not args.out.startswith("models_loops"):
        parser.error("--out must start with 'models_loops'")
    results = run(args.ks, args.rounds, args.quick)
    print(f"wrote {save(args.out, results)}")


if __name__ == "__main__":
    main()
