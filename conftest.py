"""Root pytest configuration: shared engine fixtures live in tests/engine_fixtures.py."""

pytest_plugins = ["tests.engine_fixtures"]
