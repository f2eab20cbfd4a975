"""Model families: speed, temp memory and compile time per way and k; and the CNN loop study.

Families (each: a loss, its parameters, a batch):

- ``mlp``: the gist MLP 784-100-10 (ReLU, MSE on one-hot targets), batch 64 (``_common.GIST``);
- ``cnn``: conv 3x3x16 - BatchNorm (eval) - ReLU - avg-pool 2, conv 3x3x32 - BatchNorm - ReLU -
  avg-pool 2, dense 128 (ReLU), dense 10, cross-entropy; 28x28x1 inputs, batch 256;
- ``transformer``: a decoder-only LM in plain JAX (4 layers, d=128, 4 heads, sequence 128,
  vocabulary 256, pre-LayerNorm, GELU MLP), sequences of random lengths padded to 128, loss the
  mean cross-entropy over valid tokens with ``weighted=True`` (weight: the number of valid
  tokens); batch 32 (``--lm-batch``); Adam. Also with bfloat16 parameters (float32 accumulation).

Ways, all making the same optimizer step on the same batch: ``full batch`` (one jitted gradient
and update), ``jaxaccum.train_step`` (the library as it is: since a4b2f71 its loop body runs
convolutions in XLA:CPU's canonical layout and gathers each micro-batch inside the loop),
``Python loop`` (k jitted micro-batch gradient calls summed on device, one jitted update),
``optax.MultiSteps`` (one jitted call per micro-batch), ``optax.microbatching``
(``microbatch`` around the gradient in one jitted step). Ways run interleaved round by round;
medians; ratios within the same rounds. Every program is compiled ahead of time once: its
compile time (lower + compile) and ``memory_analysis()`` temp bytes are recorded (per-call
ways: their per-micro-batch program).

``loops`` is the CNN loop study (docs/perf_investigation.md): jitted ``value_and_grad`` of the
full batch, of jaxaccum with ``unroll`` 1, 2, 4 and k, a hand-written ``lax.scan``, a Python
loop, and the library with its micro-batches split before the loop (strided ``swapaxes`` or
contiguous; ``variant`` swaps ``_pipeline.split``/``take`` while tracing). The loop study is
not rerunnable as committed: its ``before (a4b2f71^)`` ways monkeypatched the private
``_accumulate`` module, which went away with the pipeline rewrite (0ec3eda), so they were
removed; ``results/models_loops.json`` keeps what they measured as evidence. It was measured
before a4b2f71, when the library was what it calls ``before`` (named ``jaxaccum`` there) and the
change was a prototype in this file (named ``proposed`` there); a rerun of ``loops`` (which
overwrites that file) measures only the ways listed above.

    python benchmarks/models.py                 # families, ~8 min on 2 cores: results/models.*
    python benchmarks/models.py --quick         # ~2.5 min: fewer k and rounds: models_quick.*
    python benchmarks/models.py --families cnn --rounds 12 --out models_cnn_r12   # a repeat
    python benchmarks/models.py loops           # ~15 min: results/models_loops.json
    python benchmarks/models.py compile         # ~3 min: train_step compile times, k=2..64
    python benchmarks/models.py memory          # ~1 min: temp bytes behind the memory findings
    python benchmarks/models.py report          # the tables of the saved results
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import re
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax
from _common import GIST, machine, result_path, save
from _common import loss as mlp_loss

import jaxaccum
from jaxaccum import _conv_layout, _hlo, _pipeline

KS = (1, 2, 4, 8, 16, 32, 64)

# --- split variants of the library, for the loop study and the memory probe -----------------
#
# a4b2f71 made the library gather micro-batch i inside the loop from a free (B/k, k, ...) view
# (now jaxaccum/_pipeline.py: ``split`` and ``take``) and rewrite the micro-step's convolutions
# into XLA:CPU's canonical layout (_conv_layout.canonical_convs). ``variant`` swaps those
# module-level functions while tracing. The "before (a4b2f71^)" ways the committed
# results/models_loops.json holds patched the private module ``_accumulate``, which is gone
# since 0ec3eda: they are no longer measured (their results stay committed as evidence).

BEFORE = "before (a4b2f71^)"  # the name of those ways in models_loops.json
_ORIGINAL = {
    "canonical_convs": _conv_layout.canonical_convs,
    "split": _pipeline.split,
    "take": _pipeline.take,
}


def _split_before(split: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(``split``, ``take``) for micro-batches cut before the loop: ``swapaxes`` is a4b2f71^'s
    strided split (a transposed copy of the batch), ``contiguous`` cuts blocks (a free view);
    the loop then indexes the leading axis."""

    def view(x: Any, k: int) -> jax.Array:
        x = jnp.asarray(x)
        if split == "swapaxes":
            return jnp.swapaxes(x.reshape((x.shape[0] // k, k, *x.shape[1:])), 0, 1)
        return x.reshape((k, x.shape[0] // k, *x.shape[1:]))

    def split_fn(acc: Any, args: Any, k: int) -> tuple[Any, ...]:
        return tuple(jax.tree.map(lambda x: view(x, k), b) for b in acc.batch(args))

    def take(views: Any, i: Any) -> Any:
        return jax.tree.map(
            lambda v: jax.lax.dynamic_index_in_dim(v, i, axis=0, keepdims=False), views
        )

    return split_fn, take


@contextlib.contextmanager
def variant(convs: bool = True, split: str = "gather") -> Iterator[None]:
    """While tracing: the library's micro-step with (``convs``) or without the convolution
    rewrite, and its micro-batches gathered inside the loop (``gather``, the library), split
    before the loop by a transposed copy as a4b2f71^ did (``swapaxes``), or cut into
    contiguous blocks."""
    if not convs:
        _conv_layout.canonical_convs = lambda fun: fun
    if split != "gather":
        _pipeline.split, _pipeline.take = _split_before(split)
    try:
        yield
    finally:
        _conv_layout.canonical_convs = _ORIGINAL["canonical_convs"]
        _pipeline.split, _pipeline.take = _ORIGINAL["split"], _ORIGINAL["take"]


# --- the models ------------------------------------------------------------------------------


def _normal(key: Any, shape: tuple[int, ...], scale: float) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32) * scale


def cnn_params(key: Any) -> dict[str, Any]:
    ks = jax.random.split(key, 4)

    def bn(c: int) -> dict[str, jax.Array]:
        one, zero = lambda: jnp.ones(c), lambda: jnp.zeros(c)  # noqa: E731
        return {"scale": one(), "bias": zero(), "mean": zero(), "var": one()}

    return {
        "conv1": _normal(ks[0], (3, 3, 1, 16), 0.3),
        "bn1": bn(16),
        "conv2": _normal(ks[1], (3, 3, 16, 32), 0.08),
        "bn2": bn(32),
        "dense1": _normal(ks[2], (7 * 7 * 32, 128), 0.03),
        "b1": jnp.zeros(128),
        "dense2": _normal(ks[3], (128, 10), 0.1),
        "b2": jnp.zeros(10),
    }


def _conv_bn_pool(x: jax.Array, kernel: jax.Array, bn: dict[str, jax.Array]) -> jax.Array:
    x = jax.lax.conv_general_dilated(
        x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    x = (x - bn["mean"]) * jax.lax.rsqrt(bn["var"] + 1e-5) * bn["scale"] + bn["bias"]
    x = jax.nn.relu(x)
    return jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4


def cnn_loss(params: dict[str, Any], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    x = _conv_bn_pool(x, params["conv1"], params["bn1"])
    x = _conv_bn_pool(x, params["conv2"], params["bn2"])
    x = jax.nn.relu(x.reshape(x.shape[0], -1) @ params["dense1"] + params["b1"])
    logits = x @ params["dense2"] + params["b2"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def cnn_data(batch: int) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.uniform(kx, (batch, 28, 28, 1)), jax.random.randint(ky, (batch,), 0, 10)


def nnx_cnn() -> tuple[Callable[..., Any], Any]:
    """The same CNN with flax NNX (nnx.Conv, nnx.BatchNorm in eval mode): ``(loss, params)``;
    the non-parameter state (BatchNorm statistics) is closed over, as nnx.split/merge give."""
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
            self.bn1 = nnx.BatchNorm(16, use_running_average=True, rngs=rngs)
            self.conv2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
            self.bn2 = nnx.BatchNorm(32, use_running_average=True, rngs=rngs)
            self.dense1 = nnx.Linear(7 * 7 * 32, 128, rngs=rngs)
            self.dense2 = nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            x = nnx.avg_pool(nnx.relu(self.bn1(self.conv1(x))), (2, 2), (2, 2))
            x = nnx.avg_pool(nnx.relu(self.bn2(self.conv2(x))), (2, 2), (2, 2))
            return self.dense2(nnx.relu(self.dense1(x.reshape(x.shape[0], -1))))

    graphdef, params, rest = nnx.split(CNN(nnx.Rngs(0)), nnx.Param, ...)

    def loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        x, y = batch
        logits = nnx.merge(graphdef, params, rest)(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    return loss, params


VOCAB, SEQ, DIM, HEADS, LAYERS = 256, 128, 128, 4, 4


def lm_params(key: Any, dtype: Any = jnp.float32) -> dict[str, Any]:
    keys = iter(jax.random.split(key, 3 + 4 * LAYERS))
    ln = lambda: {"scale": jnp.ones(DIM), "bias": jnp.zeros(DIM)}  # noqa: E731
    proj = 0.02 / math.sqrt(2 * LAYERS)
    params = {
        "embed": _normal(next(keys), (VOCAB, DIM), 0.02),
        "pos": _normal(next(keys), (SEQ, DIM), 0.02),
        "layers": [
            {
                "ln1": ln(),
                "qkv": _normal(next(keys), (DIM, 3 * DIM), 0.02),
                "out": _normal(next(keys), (DIM, DIM), proj),
                "ln2": ln(),
                "w1": _normal(next(keys), (DIM, 4 * DIM), 0.02),
                "b1": jnp.zeros(4 * DIM),
                "w2": _normal(next(keys), (4 * DIM, DIM), proj),
                "b2": jnp.zeros(DIM),
            }
            for _ in range(LAYERS)
        ],
        "ln_f": ln(),
        "head": _normal(next(keys), (DIM, VOCAB), 0.02),
    }
    return jax.tree.map(lambda x: x.astype(dtype), params)


def _layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * p["scale"] + p["bias"]


def lm_logits(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    b, t = tokens.shape
    head_dim = DIM // HEADS
    x = params["embed"][tokens] + params["pos"][:t]
    causal = jnp.tril(jnp.ones((t, t), bool))
    for layer in params["layers"]:
        h = _layer_norm(x, layer["ln1"]) @ layer["qkv"]
        q, k, v = (z.reshape(b, t, HEADS, head_dim) for z in jnp.split(h, 3, axis=-1))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(x.dtype)
        attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, DIM)
        x = x + attn @ layer["out"]
        h = jax.nn.gelu(_layer_norm(x, layer["ln2"]) @ layer["w1"] + layer["b1"])
        x = x + h @ layer["w2"] + layer["b2"]
    return (_layer_norm(x, params["ln_f"]) @ params["head"]).astype(jnp.float32)


def lm_loss(params: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(mean cross-entropy over valid tokens, number of valid tokens)``: ``weighted=True``."""
    logits = lm_logits(params, batch["inputs"])
    ce = (
        jax.nn.logsumexp(logits, -1)
        - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    )
    mask = batch["mask"]
    count = mask.sum()
    return (ce * mask).sum() / jnp.maximum(count, 1.0), count


def lm_data(batch: int) -> dict[str, jax.Array]:
    kt, kl = jax.random.split(jax.random.key(1))
    tokens = jax.random.randint(kt, (batch, SEQ + 1), 0, VOCAB)
    lengths = jax.random.randint(kl, (batch, 1), SEQ // 8, SEQ + 1)
    mask = (jnp.arange(SEQ)[None, :] < lengths).astype(jnp.float32)
    tokens = jnp.where(jnp.arange(SEQ + 1)[None, :] <= lengths, tokens, 0)  # padding id 0
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


class Family:
    """A model family: ``loss(params, batch)``, params, batch, optimizer, and how to count."""

    def __init__(
        self,
        key: str,
        name: str,
        loss: Callable[..., Any],
        params: Any,
        batch: Any,
        optimizer: optax.GradientTransformation,
        weighted: bool = False,
        unit: str = "examples",
    ) -> None:
        self.key, self.name, self.loss, self.params, self.batch = key, name, loss, params, batch
        self.optimizer, self.weighted, self.unit = optimizer, weighted, unit
        self.size = jax.tree.leaves(batch)[0].shape[0]
        self.items = float(batch["mask"].sum()) if unit == "tokens" else float(self.size)

    def param_bytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.params))


def families(quick: bool, lm_batch: int = 32) -> dict[str, Family]:
    return {
        "mlp": Family(
            "mlp",
            f"gist MLP 784-100-10, batch {GIST.batch}",
            mlp_loss,
            GIST.params(),
            GIST.data(),
            optax.sgd(1e-2),
        ),
        "cnn": Family(
            "cnn",
            "CNN (2 conv + BatchNorm eval), 28x28x1, batch 256",
            cnn_loss,
            cnn_params(jax.random.key(0)),
            cnn_data(256),
            optax.sgd(1e-2),
        ),
        "transformer": Family(
            "transformer",
            f"decoder LM 4x128, 4 heads, seq 128, vocab 256, batch {lm_batch} (token-weighted)",
            lm_loss,
            lm_params(jax.random.key(0)),
            lm_data(lm_batch),
            optax.adam(1e-3),
            weighted=True,
            unit="tokens",
        ),
        "transformer_bf16": Family(
            "transformer_bf16",
            f"the same LM, bfloat16 params (float32 accumulation), batch {lm_batch}",
            lm_loss,
            lm_params(jax.random.key(0), jnp.bfloat16),
            lm_data(lm_batch),
            optax.adam(1e-3),
            weighted=True,
            unit="tokens",
        ),
    }


# --- the ways -------------------------------------------------------------------------------


def compile_timed(jitted: Any, *args: Any) -> tuple[Any, float, int]:
    """``(compiled, seconds to lower and compile, temp bytes)``."""
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    seconds = time.perf_counter() - start
    return compiled, seconds, compiled.memory_analysis().temp_size_in_bytes


def _value(fam: Family) -> Callable[..., Any]:
    """The loss as ``jax.value_and_grad`` of the full batch wants it (weight dropped)."""
    if fam.weighted:
        return lambda p, b: fam.loss(p, b)[0]
    return fam.loss


def _micro_batches(batch: Any, k: int) -> list[Any]:
    """Strided micro-batches (examples i, i + k, ...), as jaxaccum splits."""
    return [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]


def _apply(optimizer: optax.GradientTransformation) -> Callable[..., Any]:
    def apply(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return apply


class Way:
    """One way to make an optimizer step: ``build`` compiles (timed), ``step`` runs one."""

    name = ""
    per_call = False

    def __init__(self, fam: Family, k: int) -> None:
        self.fam, self.k = fam, k
        self.compile_s = 0.0
        self.temp = 0
        self.temp_undonated: int | None = None

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
            with self.context():
                self.temp_undonated = compile_timed(program, params, state, self.fam.batch)[2]

    def context(self) -> Any:
        return contextlib.nullcontext()

    def step(self, params: Any, state: Any, data: Any) -> Any:
        return self.fn(params, state, data)

    def data(self) -> Any:
        return _micro_batches(self.fam.batch, self.k) if self.per_call else self.fam.batch

    def _compile(self, jitted: Any, *args: Any) -> Any:
        compiled, seconds, temp = compile_timed(jitted, *args)
        self.compile_s += seconds
        self.temp = max(self.temp, temp)
        return compiled


def _donate(donate: bool) -> tuple[int, ...]:
    return (0, 1) if donate else ()


class Full(Way):
    name = "full batch"

    def program(self, donate: bool) -> Any:
        apply, value = _apply(self.fam.optimizer), _value(self.fam)
        return jax.jit(
            lambda p, s, b: apply(p, s, jax.grad(value)(p, b)), donate_argnums=_donate(donate)
        )


class TrainStep(Way):
    name = "jaxaccum.train_step"

    def program(self, donate: bool) -> Any:
        return jaxaccum.train_step(
            self.fam.loss,
            self.fam.optimizer,
            num_microbatches=self.k,
            weighted=self.fam.weighted,
            donate=donate,
        )


class PythonLoop(Way):
    """k jitted calls ``acc <- acc + w * grad(micro-batch)`` (acc donated), one jitted update."""

    name = "Python loop"
    per_call = True

    def build(self, params: Any, state: Any) -> None:
        fam, apply = self.fam, _apply(self.fam.optimizer)

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
        self.add = self._compile(jax.jit(add, donate_argnums=1), params, acc, self.data()[0])
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
        apply, value = _apply(self.optimizer), _value(self.fam)
        fn = jax.jit(lambda p, s, b: apply(p, s, jax.grad(value)(p, b)), donate_argnums=(0, 1))
        self.fn = self._compile(fn, params, state, self.data()[0])

    def step(self, params: Any, state: Any, micro_batches: Any) -> Any:
        for micro in micro_batches:
            params, state = self.fn(params, state, micro)
        return params, state


class OptaxMicrobatching(Way):
    """optax.microbatching.microbatch around the gradient (a fori_loop), one update, one jit;
    weighted: it sums (w * grad, w) and divides, which is exact."""

    name = "optax.microbatching"

    def program(self, donate: bool) -> Any:
        fam, apply, size = self.fam, _apply(self.fam.optimizer), self.fam.size // self.k
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


def _copy(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


def run_k(
    fam: Family, k: int, ways: tuple[type[Way], ...], rounds: int, undonated: bool
) -> dict[str, Any]:
    """Builds every way for this k, then times them interleaved, round by round."""
    built = []
    for cls in ways:
        way = cls(fam, k)
        opt = getattr(way, "optimizer", fam.optimizer)
        params = _copy(fam.params)
        state = opt.init(params)
        way.build(params, state)
        if undonated:
            way.measure_undonated(params, state)
        built.append([way, params, state, way.data()])
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


def main_families(args: argparse.Namespace) -> None:
    fams = families(args.quick, args.lm_batch)
    results: dict[str, Any] = {"machine": machine(), "quick": args.quick, "families": {}}
    for key in args.families:
        fam = fams[key]
        ways: tuple[type[Way], ...] = WAYS
        ks = [k for k in args.ks if fam.size % k == 0 and k <= fam.size]
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
    path = save(args.out, results)
    plot_families(results, args.out)
    print(f"wrote {path} and {result_path(args.out, 'png')}")


def plot_families(results: dict[str, Any], name: str = "models") -> None:
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


# --- the CNN loop study ----------------------------------------------------------------------


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
        micro = _micro_batches(batch, self.k)
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
                canonical = bool(dims) and re.fullmatch(r"b(0?1?2?)f_\1io->b\1f", dims.group(1))
                label = " canonical" if canonical else f" {dims.group(1) if dims else '?'}"
            key = f"{op.group(1)}{label} {runs} in {where}"
            ops[key] = ops.get(key, 0) + 1
    return {"ops": ops, "moves": moves}


def _loop_variants(loss: Callable[..., Any], k: int, full_unroll_max: int) -> dict[str, Any]:
    """name -> (jitted value_and_grad, tracing context)."""
    vg = lambda **kw: jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k, **kw))  # noqa: E731
    none = contextlib.nullcontext
    out = {
        "full batch": (jax.jit(jax.value_and_grad(loss)), none),
        "hand-written lax.scan": (jax.jit(_hand_scan(loss, k)), none),
        "Python loop": (_LoopVG(loss, k), none),
        "jaxaccum": (vg(), none),
        "jaxaccum unroll=2": (vg(unroll=2), none),
        "jaxaccum unroll=4": (vg(unroll=4), none),
        "jaxaccum unroll=k": (vg(unroll=k), none),
        "jaxaccum, swapaxes split": (vg(), functools.partial(variant, split="swapaxes")),
        "jaxaccum, contiguous split": (vg(), functools.partial(variant, split="contiguous")),
    }
    if k < 4:
        del out["jaxaccum unroll=4"]
    if k < 2:
        for name in ("jaxaccum unroll=2", "jaxaccum unroll=k"):
            del out[name]
    if k > full_unroll_max:
        out.pop("jaxaccum unroll=k", None)
    return out


def _study(
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
            data, hlo = _micro_batches(batch, k), None
        else:
            with context():
                compiled, seconds, temp = compile_timed(fn, params, batch)
            run, data, hlo = compiled, batch, hlo_summary(compiled.as_text())
        out = run(params, data)
        err = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(reference), strict=True)
        )
        info = {"temp_bytes": temp, "compile_s": seconds, "max_abs_diff": err, "hlo": hlo}
        built[name] = (run, data, info)
    times: dict[str, list[float]] = {name: [] for name in built}
    for r in range(rounds + 1):  # the first round warms up
        for name, (run, data, _) in built.items():
            start = time.perf_counter()
            jax.block_until_ready(run(params, data))
            if r:
                times[name].append(time.perf_counter() - start)
    row = {
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
        for name, unroll in (("jaxaccum", None), ("jaxaccum unroll=k", "k")):
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


def train_step_compile(args: argparse.Namespace) -> None:
    """Lower + compile seconds of ``jaxaccum.train_step`` (donating, as the families run it)
    per family at k = 2, 8 and the largest k (64, the transformer 32): ``--rounds`` (default
    5) fresh jits of every (family, k), interleaved round by round; the minimum is the least
    disturbed by other load. Writes results/models_compile.json."""
    fams = families(quick=False, lm_batch=args.lm_batch)
    repeats = args.rounds or 5
    cases = []
    for key in args.families:
        fam = fams[key]
        top = max(k for k in KS if fam.size % k == 0 and k <= fam.size)
        cases += [(key, k) for k in (2, 8, top)]
    seconds: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    for _ in range(repeats):
        for key, k in cases:
            fam = fams[key]
            way = TrainStep(fam, k)
            params = _copy(fam.params)
            state = fam.optimizer.init(params)
            seconds[(key, k)].append(
                compile_timed(way.program(donate=True), params, state, fam.batch)[1]
            )
    out: dict[str, Any] = {"machine": machine(), "repeats": repeats, "families": {}}
    for key in args.families:
        ks = [k for f, k in cases if f == key]
        row = {k: {"min_s": min(seconds[(key, k)]), "all_s": seconds[(key, k)]} for k in ks}
        ratio = row[ks[-1]]["min_s"] / row[ks[0]]["min_s"]
        out["families"][key] = {"name": fams[key].name, "by_k": row, "ratio_top_to_2": ratio}
        print(
            f"compile {key:16s} "
            + "  ".join(f"k={k}: {row[k]['min_s']:.2f}s" for k in ks)
            + f"  k={ks[-1]}/k=2: {ratio:.2f}",
            flush=True,
        )
    print(f"wrote {save('models_compile', out)}")


def memory_probe(args: argparse.Namespace) -> None:
    """Temp bytes behind the memory findings (compile only, ~1 min): the gist MLP's and the
    CNN's ``value_and_grad`` per k with the micro-batches gathered in the loop (the library),
    split contiguously or by swapaxes before it; the transformer's ``train_step`` at k = 8 with
    and without donation, with its zero-weight skip as the library makes it (since f5b5746 a
    ``lax.cond`` when params and state are donated, a select otherwise) or always as a select
    (before f62b962). Writes results/models_memory.json."""
    from jaxaccum import _reductions

    out: dict[str, Any] = {"machine": machine(), "value_and_grad": {}, "transformer_skip": {}}
    cases = {
        "mlp": (mlp_loss, GIST.params(), GIST.data()),
        "cnn": (cnn_loss, cnn_params(jax.random.key(0)), cnn_data(256)),
    }
    for model, (loss, params, batch) in cases.items():
        rows: dict[str, Any] = {
            "param_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
            "full_temp_bytes": compile_timed(jax.jit(jax.value_and_grad(loss)), params, batch)[2],
        }
        for split in ("gather", "contiguous", "swapaxes"):
            for k in (1, 2, 4, 8, 16, 32, 64):
                fn = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k))
                with variant(split=split):
                    rows.setdefault(split, {})[k] = compile_timed(fn, params, batch)[2]
            print(f"temp {model} {split:10s} {rows[split]}", flush=True)
        out["value_and_grad"][model] = rows
    fam = families(quick=False, lm_batch=args.lm_batch)["transformer"]
    library = _reductions.step_unless_empty

    def select(total: Any, step: Any, old: Any, *, donated: bool) -> Any:
        return _reductions.unless_empty(total, old, step(old))

    for name, skip in (("library (f5b5746)", library), ("select always (before f62b962)", select)):
        _reductions.step_unless_empty = skip
        try:
            for donate in (True, False):
                params = _copy(fam.params)
                state = fam.optimizer.init(params)
                program = TrainStep(fam, 8).program(donate=donate)
                ma = program.lower(params, state, fam.batch).compile().memory_analysis()
                key = "donated" if donate else "not donated"
                out["transformer_skip"].setdefault(name, {})[key] = {
                    "temp_bytes": ma.temp_size_in_bytes,
                    "output_bytes": ma.output_size_in_bytes,
                }
        finally:
            _reductions.step_unless_empty = library
        print(f"transformer k=8 {name}: {out['transformer_skip'][name]}", flush=True)
    print(f"wrote {save('models_memory', out)}")


def loop_study(args: argparse.Namespace) -> None:
    ks = [k for k in args.ks if not args.quick or k in (1, 8, 64)]
    cnn_rounds = args.rounds or (2 if args.quick else 4)
    results: dict[str, Any] = {"machine": machine(), "cnn": {}, "mlp": {}, "nnx": {}}
    params, batch = cnn_params(jax.random.key(0)), cnn_data(256)
    results["cnn"] = {
        "model": "CNN (2 conv + BatchNorm eval), 28x28x1, batch 256",
        "rounds": cnn_rounds,
        "by_k": {},
    }
    for k in ks:
        variants = _loop_variants(cnn_loss, k, full_unroll_max=64)
        results["cnn"]["by_k"][k] = _study(cnn_loss, params, batch, k, variants, cnn_rounds)
    nnx_loss, nnx_params = nnx_cnn()
    vg = functools.partial(jaxaccum.value_and_grad, nnx_loss, num_microbatches=8)
    results["nnx"] = {
        "model": "the same CNN in flax NNX (nnx.Conv, nnx.BatchNorm eval)",
        "k": 8,
        "row": _study(
            nnx_loss,
            nnx_params,
            batch,
            8,
            {
                "full batch": (jax.jit(jax.value_and_grad(nnx_loss)), contextlib.nullcontext),
                "Python loop": (_LoopVG(nnx_loss, 8), contextlib.nullcontext),
                "jaxaccum": (jax.jit(vg()), contextlib.nullcontext),
            },
            cnn_rounds,
        ),
    }
    mlp_rounds = 10 if args.quick else 40
    results["mlp"] = {
        "model": f"gist MLP 784-100-10, batch {GIST.batch}",
        "rounds": mlp_rounds,
        "by_k": {},
    }
    for k in ks:
        variants = _loop_variants(mlp_loss, k, full_unroll_max=64)
        for name in ("jaxaccum, swapaxes split", "jaxaccum, contiguous split"):
            variants.pop(name)
        results["mlp"]["by_k"][k] = _study(
            mlp_loss, GIST.params(), GIST.data(), k, variants, mlp_rounds
        )
    results["compile"] = compile_study(repeats=2 if args.quick else 3)
    path = save("models_loops", results)
    print(f"wrote {path}")


def _ms(ms: float) -> str:
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _where(results: dict[str, Any], path: Any) -> str:
    m = results["machine"]
    return f"`{path.name}`: {m['backend']}, {m['cpu_count']} CPUs, jax {m['jax']}"


def targets() -> None:
    """The issue's targets, each from the run that decides it: the CNN, transformer and gist
    MLP speed ratios from the repeat runs (``models_cnn_r12``, ``models_cnn_r30`` where the
    ratio is close, ``models_transformer_r8``, ``models_mlp_r600``), bf16 and temp bytes from
    ``models``, compile times from ``models_compile``."""
    import json

    def load(name: str) -> dict[str, Any] | None:
        path = result_path(name, "json")
        return json.loads(path.read_text()) if path.exists() else None

    step, full, loop = TrainStep.name, Full.name, PythonLoop.name
    rows = []

    def by_k(results: dict[str, Any], key: str) -> dict[int, Any]:
        return {int(k): row for k, row in results["families"][key]["by_k"].items()}

    for key, name in (
        ("cnn", "models_cnn_r12"),
        ("cnn", "models_cnn_r30"),
        ("transformer", "models_transformer_r8"),
        ("transformer_bf16", "models"),
    ):
        results = load(name)
        if not results or key not in results["families"]:
            continue
        batch = results["families"][key]["batch"]
        cells = []
        for k, row in sorted(by_k(results, key).items()):
            if batch // k < 4:
                continue
            ratio = row[step]["ms"] / min(row[full]["ms"], row[loop]["ms"])
            cells.append(f"k={k}: {ratio:.2f}")
        rounds = results["families"][key]["rounds"]
        rows.append(
            [f"{key}: train_step / min(full, loop)", f"`{name}.json` ({rounds} rounds)", *cells]
        )
    mlp = load("models_mlp_r600")
    if mlp:
        rows_k = by_k(mlp, "mlp")
        rounds = mlp["families"]["mlp"]["rounds"]
        where = f"`models_mlp_r600.json` ({rounds} rounds)"
        rows.append(
            ["mlp: train_step / full (k <= 8)", where]
            + [f"k={k}: {rows_k[k][step]['ratio_to_full']:.2f}" for k in (1, 2, 4, 8)]
        )
        ms = rows_k[64]
        rows.append(
            ["mlp k=64: optax.MultiSteps / train_step", where]
            + [f"{ms['optax.MultiSteps']['ms'] / ms[step]['ms']:.1f}x faster"]
        )
    compiled = load("models_compile")
    if compiled:
        for key, entry in compiled["families"].items():
            ks = sorted(int(k) for k in entry["by_k"])
            lo, hi = (entry["by_k"][str(k)]["min_s"] for k in (ks[0], ks[-1]))
            rows.append(
                [
                    f"{key}: compile s (min of {compiled['repeats']}), k={ks[-1]} / k={ks[0]}",
                    "`models_compile.json`",
                    f"{hi:.2f} / {lo:.2f} = {hi / lo:.2f}",
                ]
            )
    results = load("models")
    if results:
        for key, entry in results["families"].items():
            rk = by_k(results, key)
            P, A = entry["param_bytes"], entry["full_temp_bytes"]
            A0 = entry.get("full_temp_bytes_undonated") or A
            cells, below = [], []
            for k, row in sorted(rk.items()):
                t, t0 = row[step]["temp_bytes"], row[step].get("temp_bytes_undonated")
                cell = f"k={k}: {t / (1.1 * P + 1.2 * A / k):.2f}"
                if t0:
                    cell += f" ({t0 / (1.1 * P + 1.2 * A0 / k):.2f})"
                cells.append(cell)
                if "optax.microbatching" in row and k > 1:
                    mb = row["optax.microbatching"]
                    below.append(f"k={k}: {t / mb['temp_bytes']:.2f}")
            rows.append([f"{key}: temp / (1.1P + 1.2A/k), donated (not)", "`models.json`", *cells])
            if below:
                rows.append([f"{key}: temp / optax.microbatching's", "`models.json`", *below])
            ks = sorted(k for k in rk if k >= 2)
            if len(ks) >= 2 and not compiled:
                lo, hi = rk[ks[0]][step]["compile_s"], rk[ks[-1]][step]["compile_s"]
                rows.append(
                    [f"{key}: compile s, k={ks[-1]} / k={ks[0]}", "`models.json`"]
                    + [f"{hi:.2f} / {lo:.2f} = {hi / lo:.2f}"]
                )
    width = max(len(r) for r in rows) if rows else 0
    rows = [r + [""] * (width - len(r)) for r in rows]
    print("\n**targets** (ratios; each row from the JSON named)\n")
    print(_table(["target", "from", *[""] * (width - 2)], rows))


def report(args: argparse.Namespace) -> None:
    """Prints the saved results as Markdown tables."""
    import json

    path = result_path(args.out, "json")
    if path.exists():
        results = json.loads(path.read_text())
        for entry in results["families"].values():
            by_k = {int(k): row for k, row in entry["by_k"].items()}
            names = list(by_k[min(by_k)])
            mib, P = 2**20, entry["param_bytes"]
            A = entry["full_temp_bytes"]
            print(
                f"\n**{entry['name']}** ({_where(results, path)}, {entry['rounds']} rounds): "
                f"ms per step (x full batch, x Python loop); {entry['unit']}/s in the plot\n"
            )
            rows = []
            for k, row in sorted(by_k.items()):
                cells = [
                    f"{_ms(v['ms'])} ({v['ratio_to_full']:.2f}x, {v['ratio_to_loop']:.2f}x)"
                    for v in row.values()
                ]
                rows.append([str(k), *cells])
            print(_table(["k", *names], rows))
            A0 = entry.get("full_temp_bytes_undonated") or A
            print(
                f"\ntemp MiB with params donated (without), P = {P / mib:.2f} MiB, A = "
                f"{A / mib:.2f} ({A0 / mib:.2f}) MiB: the full batch's temp; compile s\n"
            )
            rows = []
            for k, row in sorted(by_k.items()):
                t, t0 = (1.1 * P + 1.2 * A / k) / mib, (1.1 * P + 1.2 * A0 / k) / mib
                target = f"{t:.2f} ({t0:.2f})"
                cells = []
                for v in row.values():
                    undonated = v.get("temp_bytes_undonated")
                    extra = "" if undonated is None else f" ({undonated / mib:.2f})"
                    cells.append(f"{v['temp_bytes'] / mib:.2f}{extra} / {v['compile_s']:.1f}s")
                rows.append([str(k), target, *cells])
            print(_table(["k", "1.1P+1.2A/k", *names], rows))
    if args.out == "models":
        targets()
    path = result_path("models_loops", "json")
    if path.exists():
        loops = json.loads(path.read_text())
        for model in ("cnn", "mlp"):
            by_k = {int(k): row for k, row in loops[model]["by_k"].items()}
            names = list(dict.fromkeys(n for _, row in sorted(by_k.items()) for n in row))
            old = any("proposed" in n for n in names)
            print(
                f"\n**loop study, {loops[model]['model']}** ({_where(loops, path)}): ms (x full "
                "batch) / temp MiB"
                + (
                    "; measured before a4b2f71: `jaxaccum` is the library as it was (now "
                    f"`{BEFORE}`), `proposed` the prototype of what the library is now"
                    if old
                    else ""
                )
                + "\n"
            )
            rows = []
            for k, row in sorted(by_k.items()):
                rows.append(
                    [str(k)]
                    + [
                        f"{_ms(row[n]['ms'])} ({row[n]['ratio_to_full']:.2f}x) / "
                        f"{row[n]['temp_bytes'] / 2**20:.2f}"
                        if n in row
                        else ""
                        for n in names
                    ]
                )
            print(_table(["k", *names], rows))
        for model, rows_by_name in loops.get("compile", {}).items():
            print(f"\n**compile seconds ({model}, value_and_grad), min over repeats**\n")
            print(
                _table(
                    ["way", "k=2", "k=8", "k=64", "k=64 / k=2"],
                    [
                        [
                            name,
                            *(f"{row[str(k)]['min_s']:.2f}" for k in (2, 8, 64)),
                            f"{row['ratio_64_to_2']:.2f}",
                        ]
                        for name, row in rows_by_name.items()
                    ],
                )
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "what",
        nargs="?",
        default="families",
        choices=("families", "loops", "compile", "memory", "report"),
    )
    parser.add_argument(
        "--families", nargs="+", default=["mlp", "cnn", "transformer", "transformer_bf16"]
    )
    parser.add_argument("--ks", nargs="+", type=int, default=list(KS))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lm-batch", type=int, default=32, help="the transformer's batch")
    parser.add_argument("--out", default="models", help="results/OUT.json and OUT.png")
    args = parser.parse_args()
    if not args.out.startswith("models"):
        parser.error("--out must start with 'models'")
    if args.quick and args.out == "models" and args.what == "families":
        args.out = "models_quick"  # never overwrite the full run's results
    if args.what == "loops":
        loop_study(args)
    elif args.what == "compile":
        train_step_compile(args)
    elif args.what == "memory":
        memory_probe(args)
    elif args.what == "report":
        report(args)
    else:
        main_families(args)


if __name__ == "__main__":
    main()
