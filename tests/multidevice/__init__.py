"""Programs the multi-device tests run in fresh Python processes (see ``tests/launcher.py``).

Each module is run as ``python -m tests.multidevice.<name> [args]``: ``XLA_FLAGS`` (the number
of host devices) must be set before JAX starts, and multi-process programs start several JAX
processes that talk over 127.0.0.1. Every ``main()`` prints one JSON object on its last stdout
line. Every mesh-related jaxaccum argument goes through :func:`common.accumulation_options`.
"""
