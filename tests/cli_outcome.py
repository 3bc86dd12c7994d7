"""The command line run in this process, its work stopped where it would start (tests/test_bad_input.py,
tests/test_cli_property.py): what a user would see of their input, without the minutes of the work."""

from __future__ import annotations

import contextlib
import io

from multigpu import __main__ as cli


class Started(Exception):
    """Raised where a command would start its work (a launch, a trace, a dry run): the input passed every check."""


def start(*args, **kwargs):
    """Put in place of what starts a command's work (monkeypatch.setattr): raises `Started`."""
    raise Started


def outcome(argv: list[str]) -> tuple[str, str]:
    """('started' | 'exit N', stderr) of `python -m multigpu <argv>` in this process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except Started:
            return "started", err.getvalue()
        except SystemExit as exit_:  # argparse: a value of the wrong type
            code = exit_.code
    return f"exit {code}", err.getvalue()
