"""Root pytest configuration: shared engine fixtures live in tests/engine_fixtures.py."""

import os

# OpenMP threads that spin while waiting starve every other process on a small machine
# (the test process, the server's model processes): a batched CPU step went from
# ~0.15 s to 2-8 s under load. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

pytest_plugins = ["tests.engine_fixtures"]
