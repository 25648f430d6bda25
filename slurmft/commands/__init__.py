"""Typer sub-apps, one module per ``slurmft <command>``; ``slurmft.cli`` mounts them."""
