"""Each training option is declared once (``TrainConfig``'s fields); the command line, the config file, the checks
and the docs' table are made from the declaration, and every flag the package prints exists."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import typing
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from retrieval.cli.doc_tables import markers, options_markdown, reference_tables
from retrieval.cli.main import main
from retrieval.options import declared_options, hint_members
from retrieval.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
DECLARED = declared_options(TrainConfig)
COMMAND_ONLY = {"config_file", "nproc", "max_restarts", "as_json", "offline"}  # how to run, not what
# flags of other programs that our messages tell people to run (torchrun, ray, tensorboard, mlflow, autofaiss,
# milvus-lite)
OTHER_PROGRAMS = {"--nproc-per-node", "--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--standalone", "--address",
                  "--head", "--logdir", "--backend-store-uri", "--embeddings", "--metric", "--data-dir"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w{*-])")


@pytest.fixture
def captured_train(monkeypatch) -> list[TrainConfig]:
    """`retrieval train` with a train() that only records the configuration it was given."""
    import retrieval.train

    configs: list[TrainConfig] = []
    monkeypatch.setattr(retrieval.train, "train", lambda cfg: configs.append(cfg))
    return configs


def test_every_field_is_declared_with_a_section_and_help():
    assert [d.name for d in DECLARED] == [f.name for f in dataclasses.fields(TrainConfig)]
    assert all(d.spec.section and d.spec.help.endswith(".") for d in DECLARED), [d.name for d in DECLARED
                                                                                  if not d.spec.help.endswith(".")]


def test_train_command_has_one_option_per_declared_field_and_nothing_else():
    params = {p.name: p for p in main.commands["train"].params}
    assert set(params) == {d.name for d in DECLARED} | COMMAND_ONLY
    for declared in DECLARED:
        assert declared.flag in params[declared.name].opts, declared.name


def _cli_samples(declared) -> list[tuple[list[str], object]]:
    """Command-line arguments that set ``declared`` to a value other than its default, and that value."""
    members = [m for m in hint_members(declared.hint) if m is not type(None)]
    flag, default, spec = declared.flag, declared.default, declared.spec
    if members == [bool]:
        return [([flag if not default else f"--no-{flag[2:]}"], not default)]
    if typing.get_origin(members[0]) is dict:
        return [([flag, "k=0.5", flag, "name=x"], {"k": 0.5, "name": "x"})]
    if typing.get_origin(members[0]) is list:
        return ([([flag, "a", flag, "b"], ["a", "b"])] if typing.get_args(members[0]) == (str,)
                else [([flag, "0.5,1"], [0.5, 1.0])])
    if set(members) == {float, str}:
        return [([flag, "0.5"], 0.5), ([flag, "auto"], "auto")]
    allowed = spec.allowed()
    if allowed is not None:
        return [([flag, value], value) for value in allowed if isinstance(value, str) and value != default]
    if spec.listing is not None:
        from retrieval.cli.config_options import LISTINGS

        names = re.findall(r"[\w:-]+", LISTINGS[spec.listing]())
        return [([flag, name], name) for name in names if name != default and name in LISTINGS[spec.listing]()][:3]
    if members[0] in (int, float):
        kind = members[0]
        low = spec.low if spec.low is not None else 0
        numbers = [(default or low) * 2, (default or 0) + 1, low + 1, (low + (spec.high or low + 1)) / 2]
        return [([flag, str(kind(n))], kind(n)) for n in numbers if kind(n) != default]
    return [([flag, text], text) for text in ("symmetric:0.2", "black", "cpu", "some-value") if text != default]


# options whose non-default value needs another option with it (a rule that relates them)
COMPANIONS = {"resume": ["--out", "RUN"],
              "sync_bn": ["--no-freeze-bn"], "wise_alpha": ["--val-fraction", "0.1"], "backbone": ["--no-pretrained"],
              "pseudo_labels": ["--labels", "none"], "eval_data": ["--labels", "none"]}


@pytest.mark.parametrize("declared", DECLARED, ids=[d.name for d in DECLARED])
def test_every_declared_option_reaches_the_config_from_the_command_line(declared, captured_train, tmp_path):
    for args, expected in _cli_samples(declared):
        companions = [tmp_path / "run" if a == "RUN" else a for a in COMPANIONS.get(declared.name, [])]
        result = CliRunner().invoke(main, ["train", *args, *map(str, companions)])
        if result.exit_code == 0:
            assert getattr(captured_train[-1], declared.name) == expected
            return
    pytest.fail(f"no sample value of {declared.flag} was accepted; last output: {result.output}")


@pytest.mark.parametrize("declared", DECLARED, ids=[d.name for d in DECLARED])
def test_every_declared_option_is_a_config_file_key(declared, tmp_path):
    """A config file may set every option by its field name; a wrong type is named by its flag."""
    path = tmp_path / "run.json"
    if declared.default is not None:
        path.write_text(json.dumps({declared.name: declared.default}))
        assert getattr(TrainConfig.from_sources(path), declared.name) == declared.default
    wrong = [1, 2] if typing.get_origin(hint_members(declared.hint)[0]) is not list else {"a": 1}
    path.write_text(json.dumps({declared.name: wrong}))
    with pytest.raises(ValueError, match=re.escape(declared.flag) + " must be"):
        TrainConfig.from_sources(path)


RANGED = [d for d in DECLARED if d.spec.low is not None or d.spec.high is not None]


@pytest.mark.parametrize("declared", RANGED, ids=[d.name for d in RANGED])
def test_a_value_outside_the_declared_range_is_refused_by_flag(declared):
    spec = declared.spec
    outside = [spec.low - 1 if spec.low is not None else None, spec.high + 1 if spec.high is not None else None,
               spec.low if spec.low_open else None, spec.high if spec.high_open else None, float("nan")]
    kind = int if int in hint_members(declared.hint) else float
    for value in outside:
        if value is None or (kind is int and value != value):
            continue
        with pytest.raises(ValueError, match=re.escape(f"{declared.flag} must be {spec.range_text()}")):
            TrainConfig(**{declared.name: kind(value)})


NUMBERS = [d for d in DECLARED if float in hint_members(d.hint)]


@pytest.mark.parametrize("declared", NUMBERS, ids=[d.name for d in NUMBERS])
def test_a_number_that_is_not_a_number_is_refused_by_flag_with_what_it_must_be(declared):
    with pytest.raises(ValueError, match=re.escape(declared.flag) + r" must be \S") as caught:
        TrainConfig(**{declared.name: float("nan")})
    assert "must be ," not in str(caught.value)


CHOOSING = [d for d in DECLARED if d.spec.choices is not None]


@pytest.mark.parametrize("declared", CHOOSING, ids=[d.name for d in CHOOSING])
def test_a_value_outside_the_declared_choices_is_refused_by_flag(declared):
    with pytest.raises(ValueError, match=re.escape(f"{declared.flag} must be one of")):
        TrainConfig(**{declared.name: "no-such-choice"})


def test_the_optimizer_and_schedule_choices_come_from_their_registries():
    from retrieval.train.optimizers import OPTIMIZERS, SCHEDULES

    choices = {d.name: d.spec.allowed() for d in DECLARED}
    assert choices["optimizer"] == OPTIMIZERS.names() and choices["schedule"] == SCHEDULES.names()
    train = {p.name: p for p in main.commands["train"].params}
    assert list(train["optimizer"].type.choices) == OPTIMIZERS.names()


@pytest.mark.parametrize("document,name,cls", reference_tables(), ids=[t[0] for t in reference_tables()])
def test_the_docs_options_tables_are_the_ones_made_from_the_declarations(document, name, cls):
    text = (ROOT / document).read_text()
    start_line, end_line = markers(name)
    start, end = text.index(start_line) + len(start_line), text.index(end_line)
    assert text[start:end].strip() == options_markdown(cls).strip(), f"{document}'s table is out of date: make docs"
    for declared in declared_options(cls):
        assert f"| `{declared.flag}` | `{declared.name}` |" in text


def test_train_and_evaluate_share_the_names_of_shared_options():
    """An option both commands have is spelled the same: `--eval-limit`, `--eval-batch-size`, `--dataset-param`."""
    flags = {opt for p in main.commands["evaluate"].params for opt in p.opts}
    assert {"--eval-limit", "--eval-batch-size", "--dataset-param", "--dataset", "--data", "--linear-probe",
            "--device", "--workers"} <= flags
    assert "--loss-param" in {opt for p in main.commands["analyze"].commands["weights"].params for opt in p.opts}


def _all_flags(command: click.Command) -> set[str]:
    flags = {opt for p in command.params for opt in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}
    for sub in getattr(command, "commands", {}).values():
        flags |= _all_flags(sub)
    return flags


def test_every_flag_the_package_prints_exists():
    """Messages, help and docstrings of the installed package name only flags some command has."""
    known = _all_flags(main) | {"--help", "--version"} | OTHER_PROGRAMS
    unknown = {}
    for folder in ("retrieval", "cli", "train", "serve", "export"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    for flag in set(FLAG.findall(node.value)) - known:
                        unknown.setdefault(flag, f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not unknown, f"flags that no command has: {unknown}"


def test_the_flag_scan_finds_a_flag_no_command_has():
    assert FLAG.findall("use --grad-clip 5, --ray-* or --no-{name}") == ["--grad-clip"]


@pytest.mark.parametrize("args,message", [
    (["--eval-limit", "0"], "must be >= 1 images, got 0"), (["--limit", "0"], "must be >= 1 images, got 0"),
    (["--eval-batch-size", "0"], "must be >= 1, got 0"), (["--workers", "-1"], "must be >= 0, got -1"),
])
def test_evaluate_checks_the_declared_range_of_the_options_it_shares(args, message, tmp_path):
    result = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(tmp_path / "none.pt"), *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_train_help_shows_the_default_of_every_option_that_has_one():
    """What a run does when an option is left out: each option with a default says it in --help."""
    from retrieval.cli.config_options import default_text

    output = CliRunner().invoke(main, ["train", "--help"], terminal_width=200).output
    entries = re.split(r"\n  (?=-)", output)  # one entry per option, from its flags to the next option's
    for declared in DECLARED:
        shown = default_text(declared)
        if shown is not None:
            entry = next(e for e in entries if re.match(re.escape(declared.flag) + r"[ /,\n]", e))
            assert f"[default: {shown}]" in re.sub(r"\s+", " ", entry), entry


# --- the commands without a config: index, search, compare, audit, analyze ------------------------------------------
# the modules of these commands: every option they put on a command is made from a declaration
DECLARING_MODULES = ("index", "index_common", "index_write", "index_upgrade", "index_inspect", "search", "curation",
                     "analyze")
FAMILY_COMMANDS = {"index build", "index add", "index remove", "index repair", "index upgrade", "index compare",
                   "index stats", "index export", "index duplicates", "index audit", "search", "compare", "audit",
                   "analyze weights", "analyze triplets"}
HAND_MADE = {"click.option", "click.Option", "lazy_help_option", "LazyHelpOption"}  # what declares one by hand


def _commands(group: click.Group, prefix: tuple[str, ...] = ()):
    """(path, command) of every command under ``group``, subgroups opened."""
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from _commands(command, (*prefix, name))
        else:
            yield " ".join((*prefix, name)), command


def _family() -> dict[str, click.Command]:
    """The commands whose functions live in ``DECLARING_MODULES``."""
    modules = {f"retrieval.cli.{name}" for name in DECLARING_MODULES}
    return {path: command for path, command in _commands(main)
            if getattr(command.callback, "__module__", None) in modules}


def test_the_commands_without_a_config_are_the_ones_checked_here():
    assert set(_family()) == FAMILY_COMMANDS


@pytest.mark.parametrize("module", DECLARING_MODULES)
def test_no_option_is_declared_by_hand_in_these_modules(module):
    """No ``click.option(...)`` nor ``lazy_help_option(...)``: each option is made from its declaration."""
    tree = ast.parse((ROOT / "cli" / f"{module}.py").read_text())
    calls = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Call) and ast.unparse(node.func) in HAND_MADE]
    assert not calls, f"cli/{module}.py declares options by hand at lines {calls}"


@pytest.mark.parametrize("path", sorted(FAMILY_COMMANDS))
def test_every_option_of_these_commands_is_made_from_a_declaration(path):
    from retrieval.cli.config_options import DeclaredClickOption

    command = _family()[path]
    hand_made = [p.opts for p in command.params if isinstance(p, click.Option) and not isinstance(
        p, DeclaredClickOption) and p.opts != ["-h", "--help"]]
    assert not hand_made, f"{path}: {hand_made}"
    assert len({p.name for p in command.params}) == len(command.params), path  # each value reaches it once


def _declaration_key(declared) -> tuple[str, str, str]:
    """What a declaration says, whatever section a config lists it under (one function declares --gallery-root for
    the index commands and for ServerConfig)."""
    return declared.spec.help_text(), repr(declared.default), repr(dataclasses.replace(declared.spec, section=""))


def test_a_flag_that_means_one_thing_is_declared_once():
    """Across the whole command line, two declarations of one flag differ in what they say (each command's --model is
    its own model); an option that means the same on several commands is one declaration, not copies of it."""
    from retrieval.cli.doc_tables import declared_params

    by_flag: dict[str, dict[tuple, list[str]]] = {}
    for path, param in declared_params(main):
        by_flag.setdefault(param.declared.flag, {}).setdefault(_declaration_key(param.declared), []).append(path)
    copies = {flag: list(meanings.values()) for flag, meanings in by_flag.items()
              if len({help_text for help_text, _default, _spec in meanings}) < len(meanings)}  # one help, two places
    assert not copies, f"declared twice with the same help: {copies}"


@pytest.mark.parametrize("flag,paths", [
    ("--workers", ["audit", "compare", "index compare"]),  # decoding threads: was declared twice
    ("--json", ["audit", "index audit", "index build", "index duplicates", "index stats"]),
    ("-k", ["audit", "index audit", "index duplicates"]),
    ("--label-from", ["index add", "index build"]),
])
def test_an_option_shared_by_commands_is_one_declaration(flag, paths):
    specs = {path: next(p.declared.spec for p in _family()[path].params if flag in getattr(p, "opts", ()))
             for path in paths}
    assert len({id(spec) for spec in specs.values()}) == 1, specs


def test_analyze_device_defaults_to_auto_as_training_does():
    """The one change the declarations brought: `analyze --device` was cpu, training's is auto."""
    train_device = next(d for d in DECLARED if d.name == "device")
    for path in ("analyze weights", "analyze triplets"):
        device = next(p for p in _family()[path].params if p.name == "device")
        assert device.default == train_device.default == "auto" and device.declared.spec is train_device.spec
    output = CliRunner().invoke(main, ["analyze", "weights", "--help"], terminal_width=200).output
    assert "(the default was cpu before). [default: auto]" in output


@pytest.mark.parametrize("args,message", [
    (["compare", "--model", "M", "--baseline", "M", "--images", "DIR", "--sample", "1"], "must be >= 2, got 1"),
    (["compare", "--model", "M", "--baseline", "M", "--images", "DIR", "--workers", "0"], "must be >= 1, got 0"),
    (["audit", "--images", "DIR", "--model", "M", "-k", "101"], "must be in [1, 100], got 101"),
    (["audit", "--images", "DIR", "--model", "M", "--top", "0"], "must be in [1, 10000], got 0"),
    (["analyze", "triplets", "--out", "x.png", "--per-class", "1"], "must be >= 2, got 1"),
    (["analyze", "weights", "--loss", "ms", "--out", "x.png", "--spread", "-1"], "must be >= 0, got -1.0"),
    (["index", "export", "DIR", "--out", "x.parquet", "--rows-per-file", "0"], "must be >= 1, got 0"),
    (["index", "build", "--out", "DIR", "--max-query-ms", "0"], "must be > 0, got 0.0"),
])
def test_the_declared_range_is_checked_as_the_command_line_is_read(args, message, tmp_path):
    (tmp_path / "m.onnx").write_bytes(b"")
    places = {"M": str(tmp_path / "m.onnx"), "DIR": str(tmp_path)}
    result = CliRunner().invoke(main, [places.get(arg, arg) for arg in args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_export_format_is_a_choice_in_any_case():
    params = {p.name: p for p in main.commands["index"].commands["export"].params}
    assert params["fmt"].type.case_sensitive is False and list(params["fmt"].type.choices) == ["parquet", "npy"]


def _command_tables():
    from retrieval.cli.doc_tables import command_tables

    return command_tables()


@pytest.mark.parametrize("document,name,classes", _command_tables(), ids=[t[1] for t in _command_tables()])
def test_the_docs_tables_of_the_commands_are_the_ones_made_from_the_declarations(document, name, classes):
    from retrieval.cli.doc_tables import commands_markdown

    text = (ROOT / document).read_text()
    start_line, end_line = markers(name)
    start, end = text.index(start_line) + len(start_line), text.index(end_line)
    assert text[start:end].strip() == commands_markdown(classes, main, document).strip(), \
        f"{document}'s {name} table is out of date: make docs"


@pytest.mark.parametrize("path", sorted(FAMILY_COMMANDS))
def test_every_option_of_these_commands_is_documented_in_a_table(path):
    """A row of a command table names the command beside the flag; an option declared by a config (training's,
    re-ranking's) is in that config's table, and the command table names it."""
    from retrieval.cli.config_options import DeclaredClickOption

    tables = {document: (ROOT / document).read_text() for document, _name, _classes in _command_tables()}
    configs = [(document, cls) for document, _name, cls in reference_tables()]
    family = [cls for _document, _name, classes in _command_tables() for cls in classes]
    for param in _family()[path].params:
        if not isinstance(param, DeclaredClickOption):
            continue
        declared = param.declared
        if any(d.spec is declared.spec for cls in family for d in declared_options(cls)):
            row = re.compile(rf"^\| `{re.escape(declared.flag)}` \| [^|]*`{re.escape(path)}`", re.M)
            assert any(row.search(text) for text in tables.values()), f"{path} {declared.flag}: no row names it"
        else:
            document = next((doc for doc, cls in configs if any(d.spec is declared.spec
                                                                 for d in declared_options(cls))), None)
            assert document is not None, f"{path} {declared.flag}: declared in no documented config"
            assert f"| `{declared.flag}` |" in (ROOT / document).read_text()
            assert any(f"`{declared.flag}` (" in text and f"`{path}`" in text for text in tables.values())
