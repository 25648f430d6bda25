"""torchrun's agents poll the rendezvous every ``POLL_S`` while they wait in a round and (in the
allocation) while they watch for a new one, not every second: in the allocation, and on the
requeue path, where every start of the job forms a first round
(``slurmft.launch.rendezvous.step_env``: 1.1-1.5 s from the last agent's join to the last one's
workers started with torch's poll, 0.65-1.0 s with this one; 3 devcluster nodes,
``benchmarks/startup_bench.py``).

torch's c10d rendezvous (``dynamic_rendezvous``, torch 2.13) has an agent that waits for others
(the round to reopen once the last one's participants left, the round to fill, the others to see
it full) read the shared state, then sleep one second (``_delay(seconds=1)``), and serves reads
from a cache of one second (``_BackendRendezvousStateHolder``). A re-forming in the allocation
passes two or three such waits in a row (the survivors leave the last round, join the reopened
one, see it complete), each one up to a second, on average half; and the agents that see the
round complete late start their ranks late, which every rank's process-group set-up then waits
for. In the soak of 2026-11-28 the set-up of the first step after a re-form took 0.13-0.83 s,
the new ranks started 1.4-1.9 s after the old ones left.

So the agent of each step (``ENV``, set by the launcher to ``poll_for(nodes)``)
waits that long between its reads inside a round, its state cache half as long there. Its
monitoring loop (every ``--monitor-interval``, 0.1 s in the allocation: ``nodesteps``) asks
``num_nodes_waiting`` whether another agent opened a new round (a rank crashed or hung on its
node, a spare waits), served from a cache of one poll instead of torch's second: in the soak
the agents whose ranks were fine stopped them 0.55-0.65 s after the failed one's agent had
reopened the round, and every new rank's process-group set-up waits for the last of them.
What it costs: each agent reads the state (a pickle of ~100 bytes per node, from the batch
host's store) 1 / poll times a second instead of once, while a round forms and while training
runs: ~10 times torch's reads for a job of up to 12 nodes in the allocation (on the requeue
path the monitoring loop looks every second: one read a second while training, as torch's).
The poll grows with the nodes (``POLL_S`` up to 12, torch's own 1 s from 128), so that up to
128 nodes all of them together never read more often than 128 agents do with torch's own cache,
and from 128 as often as torch's. Reads never make another agent's compare-and-set fail (only writes do): the keep-alive race ``nodesteps``
explains is not made worse.

This uses torch's private names (torch 2.13); where they are missing nothing is changed.

It lives in ``slurmft.train`` because it touches torch (only inside ``install``, which the agent
(``slurmft.launch.agent``) calls); the launcher reads its names, torch-free.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

ENV = "SLURMFT_RDZV_POLL_S"
POLL_S = 0.1
TORCH_POLL_S = 1      # torch's own: the wait between reads in a round, and the cache of a read
_MIN_S, _MAX_S = 0.05, 1.0


def poll_for(nodes: int) -> float:
    """The poll for a job of ``nodes`` (active and spare): ``POLL_S`` to 12, 1 s from 128."""
    return min(float(TORCH_POLL_S), max(POLL_S, nodes / 128))


def parse(raw: str | None) -> float | None:
    """The poll ``raw`` names (seconds in [0.05, 1]), or None: torch's own."""
    try:
        value = float(raw) if raw else None
    except ValueError:
        return None
    return value if value is not None and _MIN_S <= value <= _MAX_S else None


def install(env: Mapping[str, str]) -> bool:
    """Poll every ``env[ENV]`` seconds inside torch's rendezvous rounds; True when installed."""
    poll = parse(env.get(ENV))
    if poll is None:
        return False
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    delay = getattr(dr, "_delay", None)
    handler_cls = getattr(dr, "DynamicRendezvousHandler", None)
    if delay is None or handler_cls is None or getattr(delay, "_slurmft_poll", False):
        return delay is not None and getattr(delay, "_slurmft_poll", False)

    def _delay(seconds: Any) -> None:
        if seconds == TORCH_POLL_S:   # the wait between two reads of a round (the only one of 1 s)
            time.sleep(poll)
        else:
            delay(seconds)

    _delay._slurmft_poll = True  # type: ignore[attr-defined]
    dr._delay = _delay
    # Inside a round a read after each wait is fresh; the monitoring loop's reads one poll apart.
    handler_cls.next_rendezvous = _cached(handler_cls.next_rendezvous, poll / 2)  # type: ignore[method-assign]
    handler_cls.num_nodes_waiting = _cached(handler_cls.num_nodes_waiting, poll)  # type: ignore[method-assign]
    return True


def _cached(method: Callable[[Any], Any], seconds: float) -> Callable[[Any], Any]:
    """``method`` of a rendezvous handler with its state served from a cache of at most
    ``seconds`` while it runs (torch's own cache outside it)."""
    def wrapped(self: Any) -> Any:
        holder: Any = getattr(self, "_state_holder", None)
        cached = getattr(holder, "_cache_duration", None)
        if cached is not None:
            holder._cache_duration = min(cached, seconds)
        try:
            return method(self)
        finally:
            if cached is not None:
                holder._cache_duration = cached
    return wrapped
