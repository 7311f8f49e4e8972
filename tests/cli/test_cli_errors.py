"""The core names its own parameters; the command line names its options.

A core function raises ``ParameterError(param, problem)`` about the parameter it was given (a loss's ``size``,
``build_index``'s ``images``); each ``retrieval`` command shows the option it fed that parameter from
(``--memory-size``, ``--images``). And no message the core raises or logs names a command-line flag.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from index_builds import load_models_as

from retrieval.cli.errors import OptionCommand
from retrieval.cli.main import main
from retrieval.errors import ParameterError

ROOT = Path(__file__).resolve().parents[2]


# --- the core: its own parameter names --------------------------------------------------------------------------
def test_the_core_names_its_parameters_not_the_flags(tmp_path):
    from retrieval.index.embedding.engine import RayOptions
    from retrieval.index.embedding.ray_engine import RayEngine
    from retrieval.index.sources import list_gallery
    from retrieval.losses import build
    from retrieval.losses.memory import CrossBatchMemory
    from retrieval.metrics.evaluation import checkpoint_dataset, load_extra_set
    from retrieval.records.run_config import RunConfig

    cases = [
        (lambda: CrossBatchMemory(build("ms"), size=0, embedding_dim=4), "size", "must be >= 1"),
        (lambda: CrossBatchMemory(build("ms"), size=4, embedding_dim=4, warmup=-1), "warmup", "must be >= 0"),
        (lambda: list_gallery(tmp_path / "nope"), "images", "does not exist"),
        (lambda: RayEngine(RayOptions(actors=0)), "actors", "must be >= 1, got 0"),
        (lambda: checkpoint_dataset(RunConfig(), None, None), "dataset", "is required"),
        (lambda: load_extra_set("no-such-set", None), "spec", "no such folder"),
        (lambda: build("proxy_anchor", negatives="loop", num_classes=4, embedding_dim=3), "negatives",
         "does not apply"),
    ]
    for call, param, problem in cases:
        with pytest.raises(ParameterError) as info:
            call()
        assert info.value.param == param and problem in info.value.problem, str(info.value)
        assert str(info.value).startswith(f"{param} ") and "--" not in str(info.value), str(info.value)


def test_a_caller_renames_the_parameter_it_passed_under_another_name(tmp_path):
    """``create_embedder(weights=)`` hands the file to ``load_backbone_weights(path)``: the error names ``weights``;
    ``asymmetric_transitions(table=)`` reads it with ``read_transitions(path)``: the error names ``table``."""
    import torch

    from retrieval.data import asymmetric_transitions
    from retrieval.models import create_embedder

    torch.save({"unrelated": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ParameterError) as info:
        create_embedder("resnet18", 8, weights=tmp_path / "other.pt")
    assert info.value.param == "weights" and "does not fit this backbone" in str(info.value)
    with pytest.raises(ParameterError) as info:
        asymmetric_transitions("folder", ["cat"], tmp_path / "missing.json")
    assert info.value.param == "table" and "names no file" in str(info.value)


# --- the command line: its own options ---------------------------------------------------------------------------
def test_the_command_line_names_the_option(tmp_path, monkeypatch):
    load_models_as(monkeypatch, lambda path, providers="auto": object())
    missing = tmp_path / "nope"
    result = CliRunner().invoke(main, ["index", "build", "--model", "m.onnx", "--images", str(missing), "--out",
                                       str(tmp_path / "idx"), "--workers", "0"])
    assert result.exit_code != 0 and f"--images {missing} does not exist" in result.output, result.output
    assert "Traceback" not in result.output


def test_a_renamed_parameter_reaches_its_option(tmp_path):
    """RayOptions' ``actors`` is the command line's ``--ray-actors``: the index commands rename it."""
    from retrieval.index.catalogue import Catalogue

    with Catalogue(tmp_path / "catalogue.sqlite"):
        pass
    result = CliRunner().invoke(main, ["index", "repair", str(tmp_path), "--engine", "ray", "--ray-actors", "0"])
    assert result.exit_code != 0 and "--ray-actors must be >= 1, got 0" in result.output, result.output


def test_evaluate_names_its_dataset_option(tmp_path):
    import torch

    from retrieval.models.checkpoint import CHECKPOINT_FORMAT

    checkpoint = tmp_path / "m.pt"
    torch.save({"format": CHECKPOINT_FORMAT, "model_config": {}, "state_dict": {}, "train_config": {}}, checkpoint)
    result = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(checkpoint)])
    assert result.exit_code != 0, result.output
    assert "--dataset is required: the checkpoint does not record its data set" in result.output, result.output


def test_backticked_parameters_in_a_message_become_the_commands_options():
    """A message about several parameters names the others in backticks; a command shows those that are its
    options as the options, and leaves other backticked text (a command to run) alone."""

    @click.command(cls=OptionCommand)
    @click.option("--index-key", "index_key")
    @click.option("--max-index-memory", "max_index_memory")
    def command(index_key, max_index_memory):
        if index_key == "file":
            raise FileExistsError("`max_index_memory` is over; see `retrieval index stats` or `other`")
        raise ParameterError("index_key", f"{index_key} is over `max_index_memory`; rerun with `index_key` auto")

    result = CliRunner().invoke(command, ["--index-key", "Flat"])
    assert result.exit_code == 1
    assert "Error: --index-key Flat is over --max-index-memory; rerun with --index-key auto" in result.output
    result = CliRunner().invoke(command, ["--index-key", "file"])
    assert result.exit_code == 1
    assert "Error: --max-index-memory is over; see `retrieval index stats` or `other`" in result.output


# --- no flag in the core's messages ------------------------------------------------------------------------------
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
LOGGERS = {"log", "logger", "_log", "LOG", "warnings"}
LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}
# Flags that are not ours: the documented commands of other tools that a message tells the user to run.
NOT_OUR_FLAGS = {
    "retrieval/index/embedding/ray_engine.py": {"--head", "--address"},  # `ray start --head`, `ray start --address=...`
    "retrieval/index/milvus/milvus_build.py": {"--data-dir"},  # `milvus-lite server --data-dir DIR`
}
# The whole command a damaged index needs: the server's logs and answers show it too, where no command line
# translates a parameter's name.
# An index whose vectors are in Milvus: the commands that search and update it, and the push into a Milvus Lite file.
WHOLE_COMMANDS = {"retrieval/index/layout.py": {"--rebuild", "--milvus", "--collection"},
                  "retrieval/index/milvus/milvus_build.py": {"--milvus", "--collection"},
                  "retrieval/index/curation/audit.py": {"--label-from"},  # an unlabelled index: the relabelling command
                  # an index searched by text with no text model (or one an upgrade turned off): the commands that
                  # train and record one (a server says them too)
                  "retrieval/text/text_index.py": {"--text-model", "--model", "--images", "--caption-column",
                                                   "--out"},
                  # a text model trained for another image model: the training that fits the index (server too)
                  "retrieval/text/text_onnx.py": {"--model", "--images", "--caption-column", "--out"}}


class MessageStrings:
    """The string literals that can end up in one module's raised or logged messages: the message expression's
    own, and those of the local variables, module constants, functions, methods and exception classes of the
    module that it uses (a message is often built by a helper)."""

    def __init__(self, tree: ast.Module) -> None:
        self.constants = {target.id: stmt.value for stmt in tree.body if isinstance(stmt, ast.Assign)
                          for target in stmt.targets if isinstance(target, ast.Name)}
        self.functions: dict[str, list[ast.AST]] = {}
        self.classes = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        self.parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, []).append(node)

    def enclosing(self, node: ast.AST) -> ast.AST | None:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    def strings(self, node: ast.AST, seen: set) -> list[str]:
        if isinstance(node, ast.Constant):
            return [node.value] if isinstance(node.value, str) else []
        found: list[str] = []
        if isinstance(node, ast.Name) and node not in seen:
            seen.add(node)
            function = self.enclosing(node)
            local = [a.value for a in ast.walk(function) if isinstance(a, (ast.Assign, ast.AnnAssign))
                     and a.value is not None and any(isinstance(t, ast.Name) and t.id == node.id
                                                     for t in (a.targets if isinstance(a, ast.Assign) else [a.target]))
                     ] if function is not None else []
            for value in local or ([self.constants[node.id]] if node.id in self.constants else []):
                found += self.strings(value, seen)
            return found
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name not in seen:
                seen.add(name)
                for function in self.functions.get(name, []):
                    for ret in ast.walk(function):
                        if isinstance(ret, ast.Return) and ret.value is not None:
                            found += self.strings(ret.value, seen)
                if name in self.classes:  # an exception class that writes its own message
                    init = [f for f in self.classes[name].body if isinstance(f, ast.FunctionDef)
                            and f.name == "__init__"]
                    for call in (c for f in init for c in ast.walk(f) if isinstance(c, ast.Call)):
                        found += [s for arg in [*call.args, *(k.value for k in call.keywords)]
                                  for s in self.strings(arg, seen)]
        for child in ast.iter_child_nodes(node):
            found += self.strings(child, seen)
        return found

    def messages(self, tree: ast.Module):
        """(line, text) of every string a raise or a logging call of the module can show."""
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                target = node.exc
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in LOG_METHODS and isinstance(node.func.value, ast.Name)
                  and node.func.value.id in LOGGERS):
                target = node
            else:
                continue
            for text in self.strings(target, set()):
                yield node.lineno, text


def flags_in_core_messages(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "retrieval").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        allowed = set(NOT_OUR_FLAGS.get(relative, set()))
        for pattern, flags in WHOLE_COMMANDS.items():
            if Path(relative).match(pattern):
                allowed |= flags
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for line, text in MessageStrings(tree).messages(tree):
            found += [f"{relative}:{line}: {flag}" for flag in FLAG.findall(text) if flag not in allowed]
    return sorted(set(found))


def test_no_core_message_names_a_command_line_flag():
    assert flags_in_core_messages(ROOT) == []


def test_the_check_finds_a_flag_however_the_message_is_built(tmp_path):
    package = tmp_path / "retrieval"
    package.mkdir()
    (package / "m.py").write_text(
        'import logging\nlog = logging.getLogger(__name__)\nHINT = "use --per-class 2"\n'
        'class Refused(ValueError):\n    def __init__(self, n):\n        super().__init__(f"{n} --negatives x")\n'
        'def fixes():\n    return "or --no-pretrained"\n'
        'def f(x):\n'
        '    rest = f"; give --ids {x}"\n'
        '    if x: raise ValueError(f"bad {x}; {HINT}{rest}")\n'
        '    if x is None: raise RuntimeError("a " + fixes())\n'
        '    if x == 1: raise Refused(x)\n'
        '    log.warning("%s over --max-query-ms", x)\n'
        '    raise ValueError("a range 1--2 and --")\n'
    )
    found = flags_in_core_messages(tmp_path)
    assert {line.split(": ", 1)[1] for line in found} == {
        "--per-class", "--ids", "--no-pretrained", "--negatives", "--max-query-ms"}, found


def test_a_caller_names_the_core_parameter_by_its_own_name():
    from retrieval.errors import ParameterError, parameters_named

    with pytest.raises(ParameterError, match="^memory_size must be >= 1") as caught:
        with parameters_named(size="memory_size"):
            raise ParameterError("size", "must be >= 1 embeddings, got 0")
    assert caught.value.param == "memory_size"
    with pytest.raises(ParameterError, match="^other "):  # a name it was not told about stays
        with parameters_named(size="memory_size"):
            raise ParameterError("other", "is wrong")


def test_train_names_the_option_of_a_core_error_raised_while_the_run_is_built(tmp_path):
    """The label-noise table is read by the core (its parameter ``table``); `retrieval train` shows the option."""
    result = CliRunner().invoke(main, [
        "train", "--dataset", "digits", "--label-noise", "asymmetric:0.2", "--label-noise-transitions",
        str(tmp_path / "missing.json"), "--no-pretrained", "--freeze-backbone", "--epochs", "1",
        "--out", str(tmp_path / "run")])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: --label-noise-transitions ") and "names no file" in result.output, \
        result.output


def test_search_with_another_model_names_the_command_that_upgrades_the_index(artifacts, tmp_path):
    from embedders import write_projection_onnx

    other = write_projection_onnx(tmp_path / "other.onnx", seed=5)
    result = CliRunner().invoke(main, ["search", "--index", str(artifacts.index_dir), "--model", str(other),
                                       str(artifacts.query_paths[0])])
    assert result.exit_code == 1, result.output
    upgrade = f"retrieval index upgrade {artifacts.index_dir} --model {other}"
    assert "not comparable" in result.output and upgrade in result.output, result.output


def test_train_shows_the_samplers_parameters_as_its_options(tmp_path):
    """The sampler names its parameters (`samples_per_class`, `drop_small`); `retrieval train` shows the flags."""
    result = CliRunner().invoke(main, [
        "train", "--dataset", "digits", "--per-class", "400", "--batch-size", "800", "--no-pretrained",
        "--freeze-backbone", "--epochs", "1", "--out", str(tmp_path / "run")])
    assert result.exit_code == 1, result.output
    assert "fewer than 400 samples" in result.output, result.output
    assert "pass --drop-small" in result.output and "lower --per-class" in result.output, result.output
