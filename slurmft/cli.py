"""The ``slurmft`` command: a typer app that mounts one sub-app per command module.

Each command lives in ``slurmft/commands/<name>.py`` and exposes ``app``; this file only wires
them together, so adding a command never touches another command's code. Sub-apps are imported
here (not lazily) so ``slurmft --help`` lists them all; none of them imports torch at import time.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="slurmft",
    help="Keep long-running distributed PyTorch training alive on Slurm.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

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


def _mount() -> None:
    import importlib

    for module, name in _COMMANDS:
        sub = importlib.import_module(f"slurmft.commands.{module}")
        if isinstance(sub.app, typer.Typer):
            app.add_typer(sub.app, name=name)
        else:
            # A module may pass click context settings (``launch`` takes the training command's
            # own options through unparsed).
            app.command(name=name, context_settings=getattr(sub, "CONTEXT_SETTINGS", None))(sub.app)




def _version(value: bool) -> None:
    if value:
        from slurmft import __version__

        typer.echo(f"slurmft {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Keep long-running distributed PyTorch training alive on Slurm."""


_mount()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
