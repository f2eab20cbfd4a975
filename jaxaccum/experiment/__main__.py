"""``python -m jaxaccum.experiment``: the same as the ``jaxaccum-gist`` command."""

from jaxaccum.experiment import main

if __name__ == "__main__":
    raise SystemExit(main())
