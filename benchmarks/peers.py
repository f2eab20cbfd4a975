"""Peers: jaxaccum against optax and re-implementations of MaxText's and Levanter's accumulation.

One jitted optimizer step (gradient + update; SGD for the MLPs and the CNN, Adam for the LM)
per method, on the same batch:

- ``full``: one big-batch step, the reference for the time ratios;
- ``jaxaccum``: ``jaxaccum.train_step`` (``weighted=True`` for the LM, weight: valid tokens);
- ``python_loop``: the loop a user writes first: k calls of a jitted ``jax.value_and_grad`` on
  contiguous micro-batches, a Python-side tree sum, one jitted update of the mean;
- ``optax_multisteps``: ``optax.MultiSteps``, one jitted call per (contiguous) micro-batch;
- ``optax_microbatching``: ``optax.microbatching.microbatch`` (MEAN) around
  ``jax.value_and_grad``;
- ``maxtext``: MaxText's gradient accumulation, re-implemented (``maxtext_value_and_grad``);
- ``levanter``: Levanter's ``microbatched``, re-implemented (``levanter_value_and_grad``).

The two re-implementations (read, then re-written here; no code copied):

- MaxText: AI-Hypercomputer/maxtext, ``src/maxtext/utils/gradient_accumulation.py``
  (``gradient_accumulation_loss_and_grad``) at e591f30cbbf217ed67ef71263ec0538239f9c3b8
  (file last changed in 000b810bb1d98e8c0b0d55fc43fb3979fd35db15), with the loss of
  ``src/maxtext/trainers/pre_train/train.py`` (``loss = xent_sum`` when accumulating).
  Kept: strided micro-batches (reshape to ``(B/k, k)`` then swap axes), one ``lax.scan``
  whose carry holds the parameters, the loss numerator, the gradient of the *unnormalised*
  loss sum and the total weight (an integer token count); the accumulator is
  ``zeros_like(params)`` (the parameter dtype, float32 here); the division by the total weight
  (guarded by ``total_weights > 0``) happens once after the scan, before the optimizer. k = 1
  takes MaxText's plain path: the gradient of ``xent_sum / (total_weights + 1e-8)``. Left
  out: sharding annotations, the bf16 ZeRO-1 cast, MoE/MTP/indexer losses, dropout keys. The
  MLP and CNN losses become ``(mean * n, n)``, n the micro-batch size.
- Levanter: stanford-crfm/levanter, ``src/levanter/grad_accum.py`` (``microbatched``, as
  ``Trainer._compute_gradients_microbatched`` uses it around ``eqx.filter_value_and_grad``) at
  9263f81e8b453241332c2c0b2d2001bfb2d2241c (file last changed in
  9fde0781a1737e088535c392cf239aba5e1143e2). Kept: contiguous micro-batches (reshape to
  ``(k, B/k)``), an accumulator of zeros shaped like ``eval_shape`` of ``value_and_grad``
  (its dtype, float32 here: ``accum_dtype=None``), a scan (``hax.fold``) adding each
  micro-batch's ``(loss, grads)``, and one division by k after the loop: the mean of
  micro-batch means. k = 1 returns the plain ``value_and_grad``, as ``microbatched`` does.
  Left out: haliax named axes and sharding, RNG key splitting, fp8 overwrites.

Objectives: the MLPs and the CNN have equal micro-batches, so every method's objective is the
batch mean. The LM's true objective is the mean cross-entropy over the valid tokens of the
whole batch: ``full``, ``jaxaccum`` and ``maxtext`` compute it; ``levanter``,
``python_loop``, ``optax_multisteps`` (contiguous micro-batches) and ``optax_microbatching``
(strided) average micro-batch token means, their own objective, and their error is given
against both.

Every step returns its loss (as jaxaccum's, MaxText's and Levanter's train steps do: a loss
nobody returns is a computation XLA drops). Per model, k and method: the median step time
(methods interleaved round by round, each round in its own seeded random order, ratios to
``full`` within the same rounds); ``temp_size_in_bytes`` of the compiled program (params and
optimizer state donated; MultiSteps: its per-micro-batch program; the Python loop: its
gradient program, one micro-batch) and the optimizer state's
bytes; the gradient the optimizer receives (captured by a pass-through optimizer that stores
it in its state, in a second, untimed program), as max |g - g64| / max |g64| against a
float64 reference of the full-batch gradient (the LM's float32 casts mapped to float64).

Time on 2 cores: ~7 min on a quiet machine, over twice that on a busy one (default rounds:
gist64 40, gist1024 15, wide 4, LM 4, CNN 6; ``--rounds`` for more); ``--quick`` (k = 1,
16, 64; LM 1, 16, 32; a third of the rounds) ~3 min. Writes ``results/peers.json`` and
``results/peers.md`` (``--out NAME``).

    python benchmarks/peers.py
    python benchmarks/peers.py --quick
    python benchmarks/peers.py --models gist64 lm --rounds 5 --out peers_lm
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
import optax
from _common import GIST, Model, apply_update, machine, result_path, save
from _common import loss as mlp_loss
from model_zoo import cnn_data, cnn_loss, cnn_params, copy, lm_data, lm_loss, lm_params

import jaxaccum

METHODS = ("full", "jaxaccum", "python_loop", "optax_multisteps", "optax_microbatching",
           "maxtext", "levanter")
# how each method splits the batch and which objective it computes on a token-weighted loss
SPLIT = {"python_loop": "contiguous", "optax_multisteps": "contiguous",
         "optax_microbatching": "strided", "levanter": "contiguous"}
MAXTEXT_EPS = 1e-8


# --- the models -------------------------------------------------------------------------------


@dataclass
class Case:
    """A model: ``loss`` as jaxaccum takes it (``(mean, weight)`` when ``weighted``), the
    MaxText form ``sums(params, batch) -> (loss sum, total weight)``, data and optimizer."""

    key: str
    name: str
    loss: Callable[..., Any]
    sums: Callable[..., Any]
    params: Any
    batch: Any
    optimizer: optax.GradientTransformation
    ks: tuple[int, ...]
    rounds: int
    weighted: bool = False

    @property
    def size(self) -> int:
        return int(jax.tree.leaves(self.batch)[0].shape[0])

    def mean_loss(self, params: Any, batch: Any) -> Any:
        return self.loss(params, batch)[0] if self.weighted else self.loss(params, batch)


def _mean_times_n(loss: Callable[..., Any]) -> Callable[..., Any]:
    """MaxText's ``(xent_sum, total_weights)`` for a mean-over-examples loss."""

    def sums(params: Any, batch: Any) -> tuple[Any, Any]:
        n = jax.tree.leaves(batch)[0].shape[0]
        return loss(params, batch) * n, jnp.asarray(n, jnp.int32)

    return sums


def lm_sums(params: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
    """The LM's MaxText loss: the summed cross-entropy of valid tokens and their count."""
    logits = model_zoo.lm_logits(params, batch["inputs"])
    ce = (
        jax.nn.logsumexp(logits, -1)
        - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    )
    return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"] != 0).astype(jnp.int32)


def _mlp(key: str, model: Model, ks: tuple[int, ...], rounds: int) -> Case:
    return Case(key, model.name, mlp_loss, _mean_times_n(mlp_loss), model.params(),
                model.data(), optax.sgd(1e-2), ks, rounds)


def cases() -> dict[str, Case]:
    ks = (1, 4, 16, 64)
    return {
        "gist64": _mlp("gist64", GIST, ks, 40),
        "gist1024": _mlp(
            "gist1024", Model("gist MLP 784-100-10, batch 1024", (784, 100, 10), 1024), ks, 15
        ),
        "wide": _mlp(
            "wide",
            Model("wide MLP 784-2048-2048-10, batch 2048", (784, 2048, 2048, 10), 2048),
            ks,
            4,
        ),
        "lm": Case(
            "lm",
            "decoder LM 4x128, seq 128, vocab 256, batch 32, token-mean loss (Adam)",
            lm_loss,
            lm_sums,
            lm_params(jax.random.key(0)),
            lm_data(32),
            optax.adam(1e-3),
            (1, 4, 16, 32),
            4,
            weighted=True,
        ),
        "cnn": Case(
            "cnn",
            "CNN 2 conv + BatchNorm (eval), 28x28x1, batch 256",
            cnn_loss,
            _mean_times_n(cnn_loss),
            cnn_params(jax.random.key(0)),
            cnn_data(256),
            optax.sgd(1e-2),
            ks,
            6,
        ),
    }


# --- the peers' accumulation loops, re-implemented ---------------------------------------------


def maxtext_value_and_grad(sums: Callable[..., Any], k: int) -> Callable[..., Any]:
    """MaxText's gradient accumulation: ``(loss, grads)`` of the token mean over the batch."""
    if k == 1:  # no accumulation: MaxText's loss is normalised inside the gradient

        def plain(params: Any, batch: Any) -> Any:
            def normalised(p: Any) -> Any:
                total, weights = sums(p, batch)
                return total / (weights + MAXTEXT_EPS)

            return jax.value_and_grad(normalised)(params)

        return plain

    def with_aux(params: Any, micro: Any) -> Any:
        total, weights = sums(params, micro)
        return total, {"xent_sum": total, "total_weights": weights}

    grad_func = jax.value_and_grad(with_aux, has_aux=True)

    def value_and_grad(params: Any, batch: Any) -> Any:
        def accumulate(acc: dict[str, Any], micro: Any) -> Any:
            (_, aux), grads = grad_func(acc["ga_params"], micro)
            acc = dict(acc)
            acc["loss"] = acc["loss"] + aux["xent_sum"]
            acc["grad"] = jax.tree.map(lambda x, y: x + y, grads, acc["grad"])
            acc["total_weights"] = acc["total_weights"] + aux["total_weights"]
            return acc, aux

        def to_micro(x: jax.Array) -> jax.Array:  # micro-batch i: examples i, i + k, ...
            return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)

        init = {
            "loss": jnp.zeros(()),
            "grad": jax.tree.map(jnp.zeros_like, params),
            "total_weights": jnp.zeros((), jnp.int32),
            "ga_params": params,
        }
        acc, _ = jax.lax.scan(accumulate, init, jax.tree.map(to_micro, batch), length=k)
        has_weights = acc["total_weights"] > 0
        denominator = jnp.maximum(acc["total_weights"], 1)
        loss = jnp.where(has_weights, acc["loss"] / denominator, 0.0)
        grads = jax.tree.map(
            lambda g: jnp.where(has_weights, g / denominator, jnp.zeros_like(g)), acc["grad"]
        )
        return loss, grads

    return value_and_grad


def levanter_value_and_grad(mean_loss: Callable[..., Any], k: int) -> Callable[..., Any]:
    """Levanter's ``microbatched(value_and_grad(loss))``: the mean of micro-batch results."""
    fn = jax.value_and_grad(mean_loss)
    if k == 1:
        return fn

    def wrapped(params: Any, batch: Any) -> Any:
        shapes = jax.eval_shape(fn, params, batch)
        acc = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)

        def loop(acc: Any, microbatch: Any) -> Any:
            return jax.tree.map(jnp.add, acc, fn(params, microbatch)), None

        acc, _ = jax.lax.scan(loop, acc, micro)
        return jax.tree.map(lambda x: x / k, acc)

    return wrapped


# --- the methods: one step each -------------------------------------------------------------------


def contiguous(batch: Any, k: int) -> list[Any]:
    m = jax.tree.leaves(batch)[0].shape[0] // k
    return [jax.tree.map(lambda x, i=i: x[i * m : (i + 1) * m], batch) for i in range(k)]


@dataclass
class Program:
    """A method's step at one k: ``jitted(params, state, data) -> (params, state, ...)``; per
    call: ``data`` is one micro-batch and the step makes k calls."""

    jitted: Any
    optimizer: optax.GradientTransformation
    per_call: bool = False
    micro_list: bool = False  # data: the list of micro-batches, given to one call


class PythonLoop:
    """k jitted gradient calls, a Python-side tree sum, one jitted update of the mean: the
    accumulation loop a user writes first. ``lower`` lowers its gradient program."""

    def __init__(self, mean_loss: Callable[..., Any], apply: Callable[..., Any],
                 donated: tuple[int, ...]) -> None:
        self.grad = jax.jit(jax.value_and_grad(mean_loss))
        self.update = jax.jit(apply, donate_argnums=donated)

    def __call__(self, params: Any, state: Any, micros: list[Any]) -> Any:
        total = self.grad(params, micros[0])
        for micro in micros[1:]:
            total = jax.tree.map(jnp.add, total, self.grad(params, micro))
        loss, grads = jax.tree.map(lambda g: g / len(micros), total)
        return (*self.update(params, state, grads), loss)

    def lower(self, params: Any, state: Any, micros: list[Any]) -> Any:
        return self.grad.lower(params, micros[0])


def build(case: Case, method: str, k: int, optimizer: Any, donate: bool) -> Program:
    apply, donated = apply_update(optimizer), (0, 1) if donate else ()

    # every step returns the loss it computed, as jaxaccum's and MaxText's and Levanter's
    # train steps report it (a loss nobody returns is a computation XLA drops)
    def jitted(update: Callable[..., Any], value_and_grads_of: Callable[..., Any]) -> Any:
        def step(p: Any, s: Any, b: Any) -> Any:
            loss, grads = value_and_grads_of(p, b)
            return (*update(p, s, grads), loss)

        return jax.jit(step, donate_argnums=donated)

    def single(value_and_grads_of: Callable[..., Any]) -> Program:
        return Program(jitted(apply, value_and_grads_of), optimizer)

    if method == "full":
        return single(jax.value_and_grad(case.mean_loss))
    if method == "jaxaccum":
        step = jaxaccum.train_step(
            case.loss, optimizer, num_microbatches=k, weighted=case.weighted, donate=donate
        )
        return Program(step, optimizer)
    if method == "python_loop":
        return Program(PythonLoop(case.mean_loss, apply, donated), optimizer, micro_list=True)
    if method == "optax_multisteps":
        multi = optax.MultiSteps(optimizer, k).gradient_transformation()
        return Program(jitted(apply_update(multi), jax.value_and_grad(case.mean_loss)), multi,
                       per_call=True)
    if method == "optax_microbatching":
        mb = optax.microbatching
        return single(
            mb.microbatch(
                jax.value_and_grad(case.mean_loss),
                argnums=1,
                microbatch_size=case.size // k,
                accumulator=mb.AccumulationType.MEAN,
            )
        )
    if method == "maxtext":
        return single(maxtext_value_and_grad(case.sums, k))
    if method == "levanter":
        return single(levanter_value_and_grad(case.mean_loss, k))
    raise ValueError(method)


def data_for(case: Case, prog: Program, k: int) -> Any:
    return contiguous(case.batch, k) if prog.per_call or prog.micro_list else case.batch


def run_step(fn: Any, per_call: bool, params: Any, state: Any, data: Any) -> tuple[Any, Any]:
    if per_call:
        for micro in data:
            params, state = fn(params, state, micro)[:2]
        return params, state
    return tuple(fn(params, state, data)[:2])  # type: ignore[return-value]


def capture() -> optax.GradientTransformation:
    """A pass-through optimizer: its state is the last gradient it was given; no update."""

    def init(params: Any) -> Any:
        return jax.tree.map(jnp.zeros_like, params)

    def update(grads: Any, state: Any, params: Any = None) -> Any:
        return jax.tree.map(jnp.zeros_like, grads), grads

    return optax.GradientTransformation(init, update)


def captured_grads(case: Case, method: str, k: int) -> Any:
    """The gradient the method's step hands its optimizer (one untimed step)."""
    prog = build(case, method, k, capture(), donate=False)
    params = copy(case.params)
    state = prog.optimizer.init(params)
    _, state = run_step(prog.jitted, prog.per_call, params, state, data_for(case, prog, k))
    if prog.per_call:  # optax.MultiSteps: the inner optimizer's state
        state = state.inner_opt_state
    return jax.device_get(state)


# --- the float64 references ----------------------------------------------------------------------


@contextlib.contextmanager
def float64_model_code() -> Iterator[None]:
    """x64 on, and model_zoo's float32 casts (LM layer norm, logits) mapped to float64."""
    shim = types.ModuleType("jnp_float64")
    shim.__dict__.update(jnp.__dict__)
    shim.float32 = jnp.float64  # type: ignore[attr-defined]
    saved = model_zoo.jnp
    model_zoo.jnp = shim  # type: ignore[assignment]
    try:
        with jax.enable_x64(True):
            yield
    finally:
        model_zoo.jnp = saved


def _to64(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x, np.float64 if x.dtype.kind == "f" else x.dtype)), tree
    )


def references(case: Case, ks: list[int]) -> dict[str, Any]:
    """float64 gradients: ``true`` (the batch objective) and, for a weighted loss, the mean of
    micro-batch means per split and k (``("strided" | "contiguous", k)``)."""
    out: dict[Any, Any] = {}
    with float64_model_code():
        params, batch = _to64(case.params), _to64(case.batch)
        out["true"] = jax.device_get(jax.jit(jax.grad(case.mean_loss))(params, batch))
        if case.weighted:
            for k in ks:
                for split in ("strided", "contiguous"):
                    if split == "strided":
                        micro = jax.tree.map(
                            lambda x, k=k: jnp.swapaxes(
                                x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1
                            ),
                            batch,
                        )
                    else:
                        micro = jax.tree.map(
                            lambda x, k=k: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch
                        )
                    grads = jax.jit(jax.vmap(jax.grad(case.mean_loss), in_axes=(None, 0)))(
                        params, micro
                    )
                    out[(split, k)] = jax.device_get(jax.tree.map(lambda g: g.mean(0), grads))
    return out


def rel_error(grads: Any, ref: Any) -> float:
    g = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]
    r = [np.asarray(x, np.float64) for x in jax.tree.leaves(ref)]
    num = max(float(np.max(np.abs(a - b))) for a, b in zip(g, r, strict=True))
    return num / max(float(np.max(np.abs(b))) for b in r)


def tree_bytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


# --- the measurement -----------------------------------------------------------------------------


def run_k(case: Case, k: int, rounds: int, refs: dict[Any, Any]) -> dict[str, Any]:
    built = []
    row: dict[str, Any] = {}
    for method in METHODS:
        prog = build(case, method, k, case.optimizer, donate=True)
        params = copy(case.params)
        state = prog.optimizer.init(params)
        data = data_for(case, prog, k)
        start = time.perf_counter()
        compiled = prog.jitted.lower(params, state, data[0] if prog.per_call else data).compile()
        row[method] = {
            "compile_s": time.perf_counter() - start,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            # (the Python loop also keeps its running gradient sum between its calls)
            "state_bytes": tree_bytes(state) + (tree_bytes(params) if prog.micro_list else 0),
        }
        # (the Python loop is timed as it runs: its own compiled calls, dispatched from Python)
        built.append([method, prog.jitted if prog.micro_list else compiled, prog.per_call,
                      params, state, data])
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    order = random.Random(f"{case.key}-{k}")  # each round in its own order: no method always
    for r in range(rounds + 1):  # runs after the same one; round 0 warms up
        for entry in order.sample(built, len(built)):
            method, fn, per_call, params, state, data = entry
            start = time.perf_counter()
            out = jax.block_until_ready(run_step(fn, per_call, params, state, data))
            if r:
                times[method].append(time.perf_counter() - start)
            entry[3], entry[4] = out
    full = statistics.median(times["full"])
    for method in METHODS:
        t = statistics.median(times[method])
        grads = captured_grads(case, method, k)
        own = SPLIT.get(method) if case.weighted and k > 1 else None
        row[method].update(
            ms=t * 1e3,
            ratio_to_full=t / full,
            objective="mean of micro-batch means" if own else "batch mean",
            err_true=rel_error(grads, refs["true"]),
            err_own=rel_error(grads, refs[(own, k)]) if own else None,
        )
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    all_cases = cases()
    results: dict[str, Any] = {"machine": machine(), "quick": args.quick, "models": {}}
    wall = time.perf_counter()
    for key in args.models:
        case = all_cases[key]
        ks = [k for k in case.ks if case.size % k == 0]
        rounds = args.rounds or case.rounds
        if args.quick:
            ks = [k for k in ks if k in (1, 16, 32 if key == "lm" else 64)]
            rounds = args.rounds or max(2, rounds // 3)
        refs = references(case, ks)
        entry: dict[str, Any] = {
            "name": case.name,
            "batch": case.size,
            "rounds": rounds,
            "param_bytes": tree_bytes(case.params),
            "weighted": case.weighted,
            "by_k": {},
        }
        for k in ks:
            row = run_k(case, k, rounds, refs)
            entry["by_k"][k] = row
            print(
                f"{key:8s} k={k:3d} "
                + "  ".join(
                    f"{m}: {v['ms']:.2f}ms {v['ratio_to_full']:.2f}x "
                    f"{v['temp_bytes'] / 2**20:.2f}MiB {v['err_true']:.1e}"
                    for m, v in row.items()
                ),
                flush=True,
            )
        results["models"][key] = entry
    results["wall_s"] = time.perf_counter() - wall
    return results


# --- the summary -------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def _temp_cell(row: dict[str, Any], method: str) -> str:
    """Temp MiB, and the optimizer state kept beyond ``full``'s (MultiSteps' accumulator)."""
    v = row[method]
    extra = v["state_bytes"] - row["full"]["state_bytes"]
    return f"{v['temp_bytes'] / 2**20:.2f}" + (f" (+{extra / 2**20:.2f} state)" if extra else "")


def markdown(results: dict[str, Any]) -> str:
    """The summary: time ratio to ``full``, temp MiB and gradient error per model, k, method."""
    m = results["machine"]
    lines = [
        "# jaxaccum and its peers (benchmarks/peers.py)",
        "",
        f"{m['backend']}, {m['cpu_count']} CPUs, jax {m['jax']}, optax {m['optax']}"
        + (", --quick" if results.get("quick") else "")
        + f"; wall {results.get('wall_s', 0) / 60:.1f} min. Models: "
        + "; ".join(
            f"`{key}` {e['name']} ({e['rounds']} rounds)" for key, e in results["models"].items()
        )
        + ".",
        "",
    ]
    peers = METHODS[1:]
    rows_t, rows_m, rows_e = [], [], []
    for key, entry in results["models"].items():
        for k, row in entry["by_k"].items():
            rows_t.append([key, str(k), f"{row['full']['ms']:.2f}"]
                          + [f"{row[p]['ratio_to_full']:.2f}" for p in peers])
            rows_m.append([key, str(k)] + [_temp_cell(row, p) for p in METHODS])
            cells = []
            for p in METHODS:
                v = row[p]
                own = "" if v["err_own"] is None else f" (own {v['err_own']:.1e})"
                cells.append(f"{v['err_true']:.1e}{own}")
            rows_e.append([key, str(k)] + cells)
    lines += ["## Step time: median, ratio to `full` in the same rounds", ""]
    lines += _table(["model", "k", "full ms"] + list(peers), rows_t)
    lines += ["", "## Temp MiB (compiled, params and optimizer state donated; MultiSteps: the "
              "per-micro-batch program; the Python loop: its gradient program; `+ state`: "
              "what is kept between steps or calls beyond `full`'s optimizer state)", ""]
    lines += _table(["model", "k"] + list(METHODS), rows_m)
    lines += ["", "## Gradient error: max abs error / max abs of the float64 full-batch "
              "gradient (true objective); `own`: against the float64 gradient of the method's "
              "own objective (mean of micro-batch token means) where it differs", ""]
    lines += _table(["model", "k"] + list(METHODS), rows_e)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choices = list(cases())
    parser.add_argument("--models", nargs="+", default=choices, choices=choices)
    parser.add_argument("--quick", action="store_true",
                        help="k = 1, 16, 64 (LM 1, 16, 32), a third of the rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per model")
    parser.add_argument("--out", default="peers", help="results/OUT.json and OUT.md")
    args = parser.parse_args()
    results = run(args)
    path = save(args.out, results)
    md = result_path(args.out, "md")
    md.write_text(markdown(results))
    print(f"wrote {path} and {md}")


if __name__ == "__main__":
    main()
