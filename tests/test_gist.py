"""The experiment's checks 1-5 and its open questions, on real MNIST; the command's failures.

Trajectories are compared with the float64-reference criterion of ``conftest``: accumulating
reorders float32 sums, so its error against the same full-batch run in float64 must be of the
order of the error the float32 full-batch run makes itself, not below a fixed number (Adam's own
float32 error here is ~1e-4 relative, and how it falls depends on the CPU's kernels).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import optax
import pytest
import requests
from conftest import assert_within_rounding
from launcher import run_program

import jaxaccum.experiment
from jaxaccum.experiment import data, gist

STEPS = 50  # the command's default; the training fixture runs it


def sgd() -> optax.GradientTransformation:
    return optax.sgd(gist.LEARNING_RATE)


def assert_accuracy_within_rounding(a_accuracy, a_outputs, b_accuracy, b_outputs, ref_outputs):
    """Two runs' test accuracies differ by no more than the predictions rounding could flip.

    The count comes from the float64 run's top-2 margins (``gist.ambiguous_predictions``);
    it is 0 in every run measured so far, so this asserts equal accuracy there.
    """
    ambiguous = gist.ambiguous_predictions(ref_outputs, a_outputs, b_outputs)
    gap = round(abs(a_accuracy - b_accuracy) * len(ref_outputs))
    assert gap <= ambiguous, f"{gap} predictions differ; rounding could flip {ambiguous}"
    return ambiguous


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
    runs = {
        (b, m): gist.train(mnist, b, m, steps)
        for b, m, steps in [(64, 1, STEPS), (1, 64, STEPS), (1, 1, STEPS * 64)]
    }
    runs["float32"] = gist.reference_train(mnist, 64, STEPS, sgd, np.float32)
    runs["float64"] = gist.reference_train(mnist, 64, STEPS, sgd)
    return runs


def test_check5_big_batch_equals_accumulated(training):
    full, accumulated = training[64, 1], training[1, 64]
    ref32, ref64 = training["float32"], training["float64"]
    # The same examples in the same order: the float64 host sums are equal, bit for bit.
    assert accumulated.hash_host == full.hash_host
    # The device sums them in float32 (~1e-7 apart measured); one other example would move
    # the hash by ~100 / 3.3e5 = 3e-4.
    for run in (full, accumulated):
        assert run.hash_device == pytest.approx(run.hash_host, rel=1e-5)
    for run in (full, accumulated):  # jaxaccum's k=1 and k=64 steps vs plain jax.grad
        assert_within_rounding(run.params, ref32.params, ref64.params)
        losses = [run.loss_mean, run.loss_std]
        ev32, ev64 = ref32.evaluation, ref64.evaluation
        assert_within_rounding(
            losses, [ev32.loss_mean, ev32.loss_std], [ev64.loss_mean, ev64.loss_std]
        )
    assert_accuracy_within_rounding(
        accumulated.accuracy,
        accumulated.test_outputs,
        full.accuracy,
        full.test_outputs,
        ref64.evaluation.outputs,
    )


def test_check5_no_accumulation_differs(training):
    full, single = training[64, 1], training[1, 1]
    assert single.hash_host == full.hash_host  # the same 3200 examples ...
    assert abs(single.loss_mean - full.loss_mean) > 1e-3  # ... but 64x more updates
    assert single.accuracy != full.accuracy


def test_compare_to_float64_reports_the_criterion(mnist, training):
    full, accumulated, ref64 = training[64, 1], training[1, 64], training["float64"]
    c = gist.compare_to_float64(full, accumulated, ref64)
    assert c["within_rounding"] is True
    assert 0 < c["error_full_vs_float64"] < 1e-5  # SGD: float32's own error, ~6e-7 measured
    assert c["error_accumulated_vs_float64"] <= c["bound"]
    assert c["bound"] == pytest.approx(10 * c["error_full_vs_float64"] + 16 * gist.EPS32)
    # A learning rate 0.1% off is far outside rounding (~4e-4 against a bound of ~8e-6).
    off = gist.train(mnist, 1, 64, STEPS, optax.sgd(gist.LEARNING_RATE * 1.001))
    assert not gist.compare_to_float64(full, off, ref64)["within_rounding"]


def test_ambiguous_predictions_counts_small_margins():
    ref = np.array([[1.0, 0.9, 0.0], [1.0, 0.0, 0.0], [0.0, 0.5, 0.56]])
    close = ref + 0.01
    assert gist.ambiguous_predictions(ref, close) == 0  # margins 0.1, 1, 0.06 > 2 * 0.01
    far = ref.copy()
    far[0, 1] += 0.06  # deviation 0.06: margins <= 0.12 are ambiguous (0.1 and 0.06)
    assert gist.ambiguous_predictions(ref, close, far) == 2


def test_dropout_per_example_keys_match_k1_vs_k64(mnist):
    d = gist.dropout_gradients(mnist, k=64)
    assert d["per_example_keys"] < 1e-6
    assert d["batch_key"] > 1e-2 * d["max_abs_grad"]  # one key per call: masks change with k


# Adam by default: its rounding is the largest (and the one a fixed tolerance tripped over); the
# others run with -m slow, and tests/test_train_step.py covers them all on small models.
@pytest.mark.parametrize(
    "name", [n if n == "adam" else pytest.param(n, marks=pytest.mark.slow) for n in gist.OPTIMIZERS]
)
def test_stateful_optimizers_match(mnist, name):
    make, steps = gist.OPTIMIZERS[name], 20
    accumulated = gist.train(mnist, 1, 64, steps, make())
    full32 = gist.reference_train(mnist, 64, steps, make, np.float32)
    ref64 = gist.reference_train(mnist, 64, steps, make)
    assert_within_rounding(accumulated.params, full32.params, ref64.params)
    assert_accuracy_within_rounding(
        accumulated.accuracy,
        accumulated.test_outputs,
        full32.evaluation.accuracy,
        full32.evaluation.outputs,
        ref64.evaluation.outputs,
    )


def test_command_writes_results_and_png(tmp_path, mnist, monkeypatch):
    monkeypatch.setattr(gist.Mnist, "load", classmethod(lambda cls, *a: mnist))
    # Short: one optimizer and no dropout gradients (each has its own test above), few timing
    # rounds.
    monkeypatch.setattr(gist, "OPTIMIZERS", {"adam": gist.OPTIMIZERS["adam"]})
    monkeypatch.setattr(gist, "dropout_gradients", lambda mnist, k: {"skipped": True})
    monkeypatch.setattr(gist, "timing", functools.partial(gist.timing, rounds=2))
    code = gist.main(
        ["--steps", "3", "--microbatches", "8", "--dropout-steps", "2", "--out", str(tmp_path)]
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0 and results["equivalent"] and results["differs_without_accumulation"]
    assert [r["name"] for r in results["training"]] == ["(8, 1)", "(1, 8)", "(1, 1)"]
    rows = [results["float64_reference"], results["dropout_training"]]
    rows += list(results["optimizers"].values())
    for row in rows:
        assert row["within_rounding"] is True
        errors = [v for k, v in row.items() if k.startswith("error_")]
        assert len(errors) == 2 and all(0 < e <= row["bound"] for e in errors), row
    assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_command_rejects_bad_steps():
    with pytest.raises(SystemExit):
        gist.main(["--steps", "0"])


def no_network(*args, **kwargs):
    raise requests.exceptions.ConnectionError("no network (simulated by the test)")


def test_command_offline_without_mnist_says_what_to_set(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(data.MANUAL_DIR_ENV, raising=False)
    monkeypatch.setattr(requests, "head", no_network)
    monkeypatch.setattr(requests.Session, "request", no_network)  # the download itself, too
    code = gist.main(["--data-dir", str(tmp_path / "tfds"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("jaxaccum-gist: MNIST is not prepared in "), err
    for needed in ("set JAXACCUM_MNIST_DIR", "--manual-dir", "t10k-labels-idx1-ubyte.gz"):
        assert needed in err
    assert not (tmp_path / "out").exists()


def test_command_manual_dir_without_files_says_so(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code = gist.main(["--data-dir", str(tmp_path / "tfds"), "--manual-dir", str(empty)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"{str(empty)!r} lacks train-images-idx3-ubyte.gz" in err


def test_console_script_without_the_extra_names_it(monkeypatch, capsys):
    real = jaxaccum.experiment.importlib.util.find_spec
    monkeypatch.setattr(
        jaxaccum.experiment.importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("flax", "rich") else real(name, *a),
    )
    assert jaxaccum.experiment.main(["--help"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "jaxaccum-gist: the 'experiment' extra is not installed (missing: flax, rich); "
        "install it with: pip install 'jaxaccum[experiment]'\n"
    )


def test_library_imports_no_experiment():
    """A fresh interpreter: ``import jaxaccum`` loads none of the experiment's stack."""
    assert run_program("imports", devices=1)["loaded"] == []
