"""The ``datadist`` command's help as a newcomer meets it: a bare ``datadist`` shows the
commands, ``--version`` answers, every option explains itself, no reStructuredText markup
leaks into the text, and ``demo --transport`` offers every data path."""

from __future__ import annotations

import re

import pytest

import datadist
from datadist import cli


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    return rc, capsys.readouterr().out


def test_bare_command_prints_help_with_every_command(capsys):
    rc, out = run([], capsys)
    assert rc == 0
    assert out.startswith("usage: datadist")
    for command in ("demo", "info", "bench"):
        assert re.search(rf"^\s+{command}\s+\S", out, re.M), f"{command} not listed:\n{out}"


def test_version(capsys):
    rc, out = run(["--version"], capsys)
    assert rc == 0 and out.strip() == f"datadist {datadist.__version__}"


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["info", "--help"],
                                  ["probe", "--help"], ["bench", "--help"]])
def test_help_has_no_markup_and_every_option_explained(argv, capsys):
    rc, out = run(argv, capsys)
    assert rc == 0
    assert "``" not in out and "`" not in out, out
    # argparse prints an option with no help text as a bare line: "  --name NAME" and nothing
    bare = [line for line in out.splitlines()
            if re.fullmatch(r"\s+--?[\w-]+(?: [A-Z_]+)?\s*", line)
            and not line.strip().startswith(("-h", "--help"))]
    continued = set()
    lines = out.splitlines()
    for i, line in enumerate(lines[:-1]):  # a long option's help starts on the next line
        if line in bare and lines[i + 1].startswith(" " * 20):
            continued.add(line)
    assert not set(bare) - continued, f"options without help: {set(bare) - continued}"


def test_demo_offers_every_forcible_data_path(capsys):
    rc, out = run(["demo", "--help"], capsys)
    assert rc == 0
    from datadist.core.config import forced_path

    paths = re.search(r"--transport \{([\w,]+)\}", out).group(1).split(",")
    assert set(paths) >= {"auto", "tcp", "cma", "shm"}
    for name in paths:
        if name != "auto":
            assert forced_path(name).value == name  # each one is a path datadist knows


def test_parser_error_is_still_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--transport", "carrier-pigeon"])
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_bench_help_says_what_the_user_gets(capsys):
    # issue 38 item 12: the description was the runner module's docstring ("Driving a run:
    # which row groups, the owner's lifetime, ..."), about the code, not the output
    rc, out = run(["bench", "--help"], capsys)
    assert rc == 0
    assert "Driving a run" not in out and "owner's lifetime" not in out
    description = " ".join(out.split("options:")[0].split())
    for words in ("on this machine", "table", "limit", "higher is better", "goal"):
        assert words in description, f"{words!r} not in bench's description: {description}"
    assert "checked before anything is measured" in " ".join(out.split())


def test_info_help_says_what_peer_is(capsys):
    # issue 38 item 12: "--peer ip:port of a datadist listener" did not say which process to
    # name or what comes back
    rc, out = run(["info", "--help"], capsys)
    text = " ".join(out.split())
    assert rc == 0
    assert "--peer IP:PORT" in text
    assert "running PROMPT" in text and "listen_ip_info" in text
    assert "the data path a pull from it takes, why" in text
