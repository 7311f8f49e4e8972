"""Without the train extra, every --help still works and each command that needs it says which extra to install, in
one line with exit code 1, before any work (tests/project/test_slim_install.py checks the real base install; here
the extra's modules are blocked in a fresh process, which costs a second)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from retrieval.extras import EXTRA_MODULES, extra_of_module, install_command, install_command_for, missing_extra_message

ROOT = Path(__file__).resolve().parents[2]
# Runs first in the fresh process: the train extra's modules cannot be imported (``import torch`` raises
# ModuleNotFoundError, as where it is not installed, and importlib.util.find_spec finds nothing).
WITHOUT_TRAIN = f"import sys; sys.modules.update(dict.fromkeys({list(EXTRA_MODULES['train'])!r}))\n"
# the commands that train, evaluate, export, analyse or list what torch registers; and two whose torch is found only
# as they run (data prepare digits, results report)
# (command, its arguments)
NEEDS_TRAIN = [("train", ["--out", "{tmp}/run"]), ("evaluate", ["--checkpoint", "{tmp}/best.pt"]), ("losses", []),
               ("backbones", []), ("demo", ["--out", "{tmp}/demo", "--no-serve"]),
               ("export", ["--checkpoint", "{tmp}/best.pt", "--out", "{tmp}/model.onnx"]),
               ("analyze weights", ["--loss", "contrastive", "--out", "{tmp}/w.png"]),
               ("analyze triplets", ["--out", "{tmp}/t.png"]),
               ("results run", ["--runs", "{tmp}/runs"]), ("results report", ["--runs", "{tmp}/runs"]),
               ("data prepare", ["digits", "--out", "{tmp}/digits"])]


def run_without_train(code: str) -> str:
    """Run ``code`` in a fresh interpreter without the train extra; its stdout."""
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRAIN + textwrap.dedent(code)], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_every_help_works_without_the_train_extra():
    out = run_without_train("""
        import contextlib, io, json
        import click
        from retrieval.cli.main import main

        def command_paths(group, prefix=()):
            for name, command in sorted(group.commands.items()):
                yield (*prefix, name)
                if isinstance(command, click.Group):
                    yield from command_paths(command, (*prefix, name))

        report = {}
        for path in [(), *command_paths(main)]:
            shown = io.StringIO()
            with contextlib.redirect_stdout(shown):
                code = main.main([*path, "--help"], prog_name="retrieval", standalone_mode=False)
            report[" ".join(path)] = [code, shown.getvalue()]
        print(json.dumps(report))
    """)
    report = json.loads(out)
    assert all(code == 0 and shown.startswith("Usage: retrieval") for code, shown in report.values()), report
    shown = {path: " ".join(text.split()) for path, (_, text) in report.items()}  # unwrapped
    install = install_command("train")  # this checkout's form (an editable install here)
    # train's help lists the backbones and losses where torch registers them: here it says where to get them
    assert "Choices: listed once the train extra is installed" in shown["train"]
    assert all(f"This command needs PyTorch, which the base install leaves out: {install}" in shown[path]
               for path in ("train", "export", "demo", "analyze weights"))
    assert not any(install in shown[path] for path in ("", "search", "serve", "index build", "index export"))


def test_each_command_that_needs_torch_names_the_extra_before_any_work(tmp_path):
    commands = [[*command.split(), *(arg.format(tmp=tmp_path) for arg in args)] for command, args in NEEDS_TRAIN]
    out = run_without_train(f"""
        import json
        import click
        from retrieval.cli.main import main

        answers = []
        for args in {commands!r}:
            try:
                main.main(args, prog_name="retrieval", standalone_mode=False)
                answers.append([0, ""])
            except click.ClickException as exc:
                answers.append([exc.exit_code, exc.format_message()])
        print(json.dumps(answers))
    """)
    for (command, _), (code, message) in zip(NEEDS_TRAIN, json.loads(out), strict=True):
        assert (code, message) == (1, f"retrieval {command} needs PyTorch, which the base install leaves out: "
                                      f"{install_command('train')}"), command
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize(("module", "extra"), [("torch", "train"), ("torch.nn.functional", "train"),
                                               ("sklearn", "train"), ("mlflow", "track"), ("ray", "ray"),
                                               ("onnxruntime", None), ("torchmetrics", None), (None, None)])
def test_a_module_belongs_to_the_extra_that_installs_it(module, extra):
    assert extra_of_module(module) == extra


def test_the_message_names_the_package_and_the_install_command():
    assert missing_extra_message("retrieval index build --engine ray", "ray.data") == (
        "retrieval index build --engine ray needs Ray Data, which the base install leaves out: "
        f"{install_command('ray')}")
    assert missing_extra_message("retrieval data prepare", "sklearn").startswith("retrieval data prepare needs "
                                                                                 "scikit-learn,")
    with pytest.raises(ValueError, match="belongs to no extra"):
        missing_extra_message("search", "onnxruntime")


@pytest.mark.parametrize(("direct_url", "command"), [
    (None, "pip install 'retrieval[train]'"),  # from a package index: no PEP 610 record
    ({"url": "file:///home/ann/retrieval", "dir_info": {"editable": True}},
     "pip install -e '/home/ann/retrieval[train]'"),
    ({"url": "file:///home/ann/my%20code/retrieval", "dir_info": {}},
     "pip install '/home/ann/my code/retrieval[train]'"),
    ({"url": "https://github.com/ann/retrieval.git", "vcs_info": {"vcs": "git", "commit_id": "abc123"}},
     "pip install 'retrieval[train] @ git+https://github.com/ann/retrieval.git@abc123'"),
    ({"url": "file:///tmp/retrieval-0.1.0-py3-none-any.whl", "archive_info": {}},
     "pip install '/tmp/retrieval-0.1.0-py3-none-any.whl[train]'"),
    ({"url": 7, "dir_info": "odd"}, "pip install 'retrieval[train]'"),  # a damaged record: the index form
])
def test_the_install_command_names_where_this_install_came_from(direct_url, command):
    assert install_command_for("train", direct_url) == command


def test_this_editable_checkout_is_told_to_install_the_extra_from_itself():
    import importlib.metadata
    from urllib.request import url2pathname

    texts = [d.read_text("direct_url.json") for d in importlib.metadata.distributions(name="retrieval")]
    record = next((json.loads(text) for text in texts if text), {})
    if not record.get("dir_info", {}).get("editable"):
        pytest.skip("retrieval is not installed editable here")
    assert install_command("train") == f"pip install -e '{url2pathname(record['url'][len('file://'):])}[train]'"
    assert "pip install 'retrieval[train]'" not in missing_extra_message("retrieval train", "torch")
