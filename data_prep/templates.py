"""Prompt templates: Search-R1's base template (verbatim) and a chat variant.

The chat variant sends the same instruction as one user message through the tokenizer's chat
template, for instruct models.
"""

from __future__ import annotations

BASE_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query </search> "
    "and it will "
    "return the top searched results between <information> and </information>. You can search as many times as your "
    "want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> and "
    "</answer>, without "
    "detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
# The toy world's prompt: the same protocol in ~25 tokens instead of ~100, so the CPU demo spends
# its compute on the search turns, not on re-reading a long fixed instruction.
COMPACT_TEMPLATE = "Search with <search> query </search>, answer with <answer> answer </answer>. Question: {question}\n"
TEMPLATES = ("base", "chat", "compact", "auto")


def normalize_question(question: str) -> str:
    """Strip and append '?' when the question lacks one (as Search-R1's data scripts do)."""
    q = question.strip()
    return q if q.endswith("?") else q + "?"


def render_prompt(question: str, template: str = "base", tokenizer=None) -> str:
    """`auto` is `chat` when the tokenizer has a chat template (instruct models), else `base`."""
    if template == "auto":
        template = "chat" if tokenizer is not None and getattr(tokenizer, "chat_template", None) else "base"
    if template == "base":
        return BASE_TEMPLATE.format(question=question)
    if template == "compact":
        return COMPACT_TEMPLATE.format(question=question)
    if template == "chat":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("--template chat needs --tokenizer PATH with a chat template")
        content = BASE_TEMPLATE.format(question=question).rstrip("\n")
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
    raise ValueError(f"unknown template {template!r}; choose one of {TEMPLATES}")
