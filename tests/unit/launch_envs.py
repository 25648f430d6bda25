"""Load the recorded Slurm environments in tests/fixtures/launch-env (see its README)."""

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "launch-env"


def recorded(name: str) -> dict[str, str]:
    env = {}
    for line in (FIXTURES / f"{name}.env").read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value
    return env
