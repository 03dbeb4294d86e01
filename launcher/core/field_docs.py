"""The documentation of a dataclass's fields, read from its source: one rule for the training
CLI (launcher.training.config) and the invoke tasks (ddp_tasks.task_params). Standard library only,
so that the tasks can use it without importing torch."""

from __future__ import annotations

import ast
import inspect


def field_docs(cls: type) -> dict[str, str]:
    """The text of each documented field of a dataclass: the string under it or ``#:`` above."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    body = ast.parse(source).body[0].body
    docs = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        following = body[i + 1] if i + 1 < len(body) else None
        if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
            continue
        comments = []
        for line in reversed(lines[:node.lineno - 1]):
            if not line.strip().startswith("#:"):
                break
            comments.insert(0, line.strip().removeprefix("#:").strip())
        if comments:
            docs[node.target.id] = " ".join(comments)
    return docs
