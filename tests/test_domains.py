"""Each validator accepts exactly the inputs its documentation allows.

A documented refusal ("Raises: ValueError: n / m > K") is half a promise; the other half is
that everything else is taken, and gives the documented result. Each test here draws inputs
on both sides of a documented boundary and asserts ``accepts(...) == documented`` (conftest's
``accepts``: a jaxaccum refusal is False, a crash propagates), and for the accepted ones the
result: the reference model's (``tests/reference.py``) or the docstring's.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import accepts, examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType
from reference import FRONT_ENDS, STEPS, Scenario, check, run, verify

import jaxaccum
import jaxaccum.nnx
from jaxaccum import packing

D = 3


def slow(count: int) -> settings:
    """Hypothesis settings for examples that compile: no deadline, no too-slow check."""
    return settings(max_examples=examples(count), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def scenario(k: int, size: int, seed: int = 0, **kw: Any) -> Scenario:
    rng = np.random.default_rng(seed)
    b = k * size
    return Scenario(x=rng.normal(size=(b, D)).astype(np.float32),
                    y=rng.normal(size=(b,)).astype(np.float32),
                    m=np.ones(b, np.float32), w=(rng.normal(size=(D,)) / 2).astype(np.float32),
                    k=k, **kw)


# --- counts and stacks --------------------------------------------------------------------------


@slow(60)
@given(n=st.integers(0, 24), m=st.integers(-1, 7), k=st.integers(1, 8),
       other=st.sampled_from([0, 0, 1, -1, "scalar"]))
def test_microbatches_takes_exactly_a_divisor_whose_count_fits(n, m, k, other):
    """``microbatches``: the leaves share a leading axis ``n``, ``m`` divides it and
    ``n / m <= K``; then ``data`` leaves are ``(K, m, ...)`` holding the batch in order and
    ``count = n / m`` (int32)."""
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    y = np.arange(max(n + other, 0), dtype=np.int32) if other != "scalar" else np.int32(1)
    documented = np.ndim(y) == 1 and len(y) == n and m >= 1 and n % m == 0 and n // m <= k
    got: list[Any] = []
    assert accepts(lambda: got.append(jaxaccum.microbatches(
        (x, y), microbatch_size=m, max_microbatches=k))) == documented, (n, m, k, other)
    if documented:
        (sx, sy), count = got[0]
        assert np.shape(count) == () and np.asarray(count).dtype == np.int32
        assert int(count) == n // m
        assert sx.shape == (k, m, 3) and sy.shape == (k, m)
        np.testing.assert_array_equal(sx[:n // m].reshape(n, 3), x)
        np.testing.assert_array_equal(sy[:n // m].reshape(n), y)


@slow(24)
@given(k=st.integers(1, 4), count=st.integers(-2, 6), front=st.sampled_from(STEPS))
def test_a_step_takes_a_concrete_runtime_count_exactly_from_0_to_K(k, count, front):
    """A concrete ``Microbatches.count`` outside ``0..K`` is refused by every step; inside,
    the step gives the reference model's result (count 0: no update)."""
    s = scenario(k, 2, count=count)
    valid = 0 <= count <= k
    assert accepts(lambda: check(front, s) if valid else run(front, s)) == valid, (k, count)


@slow(12)
@given(k=st.sampled_from([1, 2, 5, 257, 300]), m=st.integers(1, 2),
       wrong=st.sampled_from([None, None, "x lead +1", "y lead -1", "y 1-D", "m differs"]))
def test_a_stack_is_taken_exactly_when_every_leaf_is_K_by_m(k, m, wrong):
    """With ``max_microbatches=K`` every leaf of ``Microbatches.data`` is ``(K, m, ...)``, one
    ``m`` for all (large K too); then the result is the reference model's."""
    s = scenario(k, m, count=k)
    if wrong is None:
        assert accepts(lambda: check("value_and_grad", s)), k
        return
    x, y, w8 = s.batch().data
    if wrong == "x lead +1":
        x = np.concatenate([x, x[:1]])
    elif wrong == "y lead -1":
        y = y[:-1] if k > 1 else y[:, :0]
    elif wrong == "y 1-D":
        y = y[:, 0]
    else:
        y = np.concatenate([y, y], axis=1)
    fn = jax.jit(jaxaccum.value_and_grad(lambda w, b: jnp.mean(b[0] @ w - b[1]),
                                         max_microbatches=k))
    bad = jaxaccum.Microbatches((x, y, w8), np.int32(k))
    assert not accepts(lambda: fn(jnp.asarray(s.w), bad)), (k, m, wrong)


# --- meshes -------------------------------------------------------------------------------------


def one_device_mesh(names: tuple[str, ...], kind: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh((1,) * len(names), names, axis_types=(kind,) * len(names))


@slow(16)
@given(names=st.sampled_from([("data",), ("batch",), ("data", "model"), ("a", "b", "c")]),
       kind=st.sampled_from([AxisType.Auto, AxisType.Explicit]),
       front=st.sampled_from(FRONT_ENDS))
def test_a_plain_mesh_is_taken_exactly_with_one_axis(names, kind, front):
    """``mesh=`` a ``jax.sharding.Mesh`` names its data axis only when it has one axis (else
    ``DataParallel`` names them); taken, every front end gives the reference result."""
    mesh = one_device_mesh(names, kind)
    s = scenario(2, 2)
    valid = len(names) == 1
    assert accepts(lambda: check(front, s, mesh=mesh)) == valid, (names, kind, front)


@pytest.mark.parametrize(("front", "context"), [
    *[("value_and_grad", c) for c in ("none", "same", "another")],
    *[(step, c) for step in STEPS for c in ("none", "same")]])
def test_an_explicit_mesh_needs_that_mesh_in_context_unless_a_step_sets_it(front, context):
    """Explicit axes need their mesh in context (the README): ``value_and_grad`` refuses to
    run without it or under another mesh; every step sets it itself and gives the reference
    result."""
    mesh = one_device_mesh(("data",), AxisType.Explicit)
    around = {"none": None, "same": mesh,
              "another": one_device_mesh(("other",), AxisType.Explicit)}[context]
    s = scenario(2, 2)

    def call() -> None:
        with contextlib.nullcontext() if around is None else jax.set_mesh(around):
            got = run(front, s, mesh)
        verify(front, s, got)

    valid = front in STEPS or context == "same"
    assert accepts(call) == valid, (front, context)


# --- aux and check ------------------------------------------------------------------------------


@slow(16)
@given(k=st.integers(1, 3), m=st.integers(1, 3), delta=st.sampled_from([0, 0, -1, 1, "scalar"]),
       width=st.integers(0, 2))
def test_concat_aux_is_taken_exactly_with_the_microbatch_leading_axis(k, m, delta, width):
    """``has_aux="concat"`` needs each leaf's leading axis to be the micro-batch size ``m``
    (per example); then the leaf comes back whole, in batch order."""
    x = np.arange(k * m * D, dtype=np.float32).reshape(k * m, D) / 7

    def loss(w, xs):
        per = xs[:, 0] * 2 + w[0]
        if width:
            per = jnp.stack([per] * width, axis=1)
        if delta == "scalar":
            leaf = per.sum()
        elif delta == 1:
            leaf = jnp.concatenate([per, per[:1]])
        elif delta == -1:
            leaf = per[:-1]
        else:
            leaf = per
        return jnp.mean(xs @ w), leaf

    fn = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k, has_aux="concat"))
    w = jnp.zeros(D)
    got: list[Any] = []
    valid = delta == 0 and not (m == 1 and delta == -1)
    assert accepts(lambda: got.append(fn(w, x))) == valid, (k, m, delta, width)
    if valid:
        (_, aux), _ = got[0]
        want = x[:, 0].astype(np.float64) * 2
        if width:
            want = np.stack([want] * width, axis=1)
        np.testing.assert_array_equal(np.asarray(aux), want.astype(np.float32))


@pytest.mark.parametrize("counts", [{}, {"num_microbatches": 4}, {"microbatch_size": 2},
                                    {"num_microbatches": 4, "microbatch_size": 2}])
@pytest.mark.parametrize("with_step", [True, False])
def test_check_takes_one_count_and_with_a_step_none(with_step, counts):
    """``check``: the options need exactly one count, or none at all when ``step`` is given
    (the step splits the batch itself); taken, a correct step passes."""

    def loss(w, x):
        return jnp.mean((x @ w - 1.0) ** 2)

    w, x = jnp.ones(3) / 2, jnp.arange(24.0).reshape(8, 3) / 10
    step = jaxaccum.value_and_grad(loss, num_microbatches=4) if with_step else None
    reports: list[Any] = []
    valid = len(counts) == 1 or (with_step and not counts)
    assert accepts(lambda: reports.append(jaxaccum.check(loss, w, x, step=step, **counts))) \
        == valid, (with_step, counts)
    if valid:
        assert reports[0].ok, reports[0].problems


# --- packing ------------------------------------------------------------------------------------

FIELDS = ("tokens", "segment_ids", "positions", "sequence_index")


@settings(max_examples=examples(40), deadline=None)
@given(names=st.lists(st.sampled_from([*FIELDS, "num_microbatches", "fill", "token", ""]),
                      max_size=4))
def test_packed_microbatches_takes_exactly_the_array_fields(names):
    """``Packed.microbatches(*fields)``: any of its array fields, in the order named (none:
    tokens, segment_ids, positions); the count is ``num_microbatches`` as int32."""
    packed = packing.pack([np.arange(1, 4), np.arange(1, 6), np.arange(2, 4)], rows=1,
                          length=5, max_microbatches=4)
    got: list[Any] = []
    valid = all(n in FIELDS for n in names)
    assert accepts(lambda: got.append(packed.microbatches(*names))) == valid, names
    if valid:
        mb = got[0]
        wanted = names or ["tokens", "segment_ids", "positions"]
        assert len(mb.data) == len(wanted)
        for array, name in zip(mb.data, wanted, strict=True):
            np.testing.assert_array_equal(array, getattr(packed, name))
        assert np.asarray(mb.count).dtype == np.int32
        assert int(mb.count) == packed.num_microbatches


SEQS = [np.arange(1, 1 + n) + 10 * i for i, n in enumerate([3, 4, 2, 5, 1, 3, 2, 4])]


@st.composite
def stream_states(draw: st.DrawFn) -> tuple[int, int, list[int]]:
    """(arrived, lookahead, waiting indices): half of them states a stream could have saved
    (the accepted side, its edges 0 and arrived - 1 included), half anything nearby."""
    arrived, lookahead = draw(st.integers(0, 6)), draw(st.integers(1, 3))
    if arrived and draw(st.booleans()):
        waiting = draw(st.lists(st.integers(0, arrived - 1), unique=True, max_size=lookahead))
    else:
        waiting = draw(st.lists(st.integers(-1, 7), max_size=4))
    return arrived, lookahead, waiting


@settings(max_examples=examples(60), deadline=None)
@given(stream_states())
def test_a_stream_state_is_taken_exactly_when_it_is_one_and_resumes_exactly(drawn):
    """``pack_stream(state=...)``: a state holds at most ``lookahead`` waiting sequences,
    distinct, each with an index below ``arrived``; resumed on the stream from ``arrived``
    on, it packs each waiting sequence and each later one exactly once, whole."""
    arrived, lookahead, waiting = drawn
    state = {"arrived": arrived,
             "waiting": [[i, SEQS[i].tolist() if 0 <= i < len(SEQS) else [1]] for i in waiting]}
    state = json.loads(json.dumps(state))
    valid = (len(waiting) <= lookahead and len(set(waiting)) == len(waiting)
             and all(0 <= i < arrived for i in waiting))
    steps: list[Any] = []

    def resume() -> None:
        stream = packing.pack_stream(iter(SEQS[arrived:]), rows=1, length=5,
                                     max_microbatches=2, lookahead=lookahead, state=state)
        steps.extend(stream)

    assert accepts(resume) == valid, (arrived, lookahead, waiting)
    if valid:
        seen: dict[int, list[int]] = {}
        for p in steps:
            real = p.segment_ids > 0
            for i in np.unique(p.sequence_index[real]).tolist():
                at = real & (p.sequence_index == i)
                assert i not in seen, f"sequence {i} packed twice"
                order = np.argsort(p.positions[at], kind="stable")
                seen[i] = p.tokens[at][order].tolist()
        assert sorted(seen) == sorted([*waiting, *range(arrived, len(SEQS))])
        for i, tokens in seen.items():
            assert tokens == SEQS[i].tolist(), i


@settings(max_examples=examples(40), deadline=None)
@given(shape=st.lists(st.integers(1, 4), max_size=3), other=st.sampled_from([None, None, 1, 0]),
       which=st.sampled_from(["token_mean", "sequence_mean"]))
def test_packed_losses_take_exactly_one_shape_with_a_length_axis(shape, other, which):
    """``token_mean``/``sequence_mean``: the loss and the segment ids share one shape
    ``(..., length)``; then the mean is over the real tokens (or the sequences' means), with
    their count."""
    rng = np.random.default_rng(len(shape))
    ids = min(3, shape[-1] + 1) if shape else 3  # ids in 0..length (the Args)
    seg = rng.integers(0, ids, size=shape).astype(np.int32)
    seg_shape = (list(shape) if other is None else
                 [*shape[:-1], shape[-1] + 1] if shape and other == 1 else [*shape, 2])
    seg_given = rng.integers(0, 3, size=seg_shape).astype(np.int32) if other is not None else seg
    loss = rng.normal(size=shape).astype(np.float32)
    valid = other is None and len(shape) >= 1
    got: list[Any] = []
    fn = getattr(packing, which)
    assert accepts(lambda: got.append(fn(loss, seg_given))) == valid, (shape, seg_shape)
    if valid:
        value, count = got[0]
        lengths = shape[-1]
        rows_l = loss.reshape(-1, lengths).astype(np.float64)
        rows_s = seg.reshape(-1, lengths)
        if which == "token_mean":
            real = rows_s > 0
            want_count = int(real.sum())
            want = rows_l[real].sum() / max(want_count, 1) if want_count else 0.0
        else:
            means = [rows_l[r][rows_s[r] == s].mean() for r in range(len(rows_s))
                     for s in np.unique(rows_s[r]) if s > 0]
            want_count = len(means)
            want = float(np.mean(means)) if means else 0.0
        assert int(count) == want_count
        # float32 sums of at most n = loss.size terms, then a division: token_mean is off by
        # at most (n + 1) eps max|l|; sequence_mean averages such means, twice that
        eps, n = float(np.finfo(np.float32).eps), loss.size
        bound = (2 * n + 2) * eps * float(np.abs(rows_l).max())
        assert abs(float(value) - want) <= bound, (float(value), want)  # (0 with none)


@settings(max_examples=examples(30), deadline=None)
@given(shape=st.lists(st.integers(1, 5), max_size=3))
def test_attention_mask_takes_exactly_ids_with_a_length_axis(shape):
    """``attention_mask``: ids of shape ``(..., length)``; token ``i`` sees token ``j`` when
    ``j <= i`` and both are in the same (real) segment."""
    seg = np.random.default_rng(len(shape)).integers(0, 3, size=shape).astype(np.int32)
    got: list[Any] = []
    assert accepts(lambda: got.append(packing.attention_mask(seg))) == (len(shape) >= 1), shape
    if shape:
        i, j = np.arange(shape[-1])[:, None], np.arange(shape[-1])[None, :]
        want = ((seg[..., :, None] == seg[..., None, :]) & (seg[..., :, None] > 0)
                & (j <= i))
        np.testing.assert_array_equal(np.asarray(got[0]), want)



@pytest.mark.parametrize("front", ["nnx.value_and_grad", "nnx.train_step"])
def test_an_nnx_module_runs_on_auto_axes_exactly_when_it_carries_no_state(front):
    """On Auto axes each device sees only its share of a micro-batch, so state carried from
    one micro-batch to the next (BatchNorm statistics) is refused, naming the module's state
    and the Explicit axes that take it; a module with nothing beside its parameters runs and
    gives the reference result."""
    from flax import nnx

    mesh = one_device_mesh(("data",), AxisType.Auto)
    s = scenario(2, 4)
    verify(front, s, run(front, s, mesh))  # the reference's Linear: parameters only

    class Counting(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.Param(jnp.asarray(s.w))
            self.calls = nnx.BatchStat(jnp.zeros(()))

        def __call__(self, x: jax.Array) -> jax.Array:
            self.calls[...] += 1.0
            return x @ self.w[...]

    def loss(model: Counting, batch: Any) -> jax.Array:
        return jnp.mean((model(batch[0]) - batch[1]) ** 2)

    model = Counting()
    if front == "nnx.value_and_grad":
        call = lambda: jaxaccum.nnx.value_and_grad(  # noqa: E731
            loss, num_microbatches=2, mesh=mesh)(model, (s.x, s.y))
    else:
        optimizer = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)
        call = lambda: jaxaccum.nnx.train_step(  # noqa: E731
            loss, num_microbatches=2, mesh=mesh)(model, optimizer, (s.x, s.y))
    with pytest.raises(ValueError, match=rf"^jaxaccum\.{front}: the module's state .*Auto.*"
                       r"use a mesh with Explicit axes"):
        call()


INTEGER_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


@settings(max_examples=examples(80), deadline=None)
@given(dtype=st.sampled_from([*INTEGER_DTYPES, "float32", "bool"]),
       shape=st.sampled_from([(), (0,), (1,), (3,), (4,), (5,), (2, 2)]),
       big=st.sampled_from([None, -(2**31) - 1, 2**31, 2**31 - 1, -(2**31)]),
       as_list=st.booleans(), entry=st.sampled_from(["pack", "pack_epoch", "pack_stream"]))
def test_a_sequence_is_taken_exactly_when_it_is_1d_integer_ids_that_fit(
        dtype, shape, big, as_list, entry):
    """Every packer's ``sequences``: each one a 1-D array (or list) of 1 to ``length`` integer
    token ids within int32, whatever its integer dtype; anything else refused. An accepted one
    comes out whole, in one row, its ids unchanged."""
    length = 4
    seq = np.arange(1, 1 + int(np.prod(shape))).reshape(shape).astype(dtype)
    if big is not None and seq.size and np.can_cast(np.min_scalar_type(big), seq.dtype):
        seq.flat[-1] = big
    value: Any = seq.tolist() if as_list else seq
    ids = np.asarray(value)
    valid = (ids.ndim == 1 and 1 <= ids.size <= length and ids.dtype.kind in "iu"
             and bool(np.all(ids >= -(2**31))) and bool(np.all(ids <= 2**31 - 1)))
    seqs = [np.array([9], np.int32), value]
    out: list[packing.Packed] = []

    def call() -> None:
        if entry == "pack":
            out.append(packing.pack(seqs, rows=1, length=length))
        elif entry == "pack_epoch":
            out.extend(packing.pack_epoch(seqs, rows=1, length=length, max_microbatches=2))
        else:
            out.extend(packing.pack_stream(iter(seqs), rows=1, length=length,
                                           max_microbatches=2))

    assert accepts(call) == valid, (dtype, shape, big, as_list, entry)
    if valid:
        found = [p.tokens[p.sequence_index == 1].tolist() for p in out]
        assert [t for t in found if t] == [ids.astype(np.int64).tolist()]
        assert all(p.tokens.dtype == np.int32 for p in out)
