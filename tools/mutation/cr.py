"""``cosmic-ray`` with this project's operators (``operators.py``) beside the built-in ones.

``python tools/mutation/cr.py init|exec|... ARGS`` is ``cosmic-ray init|exec|... ARGS``
with the provider ``jaxaccum`` registered in ``cosmic_ray.plugins`` first (cosmic-ray finds
providers through entry points, which need an installed distribution; this adds it in the
process instead), so ``init`` makes their mutants and ``exec`` applies them. The mutants are
applied by the process that runs ``exec`` (cosmic-ray's ``local`` distributor calls
``mutate_and_test`` in it), so ``exec`` refuses a configuration with another distributor
(its workers would not have the operators).

Examples:
    python tools/mutation/cr.py init tools/mutation/cosmic-ray.toml session.sqlite
    python tools/mutation/cr.py exec tools/mutation/cosmic-ray.toml session.sqlite
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cosmic_ray.plugins  # noqa: E402
import operators  # noqa: E402


def register() -> None:
    """Adds the ``jaxaccum`` provider to the providers cosmic-ray's entry points loaded
    (``get_operator`` and ``operator_names`` read this mapping)."""
    cosmic_ray.plugins.OPERATOR_PROVIDERS[operators.PROVIDER_NAME] = operators.PROVIDER


def distributor(config_file: str) -> str:
    """The distributor a cosmic-ray configuration names (``local`` when none)."""
    from cosmic_ray.config import load_config

    return str(load_config(config_file).distributor_name)


def main(argv: list[str]) -> int:
    """Runs cosmic-ray's command line with the operators registered.

    Args:
        argv: cosmic-ray's arguments (``init CONFIG SESSION``, ``exec CONFIG SESSION``, ...).

    Returns:
        cosmic-ray's exit status.

    Raises:
        SystemExit: ``exec`` with a distributor other than ``local``.
    """
    register()
    if argv[:1] == ["exec"] and len(argv) >= 2 and distributor(argv[1]) != "local":
        raise SystemExit(
            f"cr.py exec: the configuration {argv[1]} uses the distributor "
            f"{distributor(argv[1])!r}; this project's operators are registered in this "
            "process only, which applies the mutants with the 'local' distributor: set "
            "[cosmic-ray.distributor] name = \"local\"")
    from cosmic_ray.cli import main as cosmic_ray_main

    return int(cosmic_ray_main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
