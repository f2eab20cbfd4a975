"""The experiment's checks 1-5 and its open questions, on real MNIST."""

from __future__ import annotations

import json

import pytest

from jaxaccum import gist


def test_check1_gradient_tree_matches_params(mnist):
    assert gist.check_gradient_structure(mnist)


def test_check2_reinit_identical():
    assert gist.check_reinit() == 0.0


def test_check3_stream_independent_of_batch_size(mnist):
    assert gist.check_stream(mnist)


def test_check4_accumulated_equals_full_batch(mnist):
    diffs = gist.check_accumulation(mnist, (1, 10, 64))
    assert set(diffs) == {1, 10, 64}
    assert all(d < 1e-7 for d in diffs.values()), diffs


@pytest.fixture(scope="module")
def training(mnist):
    return {
        (b, m): gist.train(mnist, b, m, steps)
        for b, m, steps in [(64, 1, 50), (1, 64, 50), (1, 1, 50 * 64)]
    }


def test_check5_big_batch_equals_accumulated(training):
    full, accumulated = training[64, 1], training[1, 64]
    assert accumulated.accuracy == full.accuracy
    assert abs(accumulated.loss_mean - full.loss_mean) <= 1e-6
    assert abs(accumulated.loss_std - full.loss_std) <= 1e-6
    assert accumulated.hash_host == full.hash_host
    assert accumulated.hash_device == pytest.approx(full.hash_device, rel=1e-6)
    assert gist.max_rel_diff(accumulated.params, full.params) < 1e-5


def test_check5_no_accumulation_differs(training):
    full, single = training[64, 1], training[1, 1]
    assert single.hash_host == full.hash_host  # the same 3200 examples ...
    assert abs(single.loss_mean - full.loss_mean) > 1e-3  # ... but 64x more updates
    assert single.accuracy != full.accuracy


def test_dropout_per_example_keys_match_k1_vs_k64(mnist):
    d = gist.dropout_gradients(mnist, k=64)
    assert d["per_example_keys"] < 1e-6
    assert d["batch_key"] > 1e-2 * d["max_abs_grad"]  # one key per call: masks change with k


@pytest.mark.parametrize("name", list(gist.OPTIMIZERS))
def test_stateful_optimizers_match(mnist, name):
    full = gist.train(mnist, 64, 1, 20, gist.OPTIMIZERS[name]())
    accumulated = gist.train(mnist, 1, 64, 20, gist.OPTIMIZERS[name]())
    assert gist.max_rel_diff(accumulated.params, full.params) <= 1e-5
    assert accumulated.accuracy == full.accuracy


def test_command_writes_results_and_png(tmp_path, mnist, monkeypatch):
    monkeypatch.setattr(gist.Mnist, "load", classmethod(lambda cls, *a: mnist))
    code = gist.main(
        ["--steps", "3", "--microbatches", "8", "--dropout-steps", "2", "--out", str(tmp_path)]
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0 and results["equivalent"] and results["differs_without_accumulation"]
    assert [r["name"] for r in results["training"]] == ["(8, 1)", "(1, 8)", "(1, 1)"]
    assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_command_rejects_bad_steps():
    with pytest.raises(SystemExit):
        gist.main(["--steps", "0"])
