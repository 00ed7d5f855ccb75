"""Chat data that exists on every machine: docstrings of the Python standard library, read with `ast`.

Each docstring becomes a conversation (the user asks about a function or class, the assistant answers with its
docstring). Modules split into two domains by first letter (a-m: A, n-z: B), so token frequencies differ the way
they do between an old and a new target's training data. A docstring heavy in code (doctests, calls) is asked for
in a code question ("Show `x` in code."), a prose one in a prose question, so a target trained on the chats
learns to answer a code question with code: the eval sets then differ in what the target writes, as a real
model's workloads do (chat and code), not only in what the reference answers would have been.
"""
from __future__ import annotations

import ast
import json
import os
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

PROSE_QUESTIONS = ("What does `{name}` do?", "Explain `{name}` from the {module} module.", "How do I use `{name}`?")
CODE_QUESTIONS = ("Show `{name}` in code.", "Give code examples of `{name}` from the {module} module.",
                  "Write the doctests of `{name}`.")
CODE_MARKS = "()[]{}=_:,'\"<>*"


@dataclass(frozen=True)
class Docstring:
    module: str
    name: str
    text: str

    @property
    def domain(self) -> str:
        return "a" if self.module[:1].lower() <= "m" else "b"

    @property
    def heavy_in_code(self) -> bool:
        """Doctests, or dense with code punctuation (more than 5% of its characters: the top quarter)."""
        return ">>>" in self.text or sum(char in CODE_MARKS for char in self.text) > 0.05 * len(self.text)


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
    questions = CODE_QUESTIONS if doc.heavy_in_code else PROSE_QUESTIONS
    question = questions[index % len(questions)].format(name=f"{doc.module}.{doc.name}", module=doc.module)
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": doc.text}]}


def words_reversed(text: str, tokenizer=None) -> str:
    """The text's words and the whitespace runs between them in reverse order: every character kept, so the
    tokens stay the world's while each continuation from one word to the next runs the other way."""
    return "".join(reversed(re.split(r"(\s+)", text)))


def tokens_reversed(text: str, tokenizer) -> str:
    """The text's tokens in reverse order, decoded: the same tokens (as near as BPE re-encodes them), every
    continuation, inside a word too, the other way."""
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[::-1])


def words_substituted(text: str, tokenizer) -> str:
    """The text with every whole-word token swapped for another by a fixed permutation (a substitution cipher):
    the same sentences' shape, punctuation and word pieces, but each word the vocabulary holds whole written as
    another, so what a drafter learned follows a word is the wrong word."""
    cipher = word_cipher(tokenizer)
    return tokenizer.decode([cipher.get(token, token) for token in tokenizer.encode(text, add_special_tokens=False)])


def word_cipher(tokenizer) -> dict[int, int]:
    """A permutation of the tokenizer's whole-word ids (a space, then letters, re-encoded to that one id), drawn
    with a fixed seed from the sorted ids: the same vocabulary gives the same cipher. Kept on the tokenizer, so every
    chat of a world is written with one cipher made once."""
    cipher = getattr(tokenizer, "_regraft_word_cipher", None)
    if cipher is None:
        words = sorted(token for token in tokenizer.get_vocab().values() if _whole_word(tokenizer, token))
        shuffled = words[:]
        random.Random(0).shuffle(shuffled)
        cipher = dict(zip(words, shuffled))
        tokenizer._regraft_word_cipher = cipher
    return cipher


def _whole_word(tokenizer, token: int) -> bool:
    text = tokenizer.decode([token])
    return bool(re.fullmatch(r" [A-Za-z]+", text)) and tokenizer.encode(text, add_special_tokens=False) == [token]


STYLES = {"words_reversed": words_reversed, "tokens_reversed": tokens_reversed,  # WorldConfig.b_style, but same
          "words_substituted": words_substituted}


def in_style(messages: list[dict], style: str, tokenizer=None) -> list[dict]:
    """A chat with its assistant turns written in `style` (WorldConfig.b_style); tokens_reversed needs the
    world's tokenizer."""
    if style == "same":
        return messages
    write = STYLES[style]
    return [{**m, "content": write(m["content"], tokenizer)} if m["role"] == "assistant" else m for m in messages]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)
    return path


SKIPPED_PACKAGES = ("test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "__pycache__")


def stdlib_source_files() -> list[Path]:
    """The stdlib's .py files, packages included (no tests, no IDLE), in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in SKIPPED_PACKAGES]  # never walk site-packages
        files.extend(Path(folder) / name for name in names if name.endswith(".py"))
    return sorted(files)


def file_docstrings(path: Path, min_chars: int = 40, max_chars: int = 1500) -> list[Docstring]:
    """Docstrings of one stdlib file's functions and classes (nested ones too), in source order; `module` is the
    dotted name, so the domain follows the top-level package."""
    root = Path(sysconfig.get_paths()["stdlib"])
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    module = ".".join(part for part in path.relative_to(root).with_suffix("").parts if part != "__init__")
    found, pending = [], list(reversed(tree.body))
    while pending:  # expressions skipped: a def or class never sits inside one
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            text = ast.get_docstring(node)
            if text and min_chars <= len(text) <= max_chars:
                found.append(Docstring(module, node.name, text))
        pending.extend(reversed([child for child in ast.iter_child_nodes(node) if not isinstance(child, ast.expr)]))
    return found
