"""The agent's side of retrieval: documents into observation text and into turn records.

The HTTP client and its error are the server package's (`retriever_server.client`), shared
with `retriever-eval`.
"""

from __future__ import annotations


def document_summaries(docs: list[dict], text_chars: int = 600) -> list[dict]:
    """What a turn records of its search (`Turn.docs`, shown by `agent-rl view`): id, title,
    score and the first `text_chars` characters of the text (the observation has its own budget)."""
    out = []
    for doc in docs:
        title, _, text = doc.get("contents", "").partition("\n")
        out.append({"id": doc.get("id"), "title": title, "score": doc.get("score"), "text": text[:text_chars]})
    return out


def format_documents(docs: list[dict], with_ids: bool = False) -> list[str]:
    """Search-R1's passage format: `Doc i(Title: T) text`, one string per document; `with_ids`
    (the `read` tool is enabled): `Doc i(Title: T, id: ID) text`, the id that `<read>` takes."""
    out = []
    for i, doc in enumerate(docs, 1):
        contents = doc.get("contents", "")
        title, _, text = contents.partition("\n")
        out.append(
            f"Doc {i}(Title: {title}, id: {doc.get('id')}) {text}" if with_ids else f"Doc {i}(Title: {title}) {text}"
        )
    return out
