"""Find every shell command and Python snippet that the README, docs/*.md and the scripts' docstrings show.

Used by tests/test_docs.py. What counts as a command:

* a fenced block tagged ``bash`` / ``sh`` / ``shell`` / ``console``: every line (``\\`` continuations
  joined, a ``$ `` prompt dropped) is one command; an untagged fence whose lines all start like a
  command is read the same way;
* a fenced block tagged ``python`` / ``py``: one Python snippet;
* an indented (4-space) code block in the Markdown: its lines that start like a command;
* an inline code span that starts like a command (``python ...``, ``torchrun ...``, ``pip ...``,
  ``bash ...``, ``VAR=value python ...``); a span may wrap onto the next source line;
* a fenced or indented block holding ``$ `` lines (a transcript): those lines are the commands, the
  others are output;
* in a module docstring of launch/*.py, launch/examples/*.py or docs/*.py: its indented lines that
  start like a command.

A command's key is its text with the trailing comment dropped and whitespace collapsed, so the
table in tests/test_docs.py survives re-wrapping and edits elsewhere in the file, and a changed flag
needs a new decision. A Python block's key is its first line that is not a comment (numbered when
two blocks of a file open alike).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

SHELL_TAGS = {"bash", "sh", "shell", "console", "zsh"}
PYTHON_TAGS = {"python", "py", "python3"}
COMMAND = re.compile(r"^(?:[A-Z][A-Z0-9_]*=\S*\s+)*(?:python3?|torchrun|pip3?|bash|sh|uv|\.ci/run|\./\S+|make|git|deepspeed)(?:\s|$)")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


@dataclass(frozen=True)
class Snippet:
    """One documented command (``kind == "shell"``) or Python block (``kind == "python"``)."""

    file: str  # path relative to the repository root
    line: int  # 1-based line where it starts
    kind: str
    text: str  # shell: the command as written (continuations joined); python: the block
    nth: int = 1  # python: 2 for the second block of the file that opens with the same line, ...

    @property
    def key(self) -> str:
        """What tests/test_docs.py's table is keyed by (with the file)."""
        if self.kind == "python":
            first = next((l.strip() for l in self.text.splitlines() if l.strip() and not l.strip().startswith("#")), "")
            return first if self.nth == 1 else f"{first}  (#{self.nth})"
        return normalize(self.text)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def strip_comment(command: str) -> str:
    """The command without a trailing ``# comment`` (a ``#`` outside quotes that follows a blank)."""
    quote = None
    for i, ch in enumerate(command):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip()
    return command.rstrip()


def normalize(command: str) -> str:
    return " ".join(strip_comment(command).split())


def is_command(text: str) -> bool:
    return bool(COMMAND.match(text.strip().removeprefix("$ ")))


def shell_lines(lines: list[str], first_line: int) -> list[tuple[int, str]]:
    """(line number, command) for each command of a shell block; ``\\`` continuations joined."""
    out, pending, start = [], "", 0
    for offset, raw in enumerate(lines):
        text = raw.strip()
        if not pending:
            if not text or text.startswith("#"):
                continue
            start = first_line + offset
            text = text.removeprefix("$ ")
        body = strip_comment(text)
        if body.endswith("\\"):
            pending += body[:-1].rstrip() + " "
            continue
        out.append((start, (pending + text).strip()))
        pending = ""
    if pending:
        out.append((start, pending.strip()))
    return out


def prompted_lines(lines: list[str], first_line: int) -> list[tuple[int, str]]:
    """(line number, command) for each ``$ `` line of a transcript (with its ``\\`` continuations)."""
    out = []
    for offset, raw in enumerate(lines):
        if raw.strip().startswith("$ "):
            rest = [raw] + list(lines[offset + 1:])
            n = 1
            while n < len(rest) and strip_comment(rest[n - 1].strip()).endswith("\\"):
                n += 1
            out += shell_lines(rest[:n], first_line + offset)[:1]
    return out


def from_markdown(path: Path, rel: str) -> list[Snippet]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Snippet] = []
    prose: list[tuple[int, str]] = []  # (line number, text) of lines outside code blocks, for inline spans
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            fence, tag = m.group(2), m.group(3).lower()
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                j += 1
            body = lines[i + 1:j]
            prompted = [l for l in body if l.strip().startswith("$ ")]
            if tag in PYTHON_TAGS:
                found.append(Snippet(rel, i + 2, "python", "\n".join(body) + "\n"))
            elif prompted and tag not in PYTHON_TAGS:  # a transcript: the `$ ` lines are the commands, the rest output
                found += [Snippet(rel, n, "shell", c) for n, c in prompted_lines(body, i + 2)]
            elif tag in SHELL_TAGS or (not tag and body and all(is_command(l) for l in body if l.strip())):
                found += [Snippet(rel, n, "shell", c) for n, c in shell_lines(body, i + 2)]
            i = j + 1
            continue
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            block = lines[i:j]
            if any(l.strip().startswith("$ ") for l in block):
                cmds = prompted_lines(block, i + 1)
            else:
                cmds = [(n, c) for n, c in shell_lines(block, i + 1) if is_command(c)]
            found += [Snippet(rel, n, "shell", c) for n, c in cmds]
            i = j
            continue
        prose.append((i + 1, lines[i]))
        i += 1
    # Inline spans may wrap: join each paragraph of prose, remembering where each character came from.
    text, where = "", []
    for n, line in prose:
        text += line + "\n"
        where += [n] * (len(line) + 1)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        span = " ".join(m.group(1).split())
        if "\n\n" not in m.group(1) and is_command(span):
            found.append(Snippet(rel, where[m.start()], "shell", span))
    found.sort(key=lambda s: s.line)
    # Two Python blocks of one file may open alike (``from fm_parallel import masks``): number them.
    seen: dict[str, int] = {}
    for index, s in enumerate(found):
        if s.kind == "python":
            seen[s.key] = seen.get(s.key, 0) + 1
            if seen[s.key] > 1:
                found[index] = Snippet(s.file, s.line, s.kind, s.text, seen[s.key])
    return found


def from_docstring(path: Path, rel: str) -> list[Snippet]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree, clean=False)
    if not doc:
        return []
    first = tree.body[0].lineno  # the docstring's opening line; its text starts on that line
    lines = doc.splitlines()
    found = []
    for n, command in shell_lines([l for l in lines], first):
        if is_command(command) and lines[n - first].startswith("    "):
            found.append(Snippet(rel, n, "shell", command))
    return found


def documented_snippets(root: Path) -> list[Snippet]:
    """Every snippet of README.md, docs/*.md and the docstrings of launch/*.py, launch/examples/*.py and
    docs/*.py, in file order."""
    out: list[Snippet] = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        out += from_markdown(path, path.relative_to(root).as_posix())
    for path in [*sorted((root / "launch").glob("*.py")), *sorted((root / "launch" / "examples").glob("*.py")),
                 *sorted((root / "docs").glob("*.py"))]:
        out += from_docstring(path, path.relative_to(root).as_posix())
    return out
