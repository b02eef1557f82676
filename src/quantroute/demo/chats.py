"""ChatML conversations made from the corpus, so the BPE demo model learns its chat format.

Each conversation asks for one documented top-level function or class of a
source file and answers with its code::

    <|im_start|>system
    You are a helpful assistant that writes Python.<|im_end|>
    <|im_start|>user
    Write the function `dedent` of `textwrap`: Remove any common leading whitespace ...<|im_end|>
    <|im_start|>assistant
    def dedent(text):
        ...<|im_end|>

Token ids are assembled the way llama.cpp tokenizes the rendered
:data:`~quantroute.demo.bpe.CHATML_TEMPLATE` with special tokens parsed: the
special tokens as themselves, each stretch of text between them on its own,
and the generation prompt (``<|im_start|>assistant\\n``) apart from the reply,
so the model sees at training time exactly the prompt it is served.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Sequence
from dataclasses import dataclass

from quantroute.demo.bpe import BpeVocab
from quantroute.demo.data import Source

SYSTEM_PROMPT = "You are a helpful assistant that writes Python."
DEFAULT_MAX_REPLY_CHARS = 1500


@dataclass(frozen=True, slots=True)
class ChatExample:
    """One single-turn conversation: system prompt, request, the code that answers it."""

    system: str
    user: str
    assistant: str

    @property
    def messages(self) -> list[dict[str, str]]:
        """The conversation as OpenAI-style messages (without the reply)."""
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user}]


def chat_examples(
    sources: Sequence[Source],
    *,
    per_file: int,
    seed: int,
    max_reply_chars: int = DEFAULT_MAX_REPLY_CHARS,
) -> list[ChatExample]:
    """Up to ``per_file`` conversations from each source, about its documented definitions.

    Definitions are drawn with a generator seeded by ``seed``; files that do
    not parse are skipped. Same sources, same seed: same examples.
    """
    rng = random.Random(seed)
    out: list[ChatExample] = []
    for source in sources:
        try:
            tree = ast.parse(source.text)
        except (SyntaxError, ValueError):
            continue
        module = source.path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        lines = source.text.split("\n")  # ast counts lines at "\n" only, not at "\f" etc.
        found: list[ChatExample] = []
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            doc = ast.get_docstring(node)
            code = _segment(lines, node)
            if not doc or not code or len(code) > max_reply_chars:
                continue
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            summary = doc.strip().splitlines()[0].strip()
            user = f"Write the {kind} `{node.name}` of `{module}`: {summary}"
            found.append(ChatExample(SYSTEM_PROMPT, user, code))
        out += rng.sample(found, min(per_file, len(found)))
    return out


def _segment(lines: list[str], node: ast.stmt) -> str:
    """The source of a top-level ``node`` (``ast.get_source_segment`` re-splits the file
    on every call, which is quadratic over a module's definitions)."""
    if node.end_lineno is None or node.end_col_offset is None:
        return ""
    body = lines[node.lineno - 1 : node.end_lineno]
    if not body:
        return ""
    last = body[-1].encode("utf-8")[: node.end_col_offset].decode("utf-8", errors="ignore")
    return "".join(line + "\n" for line in body[:-1]) + last


def chat_tokens(example: ChatExample, vocab: BpeVocab) -> list[int]:
    """The conversation's token ids, reply and closing ``<|im_end|>`` included (no BOS)."""
    start, end = vocab.im_start_id, vocab.eos_id
    system, user, prompt, reply, newline = vocab.encode_batch(
        [
            f"system\n{example.system}",
            f"user\n{example.user}",
            "assistant\n",
            example.assistant,
            "\n",
        ]
    )
    ids = [start, *system, end, *newline, start, *user, end, *newline]
    ids += [start, *prompt, *reply, end, *newline]
    return ids
