"""Chat data that exists on every machine: docstrings of the Python standard library, read with `ast`.

Each docstring becomes a conversation (the user asks about a function or class, the assistant answers with its
docstring). Modules split into two domains by first letter (a-m: A, n-z: B), so token frequencies differ the way
they do between an old and a new target's training data.
"""
from __future__ import annotations

import ast
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

QUESTIONS = ("What does `{name}` do?", "Explain `{name}` from the {module} module.", "How do I use `{name}`?")


@dataclass(frozen=True)
class Docstring:
    module: str
    name: str
    text: str

    @property
    def domain(self) -> str:
        return "a" if self.module[:1].lower() <= "m" else "b"


def stdlib_docstrings(min_chars: int = 40, max_chars: int = 1500) -> Iterator[Docstring]:
    """Docstrings of the stdlib's top-level modules' functions and classes, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                text = ast.get_docstring(node)
                if text and min_chars <= len(text) <= max_chars:
                    yield Docstring(path.stem, node.name, text)


def as_conversation(doc: Docstring, index: int) -> dict:
    question = QUESTIONS[index % len(QUESTIONS)].format(name=f"{doc.module}.{doc.name}", module=doc.module)
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": doc.text}]}


def write_jsonl(rows: list[dict], path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)
    return path
