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
from conftest import examples
from contrastive_strategies import block_cases, normal, pair_cases
from hypothesis import given, settings

import jaxaccum
from jaxaccum.contrastive import clip_loss, pairwise_logsumexp, pairwise_sum, siglip_loss

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


EPS32 = float(np.finfo(np.float32).eps)
# bfloat16's unit roundoff: round-to-nearest to its 8 significant bits moves x by <= U16 |x|
U16 = 2.0**-8


def _leaves(tree):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def _f32_error(plain32, ref, magnitude):
    """Per leaf, the float32 error allowed: 4x the plain formula's own float32 error, plus 64
    ulps of the larger of the leaf's largest value and ``magnitude``, the size of the terms it
    sums (a loss or gradient near 0 is a difference of terms of that size: 0 - 0 has no
    relative error)."""
    return [4 * np.max(np.abs(p - r)) + 64 * EPS32 * max(np.max(np.abs(r)), magnitude)
            for p, r in zip(_leaves(plain32), _leaves(ref), strict=True)]


def _grads_and_reference(tiled, plain, args, mask):
    n = len(args)
    got = jax.jit(jax.value_and_grad(tiled, argnums=tuple(range(n))))(*args)
    # the value is a float32 scalar, each gradient in its argument's dtype (bf16 for bf16)
    assert got[0].dtype == jnp.float32 and got[0].shape == (), got[0]
    for g, x in zip(jax.tree.leaves(got[1]), jax.tree.leaves(args), strict=True):
        assert g.dtype == jnp.result_type(x) and g.shape == jnp.shape(x), (g.dtype, x.dtype)
    args32 = jax.tree.map(lambda x: np.asarray(x, np.float32), args)  # exact from bf16
    plain32 = jax.jit(jax.value_and_grad(plain, argnums=tuple(range(n))))(*args32, mask)
    with jax.enable_x64(True):
        args64 = jax.tree.map(lambda x: np.asarray(x, np.float64), args)
        # jitted: op by op, a float64 value_and_grad dispatches for tens of seconds
        ref = jax.jit(jax.value_and_grad(plain, argnums=tuple(range(n))))(*args64, mask)
        ref = jax.tree.map(np.asarray, ref)
    return got, plain32, ref


def against_reference(tiled, plain, args, mask, magnitude):
    """The tiled value and gradients (all float arguments) against the plain formula in
    float64, within float32 error (:func:`_f32_error`); the dtypes asserted."""
    got, plain32, ref = _grads_and_reference(tiled, plain, args, mask)
    for g, r, e32 in zip(_leaves(got), _leaves(ref), _f32_error(plain32, ref, magnitude),
                         strict=True):
        assert np.max(np.abs(g - r)) <= e32, (np.max(np.abs(g - r)), e32)


def against_reference_bf16(tiled, plain, args, mask, magnitude):
    """bfloat16 arguments: the tiled value and gradients against the plain formula in float64
    (of the same bf16 values, exactly), the dtypes asserted (the value float32, gradients
    bf16).

    The bound. Plain JAX on the full batch in bf16 rounds every score, exponential and partial
    sum to bf16 (excess precision is off): its error E_plain (largest over the leaf). The tiled
    losses take the scores from bf16 operands into float32 (preferred_element_type) and keep
    every sum over tiles in float32; what they round to bf16 is each tile's cotangent of a bf16
    input (JAX's pullback of a bf16 operand is bf16), as plain JAX rounds its one cotangent,
    and the returned gradient (by <= U16 of itself). So:
    - the float32 value: within float32 error e32 of the reference (:func:`_f32_error` of the
      plain formula run in float32 on the same bf16 values), far below E_plain;
    - each gradient leaf: <= c E_plain + U16 max|r| + e32 with c = 1, no worse than the plain
      bf16 computation, which rounds as often and more, up to the tiled result's own final
      rounding (a sup-norm E_plain may fall on an element that happened to round well, so it
      bounds no other element's rounding: c alone cannot cover it).
    A score rounded to bf16 (no preferred_element_type) moves the value by ~U16 |score|, far
    outside e32; a cotangent accumulated in bf16 over >= 5 tiles rounds every running sum, one
    rounding per tile where plain JAX's dot rounds once: outside the gradients' bound."""
    got, plain32, ref = _grads_and_reference(tiled, plain, args, mask)
    n = len(args)
    plain16 = jax.jit(jax.value_and_grad(plain, argnums=tuple(range(n))))(*args, mask)
    for i, (g, r, p16, e32) in enumerate(zip(_leaves(got), _leaves(ref), _leaves(plain16),
                                             _f32_error(plain32, ref, magnitude), strict=True)):
        err, e_plain = np.max(np.abs(g - r)), np.max(np.abs(p16 - r))
        bound = e32 if i == 0 else 1 * e_plain + U16 * np.max(np.abs(r)) + e32
        assert err <= bound, (i, err, bound, e_plain, e32)


def magnitude(a, b, logit_scale, logit_bias=0.0):
    """The size of the logits (and of the gradients' terms): exp(scale) |a_i| |b_j| + |bias|,
    times the larger representation norm, plus 1."""
    na, nb = np.linalg.norm(a, axis=-1).max(), np.linalg.norm(b, axis=-1).max()
    return (1 + np.exp(logit_scale) * na * nb + abs(logit_bias)) * max(1.0, na, nb)


def pair_args(case):
    return case["a"], case["b"], case["logit_scale"], case["logit_bias"]


def tiled_clip(case):
    return lambda a, b, s: clip_loss(a, b, s, tile=case["tile"], mask=case["mask"])


def tiled_siglip(case):
    return lambda a, b, s, t: siglip_loss(a, b, s, t, tile=case["tile"], mask=case["mask"])


@settings(max_examples=examples(10), deadline=None)
@given(case=pair_cases())
def test_clip_loss_is_the_plain_formula(case):
    a, b, s, _ = pair_args(case)
    against_reference(tiled_clip(case), plain_clip, (a, b, s), case["mask"], magnitude(a, b, s))


@settings(max_examples=examples(10), deadline=None)
@given(case=pair_cases())
def test_siglip_loss_is_the_plain_formula(case):
    a, b, s, t = pair_args(case)
    against_reference(tiled_siglip(case), plain_siglip, (a, b, s, t), case["mask"],
                      magnitude(a, b, s, t))


# --- the building blocks: pytree sides, unequal lengths, float params --------------------------


def block_score(p, x, y):
    """A score of pytree sides and params: exp(t) u_i . y_j + c v_i . w_j, the dot products in
    the operands' dtype (plain JAX: bf16 for bf16 operands)."""
    return jnp.exp(p["t"]) * (x["u"] @ y[0].T) + p["c"] * (x["v"] @ y[1].T)


def block_score_f32(p, x, y):
    """:func:`block_score` with float32 dot products of any operands, as a score passed to the
    building blocks should be (the blocks sum in float32, the score is the caller's)."""
    def dot(u, v):
        return jnp.einsum("id,jd->ij", u, v, preferred_element_type=jnp.float32)
    return jnp.exp(p["t"]) * dot(x["u"], y[0]) + p["c"] * dot(x["v"], y[1])


def block_term(score):
    def term(p, x, y, positive):  # positive: the matching pairs (i == j), scored once more
        s = score(p, x, y)
        return jnp.tanh(s) + jnp.where(positive, s, 0.0)
    return term


def plain_lse_loss(p, a, b, mask):
    """sum_i sin(logsumexp_j over the kept b_j): a nonlinear use of every row (each row's
    cotangent differs)."""
    s = jnp.where(mask[None, :], block_score(p, a, b), -jnp.inf)
    return jnp.sum(jnp.sin(jax.nn.logsumexp(s, axis=1)))


def plain_block_sum(p, a, b, masks):
    s = block_score(p, a, b)
    positive = jnp.eye(s.shape[0], s.shape[1], dtype=bool)  # one device: global indices
    kept = masks[0][:, None] & masks[1][None, :]
    return jnp.sum(jnp.where(kept, jnp.tanh(s) + jnp.where(positive, s, 0.0), 0.0))


def tiled_lse_loss(case):
    def loss(p, a, b):
        lse = pairwise_logsumexp(block_score_f32, p, a, b, tile=case["tile"],
                                 mask=case["mask_b"])
        return jnp.sum(jnp.sin(lse))
    return loss


def tiled_block_sum(case):
    return lambda p, a, b: pairwise_sum(block_term(block_score_f32), p, a, b, tile=case["tile"],
                                        mask_a=case["mask_a"], mask_b=case["mask_b"])


def block_magnitude(case):
    """The size of the scores (and of the gradients' terms), as :func:`magnitude`: the largest
    |score| from the norms, plus 1, times the largest row norm."""
    (u, v), (y, w), p = (case["a"]["u"], case["a"]["v"]), case["b"], case["params"]
    norm = lambda x: float(np.linalg.norm(np.asarray(x, np.float64), axis=-1).max())  # noqa: E731
    largest = np.exp(float(p["t"])) * norm(u) * norm(y) + abs(float(p["c"])) * norm(v) * norm(w)
    return (1 + largest) * max(1.0, norm(u), norm(v), norm(y), norm(w))


def block_args(case):
    return case["params"], case["a"], case["b"]


@settings(max_examples=examples(3), deadline=None)
@given(case=block_cases())
def test_pairwise_logsumexp_is_the_plain_logsumexp(case):
    """Pytree sides of unequal lengths, pytree float params, every mask layout of b; the rows
    are (n_a,) float32."""
    lse = pairwise_logsumexp(block_score_f32, *block_args(case), tile=case["tile"],
                             mask=case["mask_b"])
    assert lse.dtype == jnp.float32 and lse.shape == (case["a"]["u"].shape[0],), lse
    against_reference(tiled_lse_loss(case), plain_lse_loss, block_args(case), case["mask_b"],
                      block_magnitude(case))


@settings(max_examples=examples(3), deadline=None)
@given(case=block_cases())
def test_pairwise_sum_is_the_plain_sum_over_the_kept_pairs(case):
    """As above, both sides masked; the matching pairs (i == j) marked as on one device."""
    against_reference(tiled_block_sum(case), plain_block_sum, block_args(case),
                      (case["mask_a"], case["mask_b"]), block_magnitude(case))


# every layout of the two sides, each run, whatever the draws above hit: both sides shorter
# than the tile and unequal (the tile is cut to each side separately), a tile between the
# sides, a tile dividing neither; padding in the first tile of one side, the last of the other
SIDES = [(3, 7, 10), (7, 3, 10), (5, 12, 8), (12, 5, 8), (13, 9, 4)]


def fixed_block_case(n_a, n_b, tile, seed=11):
    mask_a, mask_b = np.ones(n_a, bool), np.ones(n_b, bool)
    mask_a[:min(tile, n_a) - 1] = False  # all but one example of a's first tile
    mask_b[(-(-n_b // min(tile, n_b)) - 1) * min(tile, n_b):] = False  # b's last tile
    mask_b[0] = True
    return {"a": {"u": normal(seed, n_a, 3), "v": normal(seed + 1, n_a, 2)},
            "b": (normal(seed + 2, n_b, 3), normal(seed + 3, n_b, 2, scale=0.5)),
            "params": {"t": np.float32(0.3), "c": np.float32(-0.4)}, "tile": tile,
            "mask_a": mask_a, "mask_b": mask_b}


@pytest.mark.parametrize("n_a, n_b, tile", SIDES)
def test_the_building_blocks_for_every_layout_of_the_sides(n_a, n_b, tile):
    """pairwise_sum (whose term marks the matching pairs, i == j) and pairwise_logsumexp on
    unequal sides against the float64 plain formulas."""
    case = fixed_block_case(n_a, n_b, tile)
    against_reference(tiled_block_sum(case), plain_block_sum, block_args(case),
                      (case["mask_a"], case["mask_b"]), block_magnitude(case))
    against_reference(tiled_lse_loss(case), plain_lse_loss, block_args(case), case["mask_b"],
                      block_magnitude(case))


@pytest.mark.parametrize("n_a, n_b", [(4, 0), (0, 5), (0, 0)])
def test_an_empty_side_gives_the_empty_sums_value(n_a, n_b):
    """A side with no example (no negatives at all): every row's log-sum-exp is log 0 =
    -inf, as jax.nn.logsumexp over an empty axis, the sum over no pair is 0, and neither
    depends on the params or the other side (zero gradients), whatever the tile."""
    case = fixed_block_case(max(n_a, 1), max(n_b, 1), 3)
    p, a, b = block_args(case)
    a = jax.tree.map(lambda x: x[:n_a], a)
    b = jax.tree.map(lambda x: x[:n_b], b)
    mask_a, mask_b = np.ones(n_a, bool), np.ones(n_b, bool)
    lse = pairwise_logsumexp(block_score_f32, p, a, b, tile=3, mask=mask_b)
    plain = jax.nn.logsumexp(block_score(p, a, b), axis=1)
    assert lse.dtype == jnp.float32 and lse.shape == (n_a,), lse
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(plain))
    total = pairwise_sum(block_term(block_score_f32), p, a, b, tile=3, mask_a=mask_a,
                         mask_b=mask_b)
    assert total.dtype == jnp.float32 and float(total) == 0.0, total
    def both(p, a):
        lse = pairwise_logsumexp(block_score_f32, p, a, b, tile=3)
        return (pairwise_sum(block_term(block_score_f32), p, a, b, tile=3)
                + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)))

    grads = jax.grad(both, argnums=(0, 1))(p, a)
    assert all(float(jnp.max(jnp.abs(g), initial=0.0)) == 0.0 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("tile", [2, 8])
def test_rows_and_columns_of_very_different_scales(tile):
    """Each row's and each column's log-sum-exp shifted by its own maximum: a row whose
    scores all lie ~200 below another row's (and a column likewise) still gets its own value,
    not log(0) of underflowed terms."""
    a = np.array([[15.0, 0.0], [-15.0, 0.0], [0.5, 0.1], [0.2, -0.4], [14.0, 0.3]], np.float32)
    b = np.array([[15.0, 0.2], [0.3, 0.5], [-14.0, 0.1], [0.1, -0.2], [0.4, 0.3]], np.float32)
    s, mask = np.float32(0.0), np.ones(5, bool)
    against_reference(lambda a, b, s: clip_loss(a, b, s, tile=tile), plain_clip, (a, b, s),
                      mask, magnitude(a, b, s))
    lse = pairwise_logsumexp(lambda p, x, y: x @ y.T, None, a, b, tile=tile)
    ref = jax.nn.logsumexp(np.asarray(a, np.float64) @ np.asarray(b, np.float64).T, axis=1)
    # float32: the scores' rounding (a few ulps of the largest |score|) and the log's
    np.testing.assert_allclose(np.asarray(lse), ref, rtol=0,
                               atol=8 * EPS32 * float(np.max(np.abs(a @ b.T))))


# --- bfloat16 representations and params ---------------------------------------------------


def bf16(tree):
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), tree)


@settings(max_examples=examples(2), deadline=None)
@given(case=pair_cases(many_tiles=True))
def test_bf16_clip_loss_sums_in_float32(case):
    """bf16 representations (the scale stays a float32 scalar: clip_loss casts it)."""
    a, b, s, _ = pair_args(case)
    against_reference_bf16(tiled_clip(case), plain_clip, (*bf16((a, b)), s), case["mask"],
                           magnitude(a, b, s))


@settings(max_examples=examples(2), deadline=None)
@given(case=pair_cases(many_tiles=True))
def test_bf16_siglip_loss_sums_in_float32(case):
    a, b, s, t = pair_args(case)
    against_reference_bf16(tiled_siglip(case), plain_siglip, (*bf16((a, b)), s, t),
                           case["mask"], magnitude(a, b, s, t))


@settings(max_examples=examples(2), deadline=None)
@given(case=block_cases(many_tiles=True))
def test_bf16_pairwise_logsumexp_sums_in_float32(case):
    """bf16 sides and bf16 params (a pytree param may be any float dtype; its gradient comes
    back bf16)."""
    against_reference_bf16(tiled_lse_loss(case), plain_lse_loss, bf16(block_args(case)),
                           case["mask_b"], block_magnitude(case))


@settings(max_examples=examples(2), deadline=None)
@given(case=block_cases(many_tiles=True))
def test_bf16_pairwise_sum_sums_in_float32(case):
    against_reference_bf16(tiled_block_sum(case), plain_block_sum, bf16(block_args(case)),
                           (case["mask_a"], case["mask_b"]), block_magnitude(case))


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
                                         r"one shape.* got \(4, 3\) and \(5, 3\)"):
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
