"""Losses that couple the batch: in-batch negatives (CLIP/InfoNCE, late interaction) through
the representations, and global-batch statistics (MoE load balancing, GRPO group advantages)
first. Each equals the full batch within float32 rounding of a float64 reference, for any k."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_within_rounding, full_and_reference, max_rel_diff, refuses, to_float64

import jaxaccum

B, D, E = 64, 12, 8


def tower(key, sizes=(D, 16, E)):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, sizes[:2]) / np.sqrt(sizes[0]),
            "w2": jax.random.normal(k2, sizes[1:]) / np.sqrt(sizes[1])}


def apply_tower(p, x, keep=None):
    h = jnp.tanh(x @ p["w1"])
    if keep is not None:  # dropout from per-example keys: the same masks in both passes
        h = jnp.where(keep, h / 0.75, 0.0)
    z = h @ p["w2"]
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def masks(keys, width):
    """keep-masks drawn as bits against a threshold: the same in float32 and float64 runs."""
    bits = jax.vmap(lambda k: jax.random.bits(k, (width,), jnp.uint32))(keys)
    return bits < jnp.uint32(int(0.75 * 2**32))


def encode(params, batch):
    x_img, x_txt, keys = batch
    keep = masks(keys, params["img"]["w1"].shape[1])
    return apply_tower(params["img"], x_img, keep), apply_tower(params["txt"], x_txt)


def clip_loss(params, reps, batch):
    """The symmetric CLIP loss: every image against every text of the batch."""
    z_img, z_txt = reps
    logits = z_img @ z_txt.T * jnp.exp(params["log_t"])
    labels = jnp.arange(logits.shape[0])
    a = -jnp.mean(jax.nn.log_softmax(logits, axis=1)[labels, labels])
    b = -jnp.mean(jax.nn.log_softmax(logits, axis=0)[labels, labels])
    return (a + b) / 2


def clip_data():
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"img": tower(keys[0]), "txt": tower(keys[1]), "log_t": jnp.asarray(1.5)}
    x = jax.random.normal(keys[2], (B, D))
    batch = (x, x + 0.3 * jax.random.normal(keys[3], (B, D)),
             jax.random.key_data(jaxaccum.per_example_keys(jax.random.key(5), B)))
    return params, batch


def raw_keys(batch):
    return (*batch[:2], jax.random.wrap_key_data(batch[2]))


@pytest.mark.parametrize("k", [1, 2, 8, 32])
def test_clip_loss_through_representations_equals_the_full_batch(k):
    params, batch = clip_data()

    def full(p, b):
        return clip_loss(p, encode(p, raw_keys(b)), b)

    full32, ref64 = full_and_reference(full, params, batch)
    fn = jaxaccum.coupled_value_and_grad(lambda p, b: encode(p, raw_keys(b)), clip_loss,
                                         num_microbatches=k)
    got = jax.jit(fn)(params, batch)
    err, err_full = assert_within_rounding(got, full32, ref64)
    print(f"CLIP k={k}: error vs float64 {err:.2e}, full batch float32 {err_full:.2e}")
    # the objective plain accumulation optimises instead: B/k - 1 negatives per example
    plain = jax.jit(jaxaccum.value_and_grad(full, num_microbatches=k))(params, batch)
    if k > 1:
        assert max_rel_diff(plain, ref64) > 1e-2


def test_late_interaction_max_sim_equals_the_full_batch():
    """ColBERT-like scores: each query token's best match among a document's tokens."""
    keys = jax.random.split(jax.random.key(1), 3)
    params = {"q": tower(keys[0]), "d": tower(keys[1]), "log_t": jnp.asarray(1.0)}
    tokens = jax.random.normal(keys[2], (B, 2, 5, D))  # (query, document) x 5 tokens

    def encode_tokens(p, x):
        return apply_tower(p["q"], x[:, 0]), apply_tower(p["d"], x[:, 1])

    def max_sim_loss(p, reps, x):
        q, d = reps  # (B, 5, E) each
        sim = jnp.einsum("qse,dte->qdst", q, d).max(-1).sum(-1) * jnp.exp(p["log_t"])
        return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(sim, axis=1)))

    def full(p, x):
        return max_sim_loss(p, encode_tokens(p, x), x)

    full32, ref64 = full_and_reference(full, params, tokens)
    for k in (2, 8):
        got = jax.jit(jaxaccum.coupled_value_and_grad(encode_tokens, max_sim_loss,
                                                      num_microbatches=k))(params, tokens)
        assert_within_rounding(got, full32, ref64)


def test_dropout_masks_replay_identically_in_the_second_pass():
    """With per-example keys the replayed forward draws the first pass's masks: the result is
    the full batch's with the same masks, and other masks give another gradient."""
    params, batch = clip_data()
    fn = jax.jit(jaxaccum.coupled_value_and_grad(lambda p, b: encode(p, raw_keys(b)), clip_loss,
                                                 num_microbatches=8))
    got = fn(params, batch)
    full = jax.jit(jax.value_and_grad(lambda p, b: clip_loss(p, encode(p, raw_keys(b)), b)))
    np.testing.assert_allclose(got[0], full(params, batch)[0], rtol=1e-6)
    assert max_rel_diff(got[1], full(params, batch)[1]) < 1e-5
    other = (*batch[:2], jax.random.key_data(jaxaccum.per_example_keys(jax.random.key(6), B)))
    assert max_rel_diff(got[1], full(params, other)[1]) > 1e-3


def test_coupled_refuses_options_without_meaning():
    with refuses(TypeError, match="jaxaccum.coupled_value_and_grad: weighted= is not"):
        jaxaccum.coupled_value_and_grad(encode, clip_loss, num_microbatches=2, weighted=True)
    with refuses(TypeError, match="has_aux must be a bool .* got 'concat'"):
        jaxaccum.coupled_value_and_grad(encode, clip_loss, num_microbatches=2, has_aux="concat")


def test_coupled_aux_is_the_whole_batch_s():
    """has_aux=True: the loss's aux (in-batch retrieval accuracy, per-example logit of the
    positive) is computed once on the whole batch's representations: the full batch's aux."""

    def loss_with_aux(params, reps, batch):
        z_img, z_txt = reps
        logits = z_img @ z_txt.T
        hits = jnp.mean(jnp.argmax(logits, axis=1) == jnp.arange(logits.shape[0]))
        return clip_loss(params, reps, batch), {"top1": hits, "pos": jnp.diagonal(logits)}

    params, batch = clip_data()
    enc = lambda p, b: encode(p, raw_keys(b))  # noqa: E731
    full = jax.jit(jax.value_and_grad(lambda p, b: loss_with_aux(p, enc(p, b), b), has_aux=True))
    (want_loss, want_aux), want_grads = full(params, batch)
    fn = jax.jit(jaxaccum.coupled_value_and_grad(enc, loss_with_aux, num_microbatches=8,
                                                 has_aux=True))
    (loss, aux), grads = fn(params, batch)
    assert float(aux["top1"]) == float(want_aux["top1"])
    # the same float32 logits up to the rounding of the tower's matmuls (~1e-7 relative)
    np.testing.assert_allclose(aux["pos"], want_aux["pos"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert max_rel_diff(grads, want_grads) < 1e-5
    opt = optax.sgd(0.1)
    step = jaxaccum.coupled_train_step(enc, loss_with_aux, opt, num_microbatches=8,
                                       has_aux=True, donate=False)
    _, _, value, info = step(params, opt.init(params), batch)
    assert float(info.aux["top1"]) == float(want_aux["top1"])


# --- statistics first: MoE load balancing, GRPO -------------------------------------------------


def router(params, x):
    return jax.nn.softmax(x @ params["router"], axis=-1)  # (n, experts)


def moe_stats(params, batch):
    """Sums over the micro-batch: tokens routed to each expert (top 2), router probabilities."""
    x, _ = batch
    probs = router(params, x)
    top2 = jax.nn.one_hot(jax.lax.top_k(probs, 2)[1], probs.shape[-1]).sum(1)
    return {"routed": top2.sum(0), "n": jnp.asarray(x.shape[0], jnp.float32)}


def moe_loss(params, batch, totals):
    """Task loss plus the global-batch load-balancing term E * sum_e f_e P_e, f_e the whole
    batch's routed fractions (no gradient), P_e the mean router probability."""
    x, y = batch
    probs = router(params, x)
    experts = jnp.einsum("nd,edo->neo", x, params["experts"])
    out = jnp.einsum("ne,neo->no", probs, experts)
    task = jnp.mean((out - y) ** 2)
    f = totals["routed"] / (2 * totals["n"])
    balance = probs.shape[-1] * jnp.sum(f * jnp.mean(probs, axis=0))
    return task + 0.1 * balance


def test_moe_global_load_balancing_equals_the_full_batch():
    keys = jax.random.split(jax.random.key(2), 4)
    params = {"router": jax.random.normal(keys[0], (D, 8)),
              "experts": jax.random.normal(keys[1], (8, D, 4)) / np.sqrt(D)}
    batch = (jax.random.normal(keys[2], (B, D)), jax.random.normal(keys[3], (B, 4)))

    def full(p, b):
        return moe_loss(p, b, jax.lax.stop_gradient(moe_stats(p, b)))

    full32, ref64 = full_and_reference(full, params, batch)
    for k in (2, 8, 32):
        got = jax.jit(jaxaccum.statistics_first(moe_stats, moe_loss, num_microbatches=k))(
            params, batch)
        assert_within_rounding(got, full32, ref64)
    # per-micro-batch balancing (the statistics of each micro-batch alone) is another loss
    local = jax.jit(jaxaccum.value_and_grad(full, num_microbatches=8))(params, batch)
    assert max_rel_diff(local, ref64) > 1e-3


GROUPS, G = 8, 8  # 8 prompts x 8 completions, each group contiguous: it spans micro-batches


def grpo_stats(params, batch):
    _, reward, group = batch
    one_hot = jax.nn.one_hot(group, GROUPS)
    return {"sum": one_hot.T @ reward, "sq": one_hot.T @ reward**2, "n": one_hot.sum(0)}


def grpo_loss(params, batch, totals):
    """-mean(A * log p), A the reward normalised by its group's mean and std (whole batch)."""
    x, reward, group = batch
    mean = totals["sum"] / totals["n"]
    std = jnp.sqrt(jnp.maximum(totals["sq"] / totals["n"] - mean**2, 0.0)) + 1e-4
    advantage = (reward - mean[group]) / std[group]
    logp = jax.nn.log_sigmoid(x @ params["w"])
    return -jnp.mean(advantage * logp)


def test_grpo_group_normalised_advantages_equal_the_full_batch():
    keys = jax.random.split(jax.random.key(3), 3)
    params = {"w": jax.random.normal(keys[0], (D,)) / np.sqrt(D)}
    batch = (jax.random.normal(keys[1], (B, D)), jax.random.normal(keys[2], (B,)),
             jnp.repeat(jnp.arange(GROUPS), G))

    def full(p, b):
        return grpo_loss(p, b, jax.lax.stop_gradient(grpo_stats(p, b)))

    full32, ref64 = full_and_reference(full, params, batch)
    for k in (2, 8):
        got = jax.jit(jaxaccum.statistics_first(grpo_stats, grpo_loss, num_microbatches=k))(
            params, batch)
        assert_within_rounding(got, full32, ref64)
    local = jax.jit(jaxaccum.value_and_grad(full, num_microbatches=8))(params, batch)
    assert max_rel_diff(local, ref64) > 1e-2


def test_statistics_first_takes_weighted_and_aux_like_value_and_grad():
    """GRPO with padded completions: ``weighted`` gives the mean over the real completions of
    the whole batch, and the per-example aux ("concat") comes back in batch order."""
    keys = jax.random.split(jax.random.key(4), 3)
    params = {"w": jax.random.normal(keys[0], (D,)) / np.sqrt(D)}
    valid = (jnp.arange(B) % 3 != 0)  # every third completion is padding
    batch = (jax.random.normal(keys[1], (B, D)), jax.random.normal(keys[2], (B,)),
             jnp.repeat(jnp.arange(GROUPS), G), valid)

    def stats(p, b):
        x, r, g, v = b
        return grpo_stats(p, (x, r * v, jnp.where(v, g, GROUPS)))  # padding in no group

    def loss(p, b, totals):
        x, r, g, v = b
        mean = totals["sum"] / totals["n"]
        std = jnp.sqrt(jnp.maximum(totals["sq"] / totals["n"] - mean**2, 0.0)) + 1e-4
        logp = jax.nn.log_sigmoid(x @ p["w"])
        per = -(r - mean[g]) / std[g] * logp
        n = jnp.sum(v)
        return (jnp.sum(jnp.where(v, per, 0.0)) / jnp.maximum(n, 1), n), per

    def full(p, b):
        (value, _), per = loss(p, b, jax.lax.stop_gradient(stats(p, b)))
        return value, per

    full32 = jax.jit(jax.value_and_grad(full, has_aux=True))(params, batch)
    with jax.enable_x64(True):
        ref = jax.jit(jax.value_and_grad(full, has_aux=True))(to_float64(params),
                                                             to_float64(batch))
        ref64 = jax.tree.map(lambda a: np.asarray(a, np.float64), ref)
    fn = jax.jit(jaxaccum.statistics_first(stats, loss, num_microbatches=8, weighted=True,
                                           has_aux="concat"))
    (value, per), grads = fn(params, batch)
    assert_within_rounding(((value, per), grads), full32, ref64)
    naive = jax.jit(jaxaccum.value_and_grad(full, num_microbatches=2, has_aux="concat"))
    assert max_rel_diff(naive(params, batch)[1], ref64[1]) > 1e-2  # groups' own statistics


def test_nnx_statistics_first_equals_the_full_batch():
    from flax import nnx

    import jaxaccum.nnx

    class Moe(nnx.Module):
        def __init__(self, rngs):
            self.router = nnx.Param(jax.random.normal(rngs.params(), (D, 8)))
            self.experts = nnx.Param(jax.random.normal(rngs.params(), (8, D, 4)) / np.sqrt(D))

    def pure(m):
        return {"router": m.router[...], "experts": m.experts[...]}

    model = Moe(nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(2), 2)
    batch = (jax.random.normal(keys[0], (B, D)), jax.random.normal(keys[1], (B, 4)))
    ref_loss, ref_grads = nnx.value_and_grad(
        lambda m, b: moe_loss(pure(m), b, jax.lax.stop_gradient(moe_stats(pure(m), b))))(
        model, batch)
    fn = jaxaccum.nnx.statistics_first(lambda m, b: moe_stats(pure(m), b),
                                       lambda m, b, t: moe_loss(pure(m), b, t),
                                       num_microbatches=8)
    value, grads = nnx.jit(fn)(model, batch)
    # float32 rounding of this loss is ~1e-7 relative (the float64-referenced MoE test above);
    # per-micro-batch statistics change the gradient by more than 1e-3
    assert float(value) == pytest.approx(float(ref_loss), rel=1e-5)
    assert max_rel_diff(nnx.to_pure_dict(grads), nnx.to_pure_dict(ref_grads)) < 1e-5


def test_coupled_train_step_follows_the_full_batch_trajectory():
    """3 Adam steps of the CLIP loss: the coupled train step stays within float32 rounding of
    the float64 full-batch trajectory; the statistics-first step likewise for the MoE loss."""
    from conftest import float64_trajectory, full_batch_trajectory

    params, batch = clip_data()
    batches = [batch] * 3

    def full(p, b):
        return clip_loss(p, encode(p, raw_keys(b)), b)

    expected = full_batch_trajectory(full, optax.adam(1e-2), params, batches)
    reference = float64_trajectory(full, lambda: optax.adam(1e-2), params, batches)
    opt = optax.adam(1e-2)
    step = jaxaccum.coupled_train_step(lambda p, b: encode(p, raw_keys(b)), clip_loss, opt,
                                       num_microbatches=8, donate=False)
    p, state = params, opt.init(params)
    for b in batches:
        p, state, _, info = step(p, state, b)
    assert int(info.num_microbatches) == 8 and info.aux is None
    assert_within_rounding(p, expected, reference)

    keys = jax.random.split(jax.random.key(2), 4)
    moe = {"router": jax.random.normal(keys[0], (D, 8)),
           "experts": jax.random.normal(keys[1], (8, D, 4)) / np.sqrt(D)}
    data = [(jax.random.normal(keys[2], (B, D)), jax.random.normal(keys[3], (B, 4)))] * 3

    def moe_full(p, b):
        return moe_loss(p, b, jax.lax.stop_gradient(moe_stats(p, b)))

    expected = full_batch_trajectory(moe_full, optax.adam(1e-2), moe, data)
    reference = float64_trajectory(moe_full, lambda: optax.adam(1e-2), moe, data)
    step = jaxaccum.statistics_first_train_step(moe_stats, moe_loss, opt, num_microbatches=8,
                                                donate=False)
    p, state = moe, opt.init(moe)
    for b in data:
        p, state, _, _ = step(p, state, b)
    assert_within_rounding(p, expected, reference)


def test_nnx_coupled_value_and_grad_equals_the_full_batch():
    from flax import nnx

    import jaxaccum.nnx

    class Towers(nnx.Module):
        def __init__(self, rngs):
            self.img = nnx.Linear(D, E, rngs=rngs)
            self.txt = nnx.Linear(D, E, rngs=rngs)
            self.log_t = nnx.Param(jnp.asarray(1.0))

    def encode_nnx(m, b):
        norm = lambda z: z / jnp.linalg.norm(z, axis=-1, keepdims=True)  # noqa: E731
        return norm(jnp.tanh(m.img(b[0]))), norm(jnp.tanh(m.txt(b[1])))

    def loss_nnx(m, reps, b):
        return clip_loss({"log_t": m.log_t[...]}, reps, b)

    model = Towers(nnx.Rngs(0))
    _, batch = clip_data()
    batch = batch[:2]
    ref_loss, ref_grads = nnx.value_and_grad(lambda m, b: loss_nnx(m, encode_nnx(m, b), b))(
        model, batch)
    fn = jaxaccum.nnx.coupled_value_and_grad(encode_nnx, loss_nnx, num_microbatches=8)
    value, grads = nnx.jit(fn)(model, batch)
    # float32 rounding of this loss is ~1e-7 relative (the float64-referenced CLIP tests above);
    # a wrong number of negatives or a missing cotangent is above 1e-2
    assert float(value) == pytest.approx(float(ref_loss), rel=1e-5)
    assert max_rel_diff(nnx.to_pure_dict(grads), nnx.to_pure_dict(ref_grads)) < 1e-5


def representation_cache(encode_fn, loss, k):
    """GradCache's method written out by hand (Gao et al. 2021): the representations of every
    micro-batch, the loss and its cotangents on all of them, then one VJP per micro-batch
    summed into a single accumulator."""

    def step(params, batch):
        micro = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)
        reps = jax.lax.map(lambda mb: encode_fn(params, mb), micro)
        reps = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), reps)
        value, (direct, cot) = jax.value_and_grad(loss, (0, 1))(params, reps, batch)
        cot = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), cot)

        def pull(acc, xs):
            _, vjp = jax.vjp(lambda p: encode_fn(p, xs[0]), params)
            return jax.tree.map(jnp.add, acc, vjp(xs[1])[0]), None

        sums, _ = jax.lax.scan(pull, jax.tree.map(jnp.zeros_like, params), (micro, cot))
        return value, jax.tree.map(jnp.add, direct, sums)

    return step


@pytest.mark.parametrize("k", [2, 8, 32])
def test_coupled_memory_is_the_representation_cache_s(k):
    """The coupled path holds what GradCache's method holds and nothing more: its compiled temp
    is at most the hand-written cache's (a few scalars of bookkeeping aside), so neither a
    gradient-sized buffer after the loop (the towers' 256 x 256 layer) nor a copy of the
    representations (put back in batch order after the forward loop) is left. The tiled loss
    keeps the loss's own memory small enough for either to show."""
    from jaxaccum.contrastive import clip_loss as tiled

    n, width, dim = 512, 256, 64
    keys = jax.random.split(jax.random.key(3), 4)
    sizes = (D, width, width, dim)

    def wide(key):
        ws = jax.random.split(key, 3)
        return {f"w{i}": jax.random.normal(ws[i], sizes[i:i + 2]) / np.sqrt(sizes[i])
                for i in range(3)}

    def apply(p, x):
        z = jnp.tanh(jnp.tanh(x @ p["w0"]) @ p["w1"]) @ p["w2"]
        return z / jnp.linalg.norm(z, axis=-1, keepdims=True)

    def enc(p, b):
        return apply(p["img"], b[0]), apply(p["txt"], b[1])

    def loss(p, reps, b):
        return tiled(*reps, p["log_t"], tile=64)

    params = {"img": wide(keys[0]), "txt": wide(keys[1]), "log_t": jnp.asarray(1.5)}
    batch = (jax.random.normal(keys[2], (n, D)), jax.random.normal(keys[3], (n, D)))

    def temp(fn):
        compiled = jax.jit(fn).lower(params, batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    ours = temp(jaxaccum.coupled_value_and_grad(enc, loss, num_microbatches=k))
    cache = temp(representation_cache(enc, loss, k))
    assert ours <= cache + 256, (ours, cache)
