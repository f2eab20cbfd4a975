"""Which modules a bare ``import jaxaccum`` loads that belong to the experiment's stack."""

from __future__ import annotations

import sys

import jaxaccum  # noqa: F401

from .common import emit

EXPERIMENT = {"flax", "tensorflow_datasets", "matplotlib", "rich", "array_record"}


def main() -> None:
    loaded = sorted(
        m
        for m in sys.modules
        if m.split(".")[0] in EXPERIMENT or m.startswith("jaxaccum.experiment")
    )
    emit({"loaded": loaded})


if __name__ == "__main__":
    main()
