"""The tables a first pattern needs are built before the app serves, in a thread."""

from __future__ import annotations

import pytest

from qrtest import fake_app
from quantroute.shaping import pattern
from quantroute.shaping.grammar import schema_grammar

pytestmark = pytest.mark.asyncio


async def test_the_digit_table_is_built_by_the_lifespan_before_the_app_serves() -> None:
    pattern._decimals.cache_clear()  # as in a fresh process
    app = fake_app()
    async with app.router.lifespan_context(app):
        assert pattern._decimals.cache_info().currsize == 1
        hits = pattern._decimals.cache_info().hits
        schema_grammar({"type": "string", "pattern": "^\\D{3}warm$"})
        assert pattern._decimals.cache_info().hits > hits  # not built again, on the loop
