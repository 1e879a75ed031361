"""GPU tests: everything in this folder is skipped where CUDA (or CuPy) is absent, e.g. on
CPU-only CI. Done at collection, so module- and session-scoped fixtures never run there."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _skip_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=reason)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(marker)
