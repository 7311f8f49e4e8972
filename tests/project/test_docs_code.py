"""Every fenced code block of docs/*.md runs or parses, so that a page never shows a command or file that fails.

By the block's language: ``python`` is compiled and, unless its fence says ``no-run`` (```python no-run), run in a
fresh interpreter in an empty folder, offline; ``bash``/``sh``/``shell`` pass ``bash -n``, and in them (and in the
``$ ``-lines of ``console``) each ``retrieval ...`` command (also as ``python -m retrieval``, ``.venv/bin/retrieval``
or under ``torchrun ... -m retrieval``) parses with the real command line (``command_context``: the subcommand
exists, its options and values are accepted; nothing runs), each ``make X`` names a target of the Makefile, and each
``python -c`` program and Python here-document compiles; ``json``, ``yaml`` and ``toml`` parse (a TOML block is a
training config, the only TOML file the toolkit reads: its keys make a valid ``TrainConfig``). A block without a
language is checked as shell when it starts with a command, else it is text (a listing, a log) and is left alone.
Scripts and modules of this repository that a command runs (``python benchmarks/x.py``) must exist. And no page of
docs/ (nor the README) speaks of the work that made the project ("issue N", "not re-run").
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import tomllib
from doc_commands import command_context

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))

SHELL = {"bash", "sh", "shell", "zsh"}
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
# programs an untagged block may start with (or any path to a program): such a block is shell
PROGRAMS = {"retrieval", "python", "python3", "pip", "bash", "sh", "make", "curl", "torchrun", "ray", "sudo", "git",
            "docker", "cd", "export", "uvicorn", "nginx", "cp", "rm", "mkdir", "echo", "ls", "cat", "tar"}
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")
OPERATORS = {"&&", "||", ";", "|", "&", ";;", "(", ")", "|&"}


@dataclass
class Block:
    page: str
    line: int  # of the opening fence
    language: str
    info: str
    code: str

    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.language or 'no language'})"


def code_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, their indentation (a fence inside a list item) removed."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, info = opening["indent"], opening["fence"], opening["info"].strip()
        closing = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body, j = [], i + 1
        while j < len(lines) and not closing.match(lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        language = info.split()[0].lower() if info else ""
        blocks.append(Block(path.name, i + 1, language, info, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


# --- shell ---------------------------------------------------------------------------------------------------------
def _tokens(line: str) -> list[str] | None:
    """A shell line's words and operators (``&&``, ``|``, ``>``), comments dropped; None while a quote is open."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:
        return None


def shell_commands(code: str) -> tuple[list[list[str]], list[str]]:
    """(the simple commands of a shell block as word lists, the bodies of its here-documents). Continuations are
    joined, comments dropped, ``a && b | c`` split into its commands and leading ``VAR=value`` words removed."""
    commands, heredocs = [], []
    lines = code.replace("\\\n", " ").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        marker = HEREDOC.search(line)
        if marker:  # the here-document's body is data for the command, not shell
            body = []
            while i < len(lines) and lines[i].strip() != marker[2]:
                body.append(lines[i])
                i += 1
            i += 1
            heredocs.append("\n".join(body) + "\n")
            line = line[:marker.start()]
        tokens = _tokens(line)
        while tokens is None and i < len(lines):  # a quoted string goes on over lines
            line += "\n" + lines[i]
            i += 1
            tokens = _tokens(line)
        words: list[str] = []
        for token in [*(tokens or []), ";"]:
            if token in OPERATORS or set(token) <= set("<>&|;"):
                while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                    words.pop(0)
                if words:
                    commands.append(words)
                words = []
            else:
                words.append(token)
    return commands, heredocs


def python_runs(words: list[str]) -> tuple[str, str] | None:
    """What ``python ...`` (or ``torchrun ...``) runs: ("module", name), ("script", path), ("code", program) or
    ("stdin", "-"); None for another program."""
    program = Path(words[0]).name if words else ""
    if not re.fullmatch(r"python[0-9.]*|torchrun", program):
        return None
    k = 1
    while k < len(words):
        word = words[k]
        if word in ("-m", "-c") and k + 1 < len(words):
            return ("module" if word == "-m" else "code"), words[k + 1]
        if word == "-":
            return "stdin", word
        if program != "torchrun" and not word.startswith("-"):
            return "script", word
        k += 2 if word in ("-X", "-W") else 1  # python options with a value
    return None


def retrieval_args(words: list[str]) -> list[str] | None:
    """The arguments of a ``retrieval`` invocation (direct, ``python -m retrieval``, under torchrun), else None."""
    while words and words[0] in ("sudo", "time", "nohup", "exec"):
        words = words[1:]
    if words and Path(words[0]).name == "retrieval":
        return words[1:]
    if python_runs(words) == ("module", "retrieval"):
        return words[words.index("retrieval", words.index("-m")) + 1:]
    return None


def missing_file(words: list[str]) -> str | None:
    """The script (``python benchmarks/x.py``, ``bash benchmarks/x.sh``) or module (``python -m deploy.x``) of this
    repository that a command runs and the repository lacks; None when it has it or the command runs none of it."""
    runs = python_runs(words)
    if runs and runs[0] == "module":
        module = runs[1].replace(".", "/")
        if not (ROOT / module.split("/")[0]).is_dir():
            return None  # an installed module (pytest, pip), not one of this repository's
        return None if (ROOT / f"{module}.py").is_file() or (ROOT / module).is_dir() else runs[1]
    if runs and runs[0] == "script":
        target = runs[1]
    elif Path(words[0]).name in ("bash", "sh"):
        target = next((w for w in words[1:] if not w.startswith("-")), None)
    else:
        return None
    if target is None or "$" in target or target.startswith(("/", "~")):
        return None  # another checkout's or machine's file
    return None if (ROOT / target).exists() else target


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return {name for names in re.findall(r"^([\w./ -]+?)\s*:(?!=)", text, re.MULTILINE) for name in names.split()}


def check_shell(block: Block, code: str) -> list[str]:
    problems = []
    syntax = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True, timeout=30)
    if syntax.returncode:
        problems.append(f"{block.where()}: bash -n: {syntax.stderr.strip()}")
    commands, heredocs = shell_commands(code)
    for words in commands:
        line = shlex.join(words)
        args = retrieval_args(words)
        if args is not None:
            try:
                command_context(args)
            except click.exceptions.Exit:
                pass  # --help, --version
            except (click.ClickException, ValueError) as exc:
                message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
                problems.append(f"{block.where()}: `{line}`: {message}")
        elif Path(words[0]).name == "make":
            targets = [t for t in words[1:] if not t.startswith("-") and "=" not in t and t not in make_targets()]
            if targets:
                problems.append(f"{block.where()}: `{line}`: no Makefile target {', '.join(targets)}")
        missing = missing_file(words)
        if missing:
            problems.append(f"{block.where()}: `{line}`: {missing} is not in the repository")
        runs = python_runs(words)
        if runs and runs[0] == "code":
            problems += compile_problems(block, runs[1], f"`{line[:60]}...`")
    for body in heredocs:
        if re.search(r"^\s*(import|from)\s+\w+", body, re.MULTILINE):  # a Python program fed to python -
            problems += compile_problems(block, body, "here-document")
    return problems


# --- the other languages -------------------------------------------------------------------------------------------
def compile_problems(block: Block, code: str, what: str = "") -> list[str]:
    try:
        ast.parse(code)
    except SyntaxError as exc:
        return [f"{block.where()}: {what + ': ' if what else ''}{exc.msg} (line {exc.lineno} of the block)"]
    return []


def check_python(block: Block, tmp_path: Path) -> list[str]:
    problems = compile_problems(block, block.code)
    if problems or "no-run" in block.info.split():
        return problems
    done = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={"RETRIEVAL_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    return [f"{block.where()}: runs with exit status {done.returncode}: {done.stderr[-500:]}"] if done.returncode \
        else []


def check_toml(block: Block, tmp_path: Path) -> list[str]:
    from retrieval.train.config import TrainConfig, load_config_file

    try:
        tomllib.loads(block.code)
    except tomllib.TOMLDecodeError as exc:
        return [f"{block.where()}: {exc}"]
    path = tmp_path / "block.toml"
    path.write_text(block.code, encoding="utf-8")
    try:
        TrainConfig.from_values(load_config_file(path))
    except (ValueError, TypeError) as exc:
        return [f"{block.where()}: not a valid training config: {exc}"]
    return []


def check_data(block: Block) -> list[str]:
    try:
        if block.language == "json":
            json.loads(block.code)
        else:
            yaml = pytest.importorskip("yaml")
            yaml.safe_load(block.code)
    except Exception as exc:  # json's and yaml's own errors: the message says where
        return [f"{block.where()}: {type(exc).__name__}: {exc}"]
    return []


def starts_with_command(code: str) -> bool:
    """Whether a block's first line (past comments and ``VAR=value`` words) starts with a program."""
    first = next((line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")), "")
    try:
        words = shlex.split(first, comments=True)
    except ValueError:
        return False
    words = [w for w in words if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w)]
    return bool(words) and ("/" in words[0] or "$" in words[0] or words[0] in PROGRAMS)


def console_code(code: str) -> str:
    """The commands of a console transcript (its ``$ `` lines and their continuations); the rest is output."""
    lines, keep = [], False
    for line in code.splitlines():
        if line.startswith("$ "):
            lines.append(line[2:])
        elif keep:
            lines.append(line)
        else:
            continue
        keep = line.endswith("\\")
    return "\n".join(lines) + "\n"


def problems_of(block: Block, tmp_path: Path) -> list[str]:
    """What is wrong with one block (nothing: an empty list)."""
    language = block.language
    if language == "python":
        return check_python(block, tmp_path)
    if language in SHELL:
        return check_shell(block, block.code)
    if language == "console":
        return check_shell(block, console_code(block.code))
    if language == "toml":
        return check_toml(block, tmp_path)
    if language in ("json", "yaml", "yml"):
        return check_data(block)
    if language == "":
        return check_shell(block, block.code) if starts_with_command(block.code) else []
    return []  # text, a listing, output


@pytest.mark.parametrize("page", DOCS, ids=lambda page: page.name)
def test_every_code_block_runs_or_parses(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a command that would write (it does not run) or a program that runs stays here
    problems = [problem for block in code_blocks(page) for problem in problems_of(block, tmp_path)]
    assert not problems, "\n".join(problems)


# words of the work that made the project, not of the project: a page states what is, in the present tense
HISTORY = re.compile(r"\bissues? \d+|\blent\b|\bthis (?:round|session)\b|\btickets?\b|\bnot re-run\b|"
                     r"\bre-run since\b", re.IGNORECASE)


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=lambda page: page.name)
def test_pages_speak_of_the_project_not_its_history(page):
    found = [(n, m[0]) for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             for m in HISTORY.finditer(line)]
    assert not found, f"{page.name}: {found}"


# --- the checks check ----------------------------------------------------------------------------------------------
def test_blocks_are_found_with_their_language(tmp_path):
    page = tmp_path / "PAGE.md"
    page.write_text("text\n\n```bash\nretrieval --help\n```\n\n- item\n\n  ```toml\n  epochs = 3\n  ```\n\n"
                    "````\n```\n````\n", encoding="utf-8")
    blocks = code_blocks(page)
    assert [(b.language, b.line, b.code) for b in blocks] == [("bash", 3, "retrieval --help\n"),
                                                              ("toml", 9, "epochs = 3\n"), ("", 13, "```\n")]


def test_shell_commands_split_and_find_retrieval():
    code = ("OMP_NUM_THREADS=1 .venv/bin/retrieval index stats idx && make lint  # a comment\n"
            "torchrun --nproc-per-node 2 -m retrieval train \\\n  --epochs 1 &\n"
            ".venv/bin/python - <<'EOF'\nimport sys\nprint(sys.argv)\nEOF\npython benchmarks/x.py -m retrieval\n")
    commands, heredocs = shell_commands(code)
    assert commands == [[".venv/bin/retrieval", "index", "stats", "idx"], ["make", "lint"],
                        ["torchrun", "--nproc-per-node", "2", "-m", "retrieval", "train", "--epochs", "1"],
                        [".venv/bin/python", "-"], ["python", "benchmarks/x.py", "-m", "retrieval"]]
    assert heredocs == ["import sys\nprint(sys.argv)\n"]
    assert [retrieval_args(c) for c in commands] == [["index", "stats", "idx"], None, ["train", "--epochs", "1"],
                                                     None, None]
    assert shell_commands("python -c 'import sys\nprint(1)' && make test\n")[0] == [
        ["python", "-c", "import sys\nprint(1)"], ["make", "test"]]
    assert retrieval_args(["python3", "-X", "importtime", "-m", "retrieval", "search", "-k", "3"]) == ["search", "-k",
                                                                                                    "3"]


@pytest.mark.parametrize(("language", "code", "found"), [
    ("bash", "retrieval train --no-such-option 1\n", "No such option"),
    ("bash", "retrieval no-such-command\n", "No such command"),
    ("bash", "retrieval search --index idx q.jpg -k 0\n", "-k"),
    ("bash", "make no-such-target\n", "no Makefile target"),
    ("bash", ".venv/bin/python -X importtime benchmarks/no_such.py --x\n", "benchmarks/no_such.py is not in"),
    ("bash", "python -m deploy.no_such --run\n", "deploy.no_such is not in"),
    ("bash", "if then fi (\n", "bash -n"),
    ("bash", "python -c 'print(('\n", "python -c"),
    ("console", "$ retrieval index nope\nNo such command\n", "No such command"),
    ("json", '{"a": 1,}\n', "JSONDecodeError"),
    ("toml", "epochs = \n", "Invalid"),
    ("toml", "no_such_option = 3\n", "unknown training option"),
    ("python", "print(\n", "was never closed"),
    ("python", "raise SystemExit(3)\n", "exit status 3"),
    ("", "retrieval no-such-command\n", "No such command"),
])
def test_a_broken_block_is_reported(language, code, found, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    problems = problems_of(Block("PAGE.md", 1, language, language, code), tmp_path)
    assert problems and found in problems[0], problems


@pytest.mark.parametrize(("language", "code"), [
    ("bash", "retrieval train --dataset digits --epochs 1 --out runs/x\nretrieval index build --help\nmake test\n"
             "python -m deploy.nginx_local --run\npython -m pytest -q\nbash benchmarks/$X.sh\n"),
    ("console", "$ retrieval --version\nretrieval, version 0.1.0\n"),
    ("", "folder    job\nretrieval/ the library\n"),
    ("python no-run", "import no_such_module\n"),
    ("toml", 'dataset = "digits"\nepochs = 2\n[loss]\nname = "ms"\n'),
])
def test_a_good_block_passes(language, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    block = Block("PAGE.md", 1, language.split()[0] if language else "", language, code)
    assert problems_of(block, tmp_path) == []
