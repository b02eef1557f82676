"""Request shaping for engines that take a rendered prompt: chat templates (rendered in a
sandbox, or in a killable render process), grammars for structured output and tool
calls, and the cost of a schema's patterns. Runs in the gateway (and its render
processes); an engine that takes messages (a remote OpenAI server) never sees it."""

from __future__ import annotations

from quantroute.shaping.chat_template import ChatPrompt, render_chat, render_chat_bounded
from quantroute.shaping.template_pool import TemplatePool, close_default_pool

__all__ = [
    "ChatPrompt",
    "TemplatePool",
    "close_default_pool",
    "render_chat",
    "render_chat_bounded",
]
