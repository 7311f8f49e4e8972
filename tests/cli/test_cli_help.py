"""Help texts are built from the facts they name: registries, the decoder's formats, default workers."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from retrieval.cli.main import main
from retrieval.data import DATASETS
from retrieval.data.decode import DEFAULT_MAX_PIXELS
from retrieval.data.formats import IMAGE_EXTENSIONS
from retrieval.losses.registry import LOSSES, NEGATIVES
from retrieval.models.backbones import BACKBONES
from retrieval.serve.defaults import DEFAULT_HOST, DEFAULT_PORT
from retrieval.utils.workers import DECODE_THREADS_TEXT


def help_text(*command: str) -> str:
    result = CliRunner().invoke(main, [*command, "--help"], terminal_width=110)
    assert result.exit_code == 0, result.output
    return re.sub(r"\s+", " ", re.sub(r"(?<=\w)-\n\s+", "-", result.output))  # undo click's wrapping (also at a -)


def names(text: str) -> set[str]:
    return set(re.findall(r"[\w:<>-]+", text))


@pytest.mark.parametrize("option,registry", [
    ("--dataset", DATASETS), ("--backbone", BACKBONES), ("--loss", LOSSES), ("--negatives", NEGATIVES),
])
def test_train_help_names_every_registered_name(option, registry):
    text = help_text("train")
    shown = text[text.index(f"{option} NAME"):][:600]
    assert registry.names() and set(registry.names()) <= names(shown), shown


def test_index_help_names_the_decoders_extensions_and_limits():
    text = help_text("index", "build")
    assert {extension.lstrip(".") for extension in IMAGE_EXTENSIONS} <= names(text.replace("/", " "))
    assert f"[default: {DEFAULT_MAX_PIXELS:,}]" in text and f"[default: {DECODE_THREADS_TEXT}]" in text


def test_help_texts_import_no_registry_until_shown():
    """The registries' modules import torch: an option's help is only computed when ``--help`` shows it."""
    code = ("import sys, retrieval.cli.help_text, retrieval.cli.index, retrieval.utils.workers; "
            "print(sorted(m for m in ('torch', 'PIL', 'retrieval.losses', 'retrieval.models') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_serve_and_demo_bind_the_one_default_host_and_port(command):
    text = help_text(command)
    assert f"[default: {DEFAULT_HOST}]" in text and re.search(rf"--port INTEGER.*?\[default: {DEFAULT_PORT}\b", text)
