"""MNIST through a tensorflow-datasets builder (no TensorFlow needed) and a seeded example stream.

The builder :class:`JaxaccumMnist` obtains the four standard MNIST files through TFDS' download
manager: online it downloads them; offline it takes them from a manual directory (the
``manual_dir`` argument or the ``JAXACCUM_MNIST_DIR`` environment variable). Either way their
sizes and sha256 sums are checked against ``checksums.tsv`` beside this module (the entries of
TFDS' own ``mnist`` checksums). The files are parsed with ``gzip`` and ``numpy``, written once
as ``array_record`` under TFDS' ``data_dir`` (``~/tensorflow_datasets`` unless given or set in
``$TFDS_DATA_DIR``) and read back as a TFDS data source.

Offline with neither a manual directory nor a prepared dataset, :func:`mnist` raises
:class:`MnistDownloadError` at once, saying what to set, instead of retrying the download for
minutes.

:func:`add_arguments` gives a command line the ``--data-dir`` and ``--manual-dir`` options of
``jaxaccum-gist`` (the MNIST programs in ``examples/`` take the same two).
"""

from __future__ import annotations

import argparse
import gzip
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import requests
import tensorflow_datasets as tfds

MANUAL_DIR_ENV = "JAXACCUM_MNIST_DIR"
DATA_DIR_ENV = "TFDS_DATA_DIR"  # read by tensorflow-datasets itself
_URL = "https://storage.googleapis.com/cvdf-datasets/mnist/"
_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
SPLIT_SIZES = {"train": 60_000, "test": 10_000}
PROBE_TIMEOUT_S = 10.0


class MnistDownloadError(ConnectionError):
    """MNIST is neither prepared nor in a manual directory, and it cannot be downloaded."""


def _read_idx(path: Any, offset: int) -> np.ndarray:
    with open(path, "rb") as raw, gzip.open(raw) as f:
        return np.frombuffer(f.read(), np.uint8, offset=offset)


class JaxaccumMnist(tfds.core.GeneratorBasedBuilder):
    """MNIST (LeCun, Cortes and Burges; CC BY-SA 3.0) as uint8 (28, 28, 1) images and labels."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "The standard MNIST files, read without TensorFlow."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        f"Offline, place the four MNIST files ({', '.join(_FILES.values())}) in a folder and "
        f"pass it as manual_dir or in ${MANUAL_DIR_ENV}."
    )

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description="MNIST handwritten digits.",
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Tensor(shape=(28, 28, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("image", "label"),
            homepage="http://yann.lecun.com/exdb/mnist/",
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        paths = dl_manager.download({key: _URL + name for key, name in _FILES.items()})
        return {
            split: self._generate_examples(paths[f"{split}_images"], paths[f"{split}_labels"])
            for split in ("train", "test")
        }

    def _generate_examples(self, images_path: Any, labels_path: Any) -> Iterator[Any]:
        images = _read_idx(images_path, 16).reshape(-1, 28, 28, 1)
        labels = _read_idx(labels_path, 8)
        if len(images) != len(labels):
            raise ValueError(
                f"MNIST files disagree: {len(images)} images in {images_path} but "
                f"{len(labels)} labels in {labels_path}"
            )
        for i, (image, label) in enumerate(zip(images, labels, strict=True)):
            yield i, {"image": image, "label": int(label)}


def mnist(
    split: str = "train",
    *,
    data_dir: str | os.PathLike[str] | None = None,
    manual_dir: str | os.PathLike[str] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Loads an MNIST split as float32 images in [0, 1] flattened to 784 and int32 labels.

    Args:
      split: ``"train"`` (60,000 examples) or ``"test"`` (10,000).
      data_dir: where TFDS keeps the prepared dataset (TFDS' default when ``None``).
      manual_dir: a folder holding the four MNIST ``.gz`` files, for offline use; defaults to
        ``$JAXACCUM_MNIST_DIR``. Without one, TFDS downloads the files.

    Returns:
      ``(images, labels)``: arrays of shapes ``(n, 784)`` float32 and ``(n,)`` int32, in the
      files' order.

    Raises:
      ValueError: for an unknown split, a ``manual_dir`` that lacks one of the four files, or
        a file that does not match its recorded size and sha256 (a corrupted or different file).
      MnistDownloadError: when the dataset is not prepared in ``data_dir``, no ``manual_dir``
        is given and the files cannot be downloaded (offline).
    """
    if split not in SPLIT_SIZES:
        raise ValueError(f"split must be one of {sorted(SPLIT_SIZES)}; got split={split!r}")
    if manual_dir is None:
        manual_dir = os.environ.get(MANUAL_DIR_ENV) or None
    builder = JaxaccumMnist(
        data_dir=None if data_dir is None else os.fspath(data_dir), file_format="array_record"
    )
    # download_and_prepare reuses a prepared dataset. (tfds.data_source would first ask
    # builder.is_prepared(), which logs "Variant folder ... has no dataset_info.json" whenever
    # the dataset is not prepared yet, e.g. on every first run.)
    if not builder.data_path.exists():
        if manual_dir is None:
            _probe_download(builder)
        else:
            _check_manual_dir(manual_dir)
    config = tfds.download.DownloadConfig(
        manual_dir=None if manual_dir is None else os.fspath(manual_dir),
        try_download_gcs=False,
    )
    try:
        builder.download_and_prepare(download_config=config)
    except tfds.download.download_manager.NonMatchingChecksumError as e:
        raise ValueError(
            f"an MNIST file does not match its recorded size and sha256 (manual_dir="
            f"{manual_dir!s}); replace it with the original file. TFDS said: {e}"
        ) from e
    except requests.exceptions.RequestException as e:
        raise MnistDownloadError(_offline_message(builder, e)) from e
    source = builder.as_data_source(split=split)
    records = source.__getitems__(range(len(source)))
    images = np.stack([r["image"] for r in records]).reshape(len(records), 784)
    labels = np.asarray([r["label"] for r in records], np.int32)
    return images.astype(np.float32) / 255.0, labels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--data-dir`` (TFDS' ``data_dir``, where MNIST is prepared once and then reused)
    and ``--manual-dir`` (the four ``.gz`` files, for offline use) to ``parser``; pass the
    parsed values to :func:`mnist` as ``data_dir`` and ``manual_dir``."""
    parser.add_argument(
        "--data-dir",
        default=None,
        help=f"TFDS data_dir where MNIST is prepared once (default: ${DATA_DIR_ENV} or "
        "~/tensorflow_datasets)",
    )
    parser.add_argument(
        "--manual-dir",
        default=os.environ.get(MANUAL_DIR_ENV),
        help=f"folder with the four MNIST .gz files, for offline use (default: "
        f"${MANUAL_DIR_ENV}); without one, they are downloaded",
    )


def _offline_message(builder: tfds.core.DatasetBuilder, error: Exception) -> str:
    return (
        f"MNIST is not prepared in {builder.data_dir_root} and could not be downloaded "
        f"({type(error).__name__}); offline, set {MANUAL_DIR_ENV} or pass --manual-dir "
        f"(manual_dir=) to a folder with the four MNIST files {', '.join(_FILES.values())}"
    )


def _probe_download(builder: tfds.core.DatasetBuilder) -> None:
    """One quick request before TFDS' download, whose retries take minutes to fail offline."""
    url = _URL + _FILES["test_labels"]
    try:
        requests.head(url, timeout=PROBE_TIMEOUT_S, allow_redirects=True)
    except requests.exceptions.RequestException as e:
        raise MnistDownloadError(_offline_message(builder, e)) from e


def _check_manual_dir(manual_dir: str | os.PathLike[str]) -> None:
    folder = os.fspath(manual_dir)
    if not os.path.isdir(folder):
        raise ValueError(
            f"manual_dir (or ${MANUAL_DIR_ENV}) must be a folder with the four MNIST .gz files; "
            f"got {folder!r}, which is not a folder"
        )
    missing = [f for f in _FILES.values() if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise ValueError(
            f"manual_dir (or ${MANUAL_DIR_ENV}) must hold the four MNIST .gz files; "
            f"{folder!r} lacks {', '.join(missing)}"
        )


class ExampleStream:
    """A seeded, endless stream of examples that reshuffles at each epoch.

    ``next_batch(n)`` returns the next ``n`` examples of the stream, crossing epoch boundaries
    as needed, so the examples drawn depend only on the seed and how many were drawn before:
    10 batches of 10 and then one example give the same examples as 100 batches of 1 and then
    one example.

    Args:
      images: array of examples, leading axis the example index.
      labels: array of labels, same leading size.
      seed: seed of the shuffling (``numpy.random.default_rng``).

    Raises:
      ValueError: if ``images`` and ``labels`` differ in length or are empty.

    Examples:
      >>> import numpy as np
      >>> s = ExampleStream(np.arange(5), np.arange(5), seed=0)
      >>> t = ExampleStream(np.arange(5), np.arange(5), seed=0)
      >>> a = np.concatenate([s.next_batch(3)[0], s.next_batch(4)[0]])
      >>> bool((a == t.next_batch(7)[0]).all())
      True
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, seed: int) -> None:
        if len(images) != len(labels) or not len(images):
            raise ValueError(
                f"images and labels must be non-empty and equally long; got {len(images)} images "
                f"and {len(labels)} labels"
            )
        self.images = images
        self.labels = labels
        self._rng = np.random.default_rng(seed)
        self._order = self._rng.permutation(len(images))
        self._position = 0
        self.epoch = 0

    def next_indices(self, n: int) -> np.ndarray:
        """The indices of the next ``n`` examples."""
        if n < 0:
            raise ValueError(f"n must be >= 0; got n={n}")
        parts = []
        while n > 0:
            if self._position == len(self._order):
                self._order = self._rng.permutation(len(self.images))
                self._position = 0
                self.epoch += 1
            take = min(n, len(self._order) - self._position)
            parts.append(self._order[self._position : self._position + take])
            self._position += take
            n -= take
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def next_batch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``n`` ``(images, labels)``."""
        idx = self.next_indices(n)
        return self.images[idx], self.labels[idx]
