"""A tiny transformer LM on variable-length sequences: the loss is a mean over real tokens.

Micro-batches of padded sequences hold different numbers of real tokens, so the mean of the
micro-batch means is not the batch's token mean: it over-weights the tokens of short
micro-batches. With ``weighted=True`` the loss returns ``(mean over its real tokens, their
number)`` and the accumulation returns ``sum_i mean_i * n_i / sum_i n_i``: the exact token mean.
The same holds for sequences packed into rows (``jaxaccum.packing``), with a number of
micro-batches that changes every step (``max_microbatches`` and ``jaxaccum.Microbatches``: one
compiled program for every count).

Checks: padded and packed, the accumulated loss and gradient equal the full padded batch's token
mean; the unweighted mean of micro-batch means does not. Then training on packed batches.
Run: ``python examples/token_lm.py [--smoke]``.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum
from jaxaccum.packing import attention_mask, pack, token_mean

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--smoke", action="store_true", help="a few steps only")
args = parser.parse_args()
V, D, L, B, K = 16, 32, 32, 32, 4  # vocabulary, width, max length, sequences a batch, k
ROWS, M = 4, 8  # packed: rows of L tokens a micro-batch, at most M micro-batches a step
STEPS = 5 if args.smoke else 300
rng = np.random.default_rng(0)


def sequences(n):  # counting mod V from a random start, 2 to L tokens long
    return [(rng.integers(V) + np.arange(rng.integers(2, L + 1))) % V for _ in range(n)]


def init():
    def normal(*shape, scale=1.0):  # jax arrays (numpy ones: a 2nd program after step 1)
        return jnp.asarray(scale * rng.normal(size=shape), jnp.float32)
    return {"embed": normal(V, D), "pos": normal(L, D, scale=0.5),
            "qkv": normal(3, D, D, scale=D**-0.5), "mlp": normal(D, 2 * D, scale=D**-0.5),
            "mlp_out": normal(2 * D, D, scale=(2 * D)**-0.5), "out": normal(D, V, scale=D**-0.5)}


def per_token_loss(p, tokens, segment_ids, positions):
    """One attention block; segment ids (0: padding) keep sequences apart (causal, same
    segment). Position t is scored on token t + 1 where that is in the same sequence."""
    h = p["embed"][tokens] + p["pos"][positions]
    q, k, v = jnp.einsum("bld,sde->sble", h, p["qkv"])
    scores = jnp.where(attention_mask(segment_ids), q @ k.swapaxes(1, 2) / D**0.5, -1e9)
    h = h + jax.nn.softmax(scores) @ v
    h = h + jnp.tanh(h @ p["mlp"]) @ p["mlp_out"]
    logits = h[:, :-1] @ p["out"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    has_target = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, :-1] > 0)
    return loss, jnp.where(has_target, segment_ids[:, :-1], 0)  # segment ids of the targets


def loss_fn(p, batch):  # (mean over the micro-batch's real target tokens, how many)
    return token_mean(*per_token_loss(p, *batch))


def padded(seqs):  # one sequence a row: (tokens, segment ids 1/0, positions)
    tokens, seg = np.zeros((len(seqs), L), np.int32), np.zeros((len(seqs), L), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)], seg[i, :len(s)] = s, 1
    return tokens, seg, np.broadcast_to(np.arange(L, dtype=np.int32), tokens.shape)


def packed(seqs):  # packed rows, grouped into at most M micro-batches of ROWS rows
    p = pack(seqs, rows=ROWS, length=L, max_microbatches=M)
    return p.microbatches("tokens", "segment_ids", "positions"), p


def rel(a, b):  # max |a - b| over max |b|, over whole pytrees
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True)) / max(
        float(np.max(np.abs(y))) for y in b)


params = init()
seqs = sequences(B)
batch = padded(seqs)
full = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b)[0]))(params, batch)  # one batch
weighted = jax.jit(jaxaccum.value_and_grad(loss_fn, num_microbatches=K, weighted=True))
naive = jax.jit(jaxaccum.value_and_grad(lambda p, b: loss_fn(p, b)[0], num_microbatches=K))
stack, info = packed(seqs)
packed_vg = jax.jit(jaxaccum.value_and_grad(loss_fn, max_microbatches=M, weighted=True))

counts = [int(np.sum(batch[1][i::K]) - len(seqs[i::K])) for i in range(K)]
print(f"{B} sequences, {sum(counts)} target tokens; padded micro-batches hold {counts}; packed: "
      f"{info.num_microbatches} of {M} micro-batches, {info.fill:.0%} full")
# float32 rounding of sums over ~500 tokens in another order: ~1e-7 relative; 1e-5 leaves room.
for name, got in [("padded, weighted", weighted(params, batch)),
                  ("packed, weighted", packed_vg(params, stack)),
                  ("padded, mean of means", naive(params, batch))]:
    errors = rel(got[0], full[0]), rel(got[1], full[1])
    print(f"{name:22s} vs the full batch's token mean: loss {errors[0]:.1e}, "
          f"grads {errors[1]:.1e} (relative)")
    if "weighted" in name:
        assert max(errors) < 1e-5, (name, errors)
    else:  # measured: the gradient is 2e-2 off here, 1e5x the rounding
        assert errors[1] > 1e-3, errors

# Training on packed batches: every step packs a fresh batch into however many micro-batches
# it needs (at most M); one compiled step serves every count.
optimizer = optax.adam(3e-3)
step = jaxaccum.train_step(loss_fn, optimizer, max_microbatches=M, weighted=True)
opt_state, losses, used = optimizer.init(params), [], set()
for t in range(STEPS):
    stack, info = packed(sequences(B))
    params, opt_state, loss, _ = step(params, opt_state, stack)
    losses.append(float(loss))
    used.add(info.num_microbatches)
    if t % 50 == 0:
        print(f"step {t}: token-mean loss {loss:.4f} ({info.num_microbatches} micro-batches)")
print(f"tiny transformer LM, {STEPS} packed steps of {B} sequences (micro-batch counts "
      f"{sorted(used)}, {step.num_programs} compiled program): token-mean loss "
      f"{losses[0]:.3f} -> {losses[-1]:.3f}")
assert step.num_programs == 1 and len(used) > 1
assert losses[-1] < (1.0 if args.smoke else 0.2) * losses[0]
print("OK: weighted accumulation gives the exact token mean, padded and packed")
