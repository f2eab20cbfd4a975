"""jaxaccum.contrastive: the tiled losses equal their plain formulas (a float64 reference, value
and gradients with respect to both sides, the scale and the bias) within float32 error, with
tiles that do and do not divide the batch, with and without masks; no buffer of two
batch-sized dimensions in the compiled loss; through coupled_train_step."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxaccum
from jaxaccum.contrastive import clip_loss, pairwise_logsumexp, pairwise_sum, siglip_loss

EPS32 = float(np.finfo(np.float32).eps)


# --- the plain formulas, as the docstrings state them -------------------------------------------


def plain_clip(a, b, logit_scale, mask):
    s = jnp.exp(logit_scale) * a @ b.T
    rows = jax.nn.logsumexp(jnp.where(mask[None, :], s, -jnp.inf), axis=1) - jnp.diag(s)
    cols = jax.nn.logsumexp(jnp.where(mask[:, None], s, -jnp.inf), axis=0) - jnp.diag(s)
    return jnp.sum(jnp.where(mask, rows + cols, 0.0)) / (2 * jnp.sum(mask))


def plain_siglip(a, b, logit_scale, logit_bias, mask):
    x = jnp.exp(logit_scale) * a @ b.T + logit_bias
    z = 2 * jnp.eye(a.shape[0], dtype=x.dtype) - 1
    kept = mask[:, None] & mask[None, :]
    return jnp.sum(jnp.where(kept, -jax.nn.log_sigmoid(z * x), 0.0)) / jnp.sum(mask)


def against_reference(tiled, plain, args, mask, magnitude):
    """The tiled value and gradients (all float arguments) against the plain formula in
    float64. The bound: 4x the plain formula's own float32 error, plus 64 ulps of the larger
    of the leaf's largest value and ``magnitude``, the size of the terms it sums (a loss or
    gradient near 0 is a difference of terms of that size: 0 - 0 has no relative error)."""
    n = len(args)
    got = jax.jit(jax.value_and_grad(tiled, argnums=tuple(range(n))))(*args)
    plain32 = jax.jit(jax.value_and_grad(plain, argnums=tuple(range(n))))(*args, mask)
    with jax.enable_x64(True):
        args64 = jax.tree.map(lambda x: np.asarray(x, np.float64), args)
        ref = jax.value_and_grad(plain, argnums=tuple(range(n)))(*args64, mask)
        ref = jax.tree.map(np.asarray, ref)
    for g, p, r in zip(jax.tree.leaves(got), jax.tree.leaves(plain32), jax.tree.leaves(ref),
                       strict=True):
        g, p = np.asarray(g, np.float64), np.asarray(p, np.float64)
        bound = 4 * np.max(np.abs(p - r)) + 64 * EPS32 * max(np.max(np.abs(r)), magnitude)
        assert np.max(np.abs(g - r)) <= bound, (np.max(np.abs(g - r)), bound)


def magnitude(a, b, logit_scale, logit_bias=0.0):
    """The size of the logits (and of the gradients' terms): exp(scale) |a_i| |b_j| + |bias|,
    times the larger representation norm, plus 1."""
    na, nb = np.linalg.norm(a, axis=-1).max(), np.linalg.norm(b, axis=-1).max()
    return (1 + np.exp(logit_scale) * na * nb + abs(logit_bias)) * max(1.0, na, nb)


cases = st.fixed_dictionaries({
    "n": st.integers(1, 70), "d": st.integers(1, 6), "tile": st.integers(1, 80),
    "seed": st.integers(0, 2**16), "logit_scale": st.floats(-1.0, 2.5),
    "logit_bias": st.floats(-5.0, 2.0), "masked": st.booleans()})


def draw(case):
    rng = np.random.default_rng(case["seed"])
    a, b = rng.normal(size=(2, case["n"], case["d"])).astype(np.float32)
    mask = rng.uniform(size=case["n"]) > 0.3 if case["masked"] else np.ones(case["n"], bool)
    mask[rng.integers(case["n"])] = True  # at least one example kept
    return a, b, mask


@settings(max_examples=10, deadline=None)
@given(case=cases)
def test_clip_loss_is_the_plain_formula(case):
    a, b, mask = draw(case)
    s = np.float32(case["logit_scale"])
    against_reference(lambda a, b, s: clip_loss(a, b, s, tile=case["tile"], mask=mask),
                      plain_clip, (a, b, s), mask, magnitude(a, b, s))


@settings(max_examples=10, deadline=None)
@given(case=cases)
def test_siglip_loss_is_the_plain_formula(case):
    a, b, mask = draw(case)
    s, t = np.float32(case["logit_scale"]), np.float32(case["logit_bias"])
    against_reference(lambda a, b, s, t: siglip_loss(a, b, s, t, tile=case["tile"], mask=mask),
                      plain_siglip, (a, b, s, t), mask, magnitude(a, b, s, t))


@pytest.mark.parametrize("tile", [pytest.param(1024, marks=pytest.mark.slow), 1000])
def test_clip_loss_at_4096(tile):
    """B = 4096, a tile that divides it and one that does not, a quarter of the batch masked."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 4096, 16)).astype(np.float32) / 4
    mask = rng.uniform(size=4096) > 0.25
    s = np.float32(np.log(10.0))
    against_reference(lambda a, b, s: clip_loss(a, b, s, tile=tile, mask=mask), plain_clip,
                      (a, b, s), mask, magnitude(a, b, s))


def max_sim(p, x, y):  # ColBERT: each query token's best document token, summed over tokens
    return p * jnp.einsum("itd,jsd->ijts", x["tokens"], y).max(-1).sum(-1)


def test_pairwise_logsumexp_is_the_plain_logsumexp_of_a_score_of_your_own():
    """A pytree side, a score of token embeddings, a learnable factor; masked columns."""
    rng = np.random.default_rng(3)
    q = {"tokens": rng.normal(size=(37, 4, 6)).astype(np.float32)}
    d = rng.normal(size=(29, 5, 6)).astype(np.float32)
    mask = rng.uniform(size=29) > 0.3

    def tiled(p, q, d):
        return jnp.sum(jnp.sin(pairwise_logsumexp(max_sim, p, q, d, tile=8, mask=mask)))

    def plain(p, q, d, mask):
        scores = jnp.where(mask[None, :], max_sim(p, q, d), -jnp.inf)
        return jnp.sum(jnp.sin(jax.nn.logsumexp(scores, axis=1)))

    against_reference(tiled, plain, (np.float32(0.7), q, d), mask,
                      magnitude(q["tokens"].reshape(37, -1), d.reshape(29, -1), np.log(0.7)))


def test_pairwise_logsumexp_of_no_kept_column_is_minus_infinity_with_zero_gradient():
    a, b = jnp.ones((3, 2)), jnp.ones((4, 2))
    mask = np.zeros(4, bool)
    lse = pairwise_logsumexp(lambda p, x, y: x @ y.T, None, a, b, tile=2, mask=mask)
    assert np.all(np.isneginf(lse))
    grads = jax.grad(lambda a, b: jnp.sum(jnp.where(
        jnp.isfinite(lse), pairwise_logsumexp(lambda p, x, y: x @ y.T, None, a, b, tile=2,
                                              mask=mask), 0.0)), argnums=(0, 1))(a, b)
    assert all(np.all(np.asarray(g) == 0) for g in grads)


def test_pairwise_sum_sums_the_kept_pairs_and_marks_the_matching_ones():
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(11, 3)).astype(np.float32), rng.normal(size=(11, 3)).astype(np.float32)
    ma, mb = rng.uniform(size=11) > 0.3, rng.uniform(size=11) > 0.3

    def term(p, x, y, positive):
        return jnp.where(positive, p * 10.0, 1.0) * jnp.tanh(x @ y.T)

    def tiled(p, a, b):
        return pairwise_sum(term, p, a, b, tile=4, mask_a=ma, mask_b=mb)

    def plain(p, a, b, mask):
        values = jnp.where(jnp.eye(11, dtype=bool), p * 10.0, 1.0) * jnp.tanh(a @ b.T)
        return jnp.sum(jnp.where(ma[:, None] & mb[None, :], values, 0.0))

    against_reference(tiled, plain, (np.float32(0.3), a, b), None, magnitude(a, b, np.log(3.0)))


# --- memory: no buffer of two batch-sized dimensions ------------------------------------------


def big_buffers(hlo: str, n: int) -> list[str]:
    """The shapes in an HLO text with at least two dimensions of size >= n."""
    found = []
    for dims in re.findall(r"\[([0-9,]+)\]", hlo):
        sizes = [int(x) for x in dims.split(",") if x]
        if sum(s >= n for s in sizes) >= 2:
            found.append(dims)
    return found


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_the_compiled_loss_and_gradient_hold_no_batch_by_batch_buffer(name):
    """B = 4096: no buffer with two dimensions >= B in the forward or backward pass of the tiled
    loss; the plain formula's program has one (the check can fail)."""
    n = 4096
    a = jax.ShapeDtypeStruct((n, 16), jnp.float32)
    s = jax.ShapeDtypeStruct((), jnp.float32)
    if name == "clip":
        def tiled(a, b, s):
            return clip_loss(a, b, s, tile=512)

        def plain(a, b, s):
            return plain_clip(a, b, s, jnp.ones(n, bool))
    else:
        def tiled(a, b, s):
            return siglip_loss(a, b, s, -10.0, tile=512)

        def plain(a, b, s):
            return plain_siglip(a, b, s, -10.0, jnp.ones(n, bool))
    hlo = jax.jit(jax.value_and_grad(tiled, argnums=(0, 1, 2))).lower(a, a, s).compile()
    assert big_buffers(hlo.as_text(), n) == []
    temp = hlo.memory_analysis().temp_size_in_bytes
    assert temp < 16 * 2**20, temp  # the representations, their cotangents, a few tiles
    untiled = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2))).lower(a, a, s).compile()
    assert big_buffers(untiled.as_text(), n)


# --- in the coupled path -----------------------------------------------------------------------


def test_coupled_train_step_with_the_tiled_loss_is_the_full_batch_step():
    """Three Adam steps of a two-tower model with a learnable scale: the coupled step with the
    tiled loss (k = 4, tiles that do not divide the batch) equals full-batch steps of the plain
    loss."""
    rng = np.random.default_rng(5)
    params = {"a": jnp.asarray(rng.normal(size=(6, 8)) / 3, jnp.float32),
              "b": jnp.asarray(rng.normal(size=(5, 8)) / 3, jnp.float32),
              "logit_scale": jnp.float32(np.log(5.0))}
    batch = (rng.normal(size=(96, 6)).astype(np.float32),
             rng.normal(size=(96, 5)).astype(np.float32))

    def encode(p, batch):
        za, zb = jnp.tanh(batch[0] @ p["a"]), jnp.tanh(batch[1] @ p["b"])
        return za / jnp.linalg.norm(za, axis=1, keepdims=True), zb / jnp.linalg.norm(
            zb, axis=1, keepdims=True)

    def tiled(p, reps, batch):
        return clip_loss(*reps, p["logit_scale"], tile=40)

    def full(p, batch):
        return plain_clip(*encode(p, batch), p["logit_scale"], jnp.ones(96, bool))

    optimizer = optax.adam(1e-2)
    step = jaxaccum.coupled_train_step(encode, tiled, optimizer, num_microbatches=4,
                                       donate=False)
    ref_step = jax.jit(lambda p, o, b: (lambda lg: (
        optax.apply_updates(p, optimizer.update(lg[1], o, p)[0]),
        optimizer.update(lg[1], o, p)[1], lg[0]))(jax.value_and_grad(full)(p, b)))
    p1, o1 = params, optimizer.init(params)
    p2, o2 = params, optimizer.init(params)
    for _ in range(3):
        p1, o1, loss1, _ = step(p1, o1, batch)
        p2, o2, loss2 = ref_step(p2, o2, batch)
        assert abs(float(loss1) - float(loss2)) <= 1e-5 * abs(float(loss2))
    for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)


def test_bad_input_names_the_function_and_the_fix():
    a = jnp.ones((4, 3))
    with pytest.raises(ValueError, match=r"clip_loss: a and b must be \(batch, dim\) arrays of "
                                         r"one shape"):
        clip_loss(a, jnp.ones((5, 3)), 0.0)
    with pytest.raises(ValueError, match=r"siglip_loss: mask must be a boolean array of shape "
                                         r"\(4,\)"):
        siglip_loss(a, a, 0.0, 0.0, mask=jnp.ones(4))
    with pytest.raises(ValueError, match=r"clip_loss: tile must be an int >= 1"):
        clip_loss(a, a, 0.0, tile=0)
    with pytest.raises(ValueError, match=r"pairwise_sum: a must be an array .* one size for "
                                         r"every leaf"):
        pairwise_sum(lambda p, x, y, pos: x @ y.T, None, {"x": a, "y": jnp.ones((3, 3))}, a)
    with pytest.raises(ValueError, match=r"clip_loss: logit_scale must be a scalar .* got shape "
                                         r"\(3,\); pass a 0-d array"):
        clip_loss(a, a, jnp.zeros(3))
    with pytest.raises(ValueError, match=r"siglip_loss: logit_bias must be a scalar"):
        siglip_loss(a, a, 0.0, jnp.zeros((1,)))
    with pytest.raises(ValueError, match=r"pairwise_logsumexp: score must return one value per "
                                         r"pair of a tile, shape .* = \(2, 2\) .* got \(2, 2, 3\)"):
        pairwise_logsumexp(lambda p, x, y: x[:, None, :] * y[None, :, :], None, a, a, tile=2)
    with pytest.raises(ValueError, match=r"pairwise_sum: term must return one value per pair "
                                         r"of a tile, shape .* = \(4, 4\) .* got \(\)"):
        pairwise_sum(lambda p, x, y, pos: jnp.sum(x @ y.T), None, a, a)
