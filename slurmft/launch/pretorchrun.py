"""A hot spare's torchrun, started before it is needed (``spare.ReadyTorchrun``).

``python -m slurmft.launch.pretorchrun --go-fd FD -- TORCHRUN_ARGS...`` imports torchrun
(``torch.distributed.run``: ``import torch`` and the elastic agent, most of an agent's start)
while the spare waits, then blocks on the task's pipe. On the task's go (one byte) it runs
torchrun in this process exactly as ``python -m torch.distributed.run TORCHRUN_ARGS...`` does:
as ``__main__`` through runpy, ``sys.argv`` torchrun's file and its arguments, the environment
and the signal dispositions the task gave it (USR2 ignored; torchrun installs its own handlers),
its exception or exit status the process's (``agent.run_torchrun``). On EOF without a go (the
task stopped, or died) it exits 0 having run nothing. With warm workers the node's warm server
is forked from it after the import (``warmfork``), so it is ready when the spare is made active.
An import that fails is not reported here: torchrun's own start on
the go fails the same way, with the same traceback, as a cold start would. Either way it ends
as the agent does (``agent``): as a script, without the interpreter's teardown of torch.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Sequence

from slurmft.launch import agent, scriptend, warmfork

MODULE = agent.TORCHRUN
GO = b"g"


def _wait_for_go(fd: int) -> bool:
    try:
        data = os.read(fd, 1)
    except OSError:
        data = b""
    finally:
        os.close(fd)   # torchrun's workers must not inherit it
    return data == GO


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[0] != "--go-fd" or not args[1].isdigit() or args[2] != "--":
        print("usage: python -m slurmft.launch.pretorchrun --go-fd FD -- TORCHRUN_ARGS...",
              file=sys.stderr)
        return 2
    serving = bool(os.environ.get(warmfork.SERVE_ENV))
    if serving:
        warmfork.import_for_fork(MODULE)
    else:
        try:
            importlib.import_module(MODULE)
        except BaseException:   # noqa: BLE001  (reported by torchrun's own start on the go)
            pass
    # runpy runs the module afresh as __main__ (as -m does); its imports stay cached. Left in
    # sys.modules, runpy would warn that it was imported before its execution.
    sys.modules.pop(MODULE, None)
    server = warmfork.start(not_inherited=(int(args[1]),)) if serving else None   # the go pipe
    try:
        if not _wait_for_go(int(args[1])):
            return 0
        agent.run_torchrun(args[3:])
    finally:
        warmfork.stop(server)
    return 0


if __name__ == "__main__":
    scriptend.run_as_script(lambda: sys.exit(main()))
