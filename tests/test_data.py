"""jaxaccum.experiment.data: MNIST through the TFDS builder, offline; the example stream."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import requests
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxaccum.experiment import data

# From ../shared/mnist/README.md.
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_splits_sizes_labels_and_pixels(mnist):
    assert mnist.train_images.shape == (60_000, 784)
    assert mnist.test_images.shape == (10_000, 784)
    assert mnist.train_images.dtype == np.float32 and mnist.train_labels.dtype == np.int32
    assert np.bincount(mnist.train_labels).tolist() == TRAIN_COUNTS
    assert np.bincount(mnist.test_labels).tolist() == TEST_COUNTS
    assert float(mnist.train_images.min()) == 0.0 and float(mnist.train_images.max()) == 1.0
    np.testing.assert_allclose(mnist.train_images.mean(), 0.13066, atol=5e-6)
    np.testing.assert_allclose(mnist.train_images.std(), 0.30811, atol=5e-6)


def test_corrupted_file_is_rejected(tmp_path):
    # Four files of the recorded sizes whose bytes differ (as a corrupted download's would):
    # only the sha256 can tell them apart, and no MNIST is needed to check that it does.
    manual = tmp_path / "manual"
    manual.mkdir()
    rng = np.random.default_rng(0)
    rows = (pathlib.Path(data.__file__).parent / "checksums.tsv").read_text().splitlines()
    for _url, size, _sha, name in (row.split("\t") for row in rows):
        (manual / name).write_bytes(rng.integers(0, 256, int(size), np.uint8).tobytes())
    with pytest.raises(ValueError, match=r"does not match its recorded size and sha256"):
        data.mnist("test", data_dir=tmp_path / "tfds", manual_dir=manual)


def test_unknown_split():
    with pytest.raises(
        ValueError, match=r"split must be one of \['test', 'train'\]; got split='val'"
    ):
        data.mnist("val")


def test_checksums_are_tfds_own():
    import tensorflow_datasets as tfds

    ours = (pathlib.Path(data.__file__).parent / "checksums.tsv").read_text().split()
    theirs = (
        (pathlib.Path(tfds.__file__).parent / "url_checksums" / "mnist.txt").read_text().split()
    )
    assert sorted(ours) == sorted(theirs)


@settings(max_examples=examples(30), deadline=None)
@given(sizes=st.lists(st.integers(0, 17), min_size=1, max_size=12), seed=st.integers(0, 99))
def test_stream_depends_only_on_count(sizes, seed):
    n = 23
    a = data.ExampleStream(np.arange(n), np.arange(n), seed)
    b = data.ExampleStream(np.arange(n), np.arange(n), seed)
    chunks = np.concatenate([a.next_batch(s)[0] for s in sizes])
    np.testing.assert_array_equal(chunks, b.next_batch(sum(sizes))[0])


def test_stream_reshuffles_each_epoch():
    s = data.ExampleStream(np.arange(50), np.arange(50), seed=3)
    first, second = s.next_batch(50)[0], s.next_batch(50)[0]
    assert sorted(first) == sorted(second) == list(range(50))
    assert not np.array_equal(first, second)
    assert s.epoch == 1


def test_stream_errors():
    with pytest.raises(ValueError, match=r"got 3 images and 2 labels"):
        data.ExampleStream(np.zeros(3), np.zeros(2), 0)
    with pytest.raises(ValueError, match=r"n must be >= 0; got n=-1"):
        data.ExampleStream(np.zeros(3), np.zeros(3), 0).next_batch(-1)


def no_network(*args, **kwargs):
    raise requests.exceptions.ConnectionError("no network (simulated by the test)")


def test_offline_without_manual_dir_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.delenv(data.MANUAL_DIR_ENV, raising=False)
    monkeypatch.setattr(requests, "head", no_network)  # the quick probe before TFDS' download

    def download(*args, **kwargs):  # TFDS' download would retry for minutes offline
        raise AssertionError("TFDS' download was tried after the probe had failed")

    monkeypatch.setattr(requests.Session, "request", download)
    with pytest.raises(data.MnistDownloadError) as e:
        data.mnist("test", data_dir=tmp_path / "tfds")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"MNIST is not prepared in {tmp_path / 'tfds'} and could not be")
    assert "(ConnectionError); offline, set JAXACCUM_MNIST_DIR or pass --manual-dir" in message
    assert "t10k-images-idx3-ubyte.gz" in message


def test_download_failure_after_the_probe_is_the_same_error(tmp_path, monkeypatch):
    monkeypatch.delenv(data.MANUAL_DIR_ENV, raising=False)
    monkeypatch.setattr(requests, "head", lambda *a, **k: None)  # the probe gets through ...
    monkeypatch.setattr(requests.Session, "request", no_network)  # ... the download does not
    with pytest.raises(data.MnistDownloadError, match=r"set JAXACCUM_MNIST_DIR"):
        data.mnist("test", data_dir=tmp_path / "tfds")


def test_manual_dir_must_hold_the_files(tmp_path):
    (tmp_path / "some").mkdir()
    (tmp_path / "some" / "t10k-images-idx3-ubyte.gz").write_bytes(b"")
    with pytest.raises(ValueError, match=r"lacks train-images-idx3-ubyte.gz, train-labels-idx1"):
        data.mnist("test", data_dir=tmp_path / "tfds", manual_dir=tmp_path / "some")
    with pytest.raises(ValueError, match=r"got '.*nowhere', which is not a folder"):
        data.mnist("test", data_dir=tmp_path / "tfds", manual_dir=tmp_path / "nowhere")


def test_first_run_logs_no_variant_folder_warning(tmp_path, monkeypatch, caplog):
    # TFDS' builder.is_prepared() logs "Variant folder ... has no dataset_info.json" whenever
    # the dataset is not prepared yet (tfds.data_source asks it first); data.mnist never asks.
    import tensorflow_datasets as tfds

    def is_prepared(self):
        raise AssertionError("data.mnist asked is_prepared()")

    monkeypatch.setattr(tfds.core.DatasetBuilder, "is_prepared", is_prepared)
    monkeypatch.delenv(data.MANUAL_DIR_ENV, raising=False)
    monkeypatch.setattr(requests, "head", no_network)
    with caplog.at_level("WARNING"), pytest.raises(data.MnistDownloadError):
        data.mnist("test", data_dir=tmp_path / "tfds")
    assert "Variant folder" not in caplog.text


def test_prepared_dataset_needs_no_manual_dir_and_no_network(mnist_data_dir, mnist,
                                                            monkeypatch):
    # Once prepared (by the fixture), MNIST is read back with no .gz files and no network.
    monkeypatch.delenv(data.MANUAL_DIR_ENV, raising=False)
    monkeypatch.setattr(requests, "head", no_network)
    monkeypatch.setattr(requests.Session, "request", no_network)
    images, labels = data.mnist("test", data_dir=mnist_data_dir)
    np.testing.assert_array_equal(images, mnist.test_images)
    np.testing.assert_array_equal(labels, mnist.test_labels)
