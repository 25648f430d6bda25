"""torchrun's elastic agent as slurmft starts it, and the one definition of its command line.

``python -m slurmft.launch.agent TORCHRUN_ARGS...`` runs ``torch.distributed.run`` exactly as
``python -m torch.distributed.run TORCHRUN_ARGS...`` does (runpy's ``-m`` path: ``__main__``,
``sys.argv[0]`` torchrun's file, ``sys.path[0]`` the working directory; torchrun's own handlers
for TERM, INT, HUP and QUIT, which stop its workers and raise; its ``ChildFailedError`` report
printed; its exit status: 0, or 1 when a rank failed or a signal stopped it), except its log
directory: torchrun makes one in the temp dir and leaves it there, so the agent gives it one of
its own, removed when the agent ends or, when it was killed, by the next agent on the node
(``ownedtmp``; a directory the command names is torchrun's and kept); and in the allocation the
agent of a node the launcher fenced leaves the rendezvous instead of joining its next round
(``rdzv_leave``: it exits ``exitcodes.FENCED``; the others drop a dead fenced node's entry); and
in both modes every agent polls a forming round every 0.1 s for a small job instead of every
second (``rdzv_poll``, set by the launcher: ``inalloc``, ``rendezvous.step_env``). It then ends
as a script ends but without the interpreter's teardown of torch (``scriptend``: ~0.5 CPU-s per agent,
which writes nothing). With warm workers it forks the node's warm server after its own import of
torch, before torchrun starts a thread (``warmfork``), and stops it at torchrun's end. Every
agent slurmft starts (each node's task in both modes, a spare's
started ahead, the chaos reference) runs this way.

``argv``/``is_agent`` are what starts it and what finds it (the node task, a spare, the chaos
tools, the tests, the benchmarks' tracers): one definition, so they cannot drift.
"""

from __future__ import annotations

import os
import runpy
import sys
import types
from typing import NoReturn, Sequence

from slurmft import exitcodes
from slurmft.launch import ownedtmp, scriptend, warmfork
from slurmft.train import rdzv_leave, rdzv_poll

MODULE = "slurmft.launch.agent"
TORCHRUN = "torch.distributed.run"
# torchrun's own spellings (and its variable for it); without one it makes a ``torchelastic_*``
# directory in the temp dir for its error files and never removes it: one per agent, every start
# and restart of every node. The agent gives it one of its own instead, held for its lifetime
# (``ownedtmp``): removed when it ends, or by a later agent on the node when it was killed.
LOG_DIR_OPTIONS = ("--log-dir", "--log_dir")
LOG_DIR_ENV = "PET_LOG_DIR"
LOG_DIR_PREFIX = "slurmft-torchelastic-"


def argv(python: str = sys.executable) -> list[str]:
    """The agent's command line before torchrun's arguments."""
    return [python, "-m", MODULE]


def is_agent(cmdline: Sequence[str | bytes]) -> bool:
    """``cmdline`` (a process's argv, as str or as /proc's bytes) is the agent's."""
    head = [c.decode(errors="replace") if isinstance(c, bytes) else c for c in cmdline[1:3]]
    return head == ["-m", MODULE]


def run_torchrun(args: Sequence[str] | None = None) -> None:
    """torchrun as ``python -m torch.distributed.run`` runs it, ``args`` (default: this process's
    own) its arguments; raises what it raises (SystemExit with its status)."""
    if args is not None:
        sys.argv = [sys.argv[0], *args]
    log_dir = None
    if not os.environ.get(LOG_DIR_ENV) and not any(
            a in LOG_DIR_OPTIONS or a.startswith(tuple(f"{o}=" for o in LOG_DIR_OPTIONS))
            for a in sys.argv[1:]):
        log_dir = ownedtmp.make(LOG_DIR_PREFIX)
        sys.argv.insert(1, f"--log-dir={log_dir[0]}")
    rdzv_poll.install(os.environ)
    rdzv_leave.install(os.environ)   # outermost: a fenced node's agent never enters a round
    own = sys.modules.get("__main__")   # this module when run by -m: kept alive while torchrun runs
    sys.modules["__main__"] = types.ModuleType("__main__")   # torchrun's own namespace, as -m's
    try:
        runpy._run_module_as_main(TORCHRUN, alter_argv=True)  # type: ignore[attr-defined]
    except Exception as exc:
        if rdzv_leave.is_fenced_end(exc):
            raise SystemExit(exitcodes.FENCED) from None
        raise
    finally:
        del own
        if log_dir is not None:
            ownedtmp.release(*log_dir)


def run_serving(args: Sequence[str] | None = None) -> None:
    """``run_torchrun``, with the node's warm server forked from this process first when the task
    asked for one (``warmfork``: torch imported once on the node, not by the agent and again by
    the server); the server is stopped at torchrun's end."""
    server = None
    if os.environ.get(warmfork.SERVE_ENV):
        warmfork.import_for_fork(TORCHRUN)
        sys.modules.pop(TORCHRUN, None)   # runpy runs it afresh as __main__; its imports stay
        server = warmfork.start()
    try:
        run_torchrun(args)
    finally:
        warmfork.stop(server)


def main() -> NoReturn:
    scriptend.run_as_script(run_serving)


if __name__ == "__main__":
    main()
