"""Fixtures shared by the engine tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from quantroute.engines.llamacpp.engine import LlamaCppEngine


@pytest.fixture
async def engines() -> AsyncIterator[list[LlamaCppEngine]]:
    """The llama.cpp engines a test made (it appends them): stopped when it ends, however
    it ends. A module that needs engines of its own kind defines its own ``engines``."""
    made: list[LlamaCppEngine] = []
    yield made
    for e in made:
        await e.stop()
