"""The model families the model benchmarks share (a library module: it runs nothing).

- ``mlp``: the gist MLP 784-100-10 (ReLU, MSE on one-hot targets), batch 64 (``_common.GIST``);
- ``cnn``: conv 3x3x16 - BatchNorm (eval) - ReLU - avg-pool 2, conv 3x3x32 - BatchNorm - ReLU -
  avg-pool 2, dense 128 (ReLU), dense 10, cross-entropy; 28x28x1 inputs, batch 256 (also in
  flax NNX: :func:`nnx_cnn`);
- ``transformer``: a decoder-only LM in plain JAX (4 layers, d=128, 4 heads, sequence 128,
  vocabulary 256, pre-LayerNorm, GELU MLP), sequences of random lengths padded to 128, loss the
  mean cross-entropy over valid tokens with ``weighted=True`` (weight: the number of valid
  tokens); batch 32 by default; Adam. ``transformer_bf16``: the same with bfloat16 parameters
  (float32 accumulation).

Used by families.py, compile_times.py, model_memory.py, loops.py and dropout.py (the LM).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from _common import GIST
from _common import loss as mlp_loss

import jaxaccum

KS = (1, 2, 4, 8, 16, 32, 64)
FAMILIES = ("mlp", "cnn", "transformer", "transformer_bf16")


def _normal(key: Any, shape: tuple[int, ...], scale: float) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32) * scale


# --- the CNN ------------------------------------------------------------------------------------


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

    split: Any = nnx.split(CNN(nnx.Rngs(0)), nnx.Param, ...)
    graphdef, params, rest = split

    def loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        x, y = batch
        logits = nnx.merge(graphdef, params, rest)(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    return loss, params


# --- the transformer LM -------------------------------------------------------------------------

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


def layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
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
        h = layer_norm(x, layer["ln1"]) @ layer["qkv"]
        q, k, v = (z.reshape(b, t, HEADS, head_dim) for z in jnp.split(h, 3, axis=-1))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(x.dtype)
        attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, DIM)
        x = x + attn @ layer["out"]
        h = jax.nn.gelu(layer_norm(x, layer["ln2"]) @ layer["w1"] + layer["b1"])
        x = x + h @ layer["w2"] + layer["b2"]
    return (layer_norm(x, params["ln_f"]) @ params["head"]).astype(jnp.float32)


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


# --- the families -------------------------------------------------------------------------------


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

    def ks(self, ks: Any = KS) -> list[int]:
        """The k of ``ks`` that divide the batch."""
        return [k for k in ks if self.size % k == 0 and k <= self.size]


def families(lm_batch: int = 32) -> dict[str, Family]:
    """The four families by key (``FAMILIES``); ``lm_batch``: the transformers' batch."""
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


# --- what the programs measure with -------------------------------------------------------------


def train_step(fam: Family, k: int, donate: bool) -> Any:
    """``jaxaccum.train_step`` of the family at ``k`` (the library as it is)."""
    return jaxaccum.train_step(
        fam.loss, fam.optimizer, num_microbatches=k, weighted=fam.weighted, donate=donate
    )


def compile_timed(jitted: Any, *args: Any) -> tuple[Any, float, int]:
    """``(compiled, seconds to lower and compile, temp bytes)``."""
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    seconds = time.perf_counter() - start
    return compiled, seconds, compiled.memory_analysis().temp_size_in_bytes


def strided_micro_batches(batch: Any, k: int) -> list[Any]:
    """Strided micro-batches (examples i, i + k, ...), as jaxaccum splits."""
    return [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]


def copy(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)
