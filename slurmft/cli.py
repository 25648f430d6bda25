"""The ``slurmft`` command: a typer app that mounts one sub-app per command module.

Each command lives in ``slurmft/commands/<name>.py`` and exposes ``app``; this file only wires
them together, so adding a command never touches another command's code. None of them imports
torch at import time.

``slurmft <command> ...`` (``main``) imports only that command's module: the launcher's
pre-flight runs ``slurmft sweep`` on every node of every job start, and the other commands'
imports (the checkpoint tools, the devcluster) were half of its cost. Anything else
(``slurmft --help``, ``--version``, an unknown name) gets the full app, as does
``from slurmft.cli import app`` (built on first use).
"""

from __future__ import annotations

import importlib
import sys

import typer

# Each entry: (module under slurmft.commands, command name). Keep sorted by name.
_COMMANDS: list[tuple[str, str]] = [
    ("ckpt", "ckpt"),
    ("devcluster", "devcluster"),
    ("interval", "interval"),
    ("launch", "launch"),
    ("status", "status"),
    ("sweep", "sweep"),
    ("watch", "watch"),
]


def _version(value: bool) -> None:
    if value:
        from slurmft import __version__

        typer.echo(f"slurmft {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Keep long-running distributed PyTorch training alive on Slurm."""


def build(only: str | None = None) -> typer.Typer:
    """The ``slurmft`` app with every command mounted, or only the command named ``only``."""
    app = typer.Typer(
        name="slurmft",
        help="Keep long-running distributed PyTorch training alive on Slurm.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    app.callback()(_root)
    for module, name in _COMMANDS:
        if only is not None and name != only:
            continue
        sub = importlib.import_module(f"slurmft.commands.{module}")
        if isinstance(sub.app, typer.Typer):
            app.add_typer(sub.app, name=name)
        else:
            # A module may pass click context settings (``launch`` takes the training command's
            # own options through unparsed).
            app.command(name=name, context_settings=getattr(sub, "CONTEXT_SETTINGS", None))(sub.app)
    return app


def __getattr__(name: str) -> typer.Typer:
    # ``from slurmft.cli import app`` (the tests' CliRunner, anyone embedding the CLI): the full
    # app, built once on first use (PEP 562).
    if name == "app":
        app = globals()["app"] = build()
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    args = sys.argv[1:]
    named = args[0] if args and args[0] in {name for _, name in _COMMANDS} else None
    build(named)()


if __name__ == "__main__":
    main()
