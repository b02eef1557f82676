"""A chat request's :class:`~quantroute.engines.base.ChatInput` (the client's messages,
for engines that take messages: a remote ``openai`` branch) is built only where a
branch the request may run on takes it (``api/jobs.py``, ``takes_messages``): a model
whose branches are all llama.cpp gets the rendered prompt alone, and a branch that
takes messages gets the client's messages as they came, in OpenAI's shape, whatever
the template rendering made of them.

Fake engines stand in for both kinds: what is built is decided by each branch's
``engine:`` name in the engine table, not by the engine object."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qrtest import serving
from quantroute.api.app import create_app
from quantroute.api.tools import Tool, template_messages
from quantroute.config import load_settings
from quantroute.engines.base import ChatInput, GenerationRequest
from quantroute.engines.fake import FakeEngine
from quantroute.registry.manifest import BranchArtifact
from quantroute.routing.table import Branch, ModelRoute, RouteTable
from quantroute.types import Precision

MODEL = "tiny-llama"
LOCAL = {"f16": "llamacpp", "q8_0": "llamacpp", "q4_k_m": "llamacpp"}
MIXED = {"f16": "llamacpp", "q8_0": "llamacpp", "q4_k_m": "openai"}

# A conversation the default template rewrites: text parts joined, an assistant's
# earlier call written into its turn, a tool's answer wrapped in <tool_response>.
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": [{"type": "text", "text": "add "}, {"type": "text", "text": "1"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "2"},
]
# ... and what a remote is sent of it (ChatMessage.for_template: OpenAI's shape)
CLIENT = (
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "add 1"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "2", "tool_call_id": "c1"},
)
FORMAT = {"type": "json_object"}


def _table(engines: dict[str, FakeEngine], kinds: dict[str, str]) -> RouteTable:
    branches = []
    for name, engine in engines.items():
        artifact = BranchArtifact(
            MODEL, name, Precision(name), kinds[name], Path(f"/nonexistent/{name}.gguf"),
            "0" * 64, 0, name == "f16",
        )  # fmt: skip
        branches.append(Branch(MODEL, name, Precision(name), artifact, engine))
    return RouteTable.build([ModelRoute(MODEL, "f16", tuple(branches))])


@pytest.fixture(params=[LOCAL, MIXED], ids=["local", "mixed"])
async def gateway(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, FakeEngine], dict[str, str]]]:
    kinds: dict[str, str] = request.param
    engines = {name: FakeEngine() for name in kinds}
    settings = load_settings(telemetry={"devices": "sim:1x24GiB"}, limits={"max_tokens": 64})
    async with serving(create_app(settings, _table(engines, kinds))) as (client, _):
        yield client, engines, kinds


async def _chat(
    client: httpx.AsyncClient, engines: dict[str, FakeEngine], model: str, **extra: Any
) -> GenerationRequest:
    """One chat request's engine request, from the branch that answered it."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4} | extra
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (got,) = [req for e in engines.values() for req in e.requests]
    return got


@pytest.mark.parametrize("quality", [None, "fast"])
async def test_a_chat_request_carries_chat_input_only_where_a_branch_takes_messages(
    gateway: tuple[httpx.AsyncClient, dict[str, FakeEngine], dict[str, str]],
    quality: str | None,
) -> None:
    """Unpinned: the decision's branches (fallbacks too) say; ``fast`` admits the
    unprofiled remote branch, the default quality leaves it out."""
    client, engines, kinds = gateway
    extra = {} if quality is None else {"quality": quality}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4} | extra
    explained = (await client.post("/v1/route/explain", json=body)).json()
    decided = [b.split(":")[1] for b in explained["decision"]["branches"]]
    remote = [b for b in decided if kinds[b] == "openai"]
    assert bool(remote) == (kinds is MIXED and quality == "fast")
    got = await _chat(client, engines, MODEL, **extra)
    assert "<tool_response>2</tool_response>" in got.prompt  # rendered all the same
    assert got.chat == (ChatInput(CLIENT) if remote else None)


@pytest.mark.parametrize("branch", ["f16", "q4_k_m"])
async def test_a_pinned_request_carries_it_for_a_branch_that_takes_messages(
    gateway: tuple[httpx.AsyncClient, dict[str, FakeEngine], dict[str, str]], branch: str
) -> None:
    client, engines, kinds = gateway
    got = await _chat(client, engines, f"{MODEL}:{branch}", response_format=FORMAT)
    assert engines[branch].requests == [got]
    if kinds[branch] == "openai":  # the client's messages and response_format, as they came
        assert got.chat == ChatInput(CLIENT, FORMAT)
    else:  # the decision is this llama.cpp branch alone
        assert got.chat is None


def test_the_template_s_messages_leave_the_client_s_untouched() -> None:
    """The service renders from the list a remote's ChatInput reuses: neither template
    path may change it (a model's own template that reads ``tools``, and the default)."""
    tool = Tool.model_validate({"type": "function", "function": {"name": "add"}})
    for template in ("{{ tools }}{{ messages }}", None):
        client = [dict(m, tool_calls=[dict(CALL)]) if "tool_calls" in m else dict(m)
                  for m in CLIENT]  # fmt: skip
        out, _ = template_messages(client, [tool], template=template)
        assert tuple(client) == CLIENT
        assert not {id(m) for m in out} & {id(m) for m in client}
