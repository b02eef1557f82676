"""Which chat templates may render in the gateway's own process: a static check.

A template renders on the event loop only when its syntax tree proves every
operation it can do is bounded by the size of what it is given (no
operation that multiplies, pads, formats or repeats, no macros, no
recursion, no block ``set``) — the sandbox's budget (``template_sandbox``)
then bounds its loops by a deadline and its values by a small size before
each is built, and with small inputs no one C-level operation is long.
Everything else renders in a render process (``template_pool``), which can
be killed.

The lists below are what common chat templates (ChatML, Llama 2/3, Mistral,
Gemma, Qwen without tools) use. A template outside them is not refused:
it renders out of process.

>>> provably_bounded("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}")
True
>>> provably_bounded("{{ 'x' * 10 }}")
False
"""

from __future__ import annotations

from functools import lru_cache

import jinja2
from jinja2 import nodes

__all__ = ["provably_bounded"]

# Nodes that build nothing larger than their operands together.
_NODES: tuple[type[nodes.Node], ...] = (
    nodes.Template, nodes.Output, nodes.TemplateData, nodes.If, nodes.For, nodes.Assign,
    nodes.NSRef, nodes.Name, nodes.Const, nodes.Getattr, nodes.Getitem, nodes.Slice,
    nodes.Compare, nodes.Operand, nodes.And, nodes.Or, nodes.Not, nodes.Neg, nodes.Pos,
    nodes.CondExpr, nodes.Test, nodes.Concat, nodes.Add, nodes.Sub, nodes.List, nodes.Tuple,
    nodes.Dict, nodes.Pair, nodes.Keyword, nodes.Filter, nodes.Call, nodes.With,
)  # fmt: skip
_FILTERS = frozenset(
    {
        "abs", "capitalize", "count", "d", "default", "dictsort", "e", "escape", "first",
        "float", "int", "items", "join", "last", "length", "list", "lower", "reject",
        "rejectattr", "reverse", "safe", "select", "selectattr", "sort", "string", "title",
        "tojson", "trim", "unique", "upper",
    }
)  # fmt: skip
_TESTS = frozenset(
    {
        "boolean", "defined", "divisibleby", "eq", "equalto", "even", "false", "float", "ge",
        "gt", "in", "integer", "iterable", "le", "lower", "lt", "mapping", "ne", "none",
        "number", "odd", "sameas", "sequence", "string", "true", "undefined", "upper",
    }
)  # fmt: skip
_METHODS = frozenset(
    {
        "capitalize", "endswith", "get", "items", "keys", "lower", "lstrip", "rsplit",
        "rstrip", "split", "startswith", "strip", "title", "upper", "values",
    }
)  # fmt: skip
_FUNCTIONS = frozenset({"namespace", "raise_exception", "strftime_now"})
_MAX_JSON_INDENT = 8


@lru_cache(maxsize=64)
def provably_bounded(source: str) -> bool:
    """Whether ``source``'s every operation is bounded by its inputs (see the module
    docstring); ``False`` for a template that does not parse."""
    try:
        tree = jinja2.Environment().parse(source)
    except jinja2.TemplateError:
        return False
    return all(_allowed(node) for node in tree.find_all(nodes.Node))


def _allowed(node: nodes.Node) -> bool:
    if type(node) not in _NODES:
        return False
    if isinstance(node, nodes.For):
        return not node.recursive
    if isinstance(node, nodes.Filter):
        return node.name in _FILTERS and _small_indent(node)
    if isinstance(node, nodes.Test):
        return node.name in _TESTS
    if isinstance(node, nodes.Call):
        if node.dyn_args is not None or node.dyn_kwargs is not None:
            return False
        if isinstance(node.node, nodes.Name):
            return node.node.name in _FUNCTIONS
        return isinstance(node.node, nodes.Getattr) and node.node.attr in _METHODS
    return True


def _small_indent(node: nodes.Filter) -> bool:
    """``tojson``'s indent, when it has one, is a small constant."""
    if node.name != "tojson":
        return True
    given = [*node.args, *(k.value for k in node.kwargs if k.key == "indent")]
    return all(
        isinstance(a, nodes.Const) and isinstance(a.value, int) and a.value <= _MAX_JSON_INDENT
        for a in given
    ) and (node.dyn_args is None and node.dyn_kwargs is None)
