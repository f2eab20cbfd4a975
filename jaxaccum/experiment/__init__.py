"""The MNIST experiment that jaxaccum grew from: models, data and the ``jaxaccum-gist`` command.

Apart from the library on purpose: it needs the ``experiment`` extra (flax, tensorflow-datasets,
array_record, importlib_resources, matplotlib, rich), which ``import jaxaccum`` never imports.

- :mod:`jaxaccum.experiment.models`: ``GistMLP``, ``DropoutMLP`` and their MSE loss (flax NNX).
- :mod:`jaxaccum.experiment.data`: MNIST through a tensorflow-datasets builder, ``ExampleStream``.
- :mod:`jaxaccum.experiment.gist`: the checks, the training comparison and the command.

This module itself imports only the standard library, so that :func:`main` (the
``jaxaccum-gist`` console script) can say in one line which extra is missing.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

__all__ = ["main"]

EXTRA = "experiment"
INSTALL_HINT = "pip install 'jaxaccum[experiment]'"

# Import name -> distribution name, of everything the experiment imports beyond the library.
REQUIREMENTS = {
    "flax": "flax",
    "tensorflow_datasets": "tensorflow-datasets",
    "array_record": "array_record",
    "importlib_resources": "importlib_resources",
    "matplotlib": "matplotlib",
    "rich": "rich",
}


def missing_requirements() -> list[str]:
    """The distributions of the ``experiment`` extra that are not installed (empty if none)."""
    return [dist for mod, dist in REQUIREMENTS.items() if importlib.util.find_spec(mod) is None]


def main(argv: Sequence[str] | None = None) -> int:
    """The ``jaxaccum-gist`` console script; without the extra, one line naming it."""
    missing = missing_requirements()
    if missing:
        print(
            f"jaxaccum-gist: the '{EXTRA}' extra is not installed (missing: {', '.join(missing)});"
            f" install it with: {INSTALL_HINT}",
            file=sys.stderr,
        )
        return 2
    from jaxaccum.experiment import gist

    return gist.main(argv)
