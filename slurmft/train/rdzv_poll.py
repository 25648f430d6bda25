"""In-allocation mode: torchrun's agents poll the rendezvous every ``POLL_S`` while they wait in a
round, not every second.

torch's c10d rendezvous (``dynamic_rendezvous``, torch 2.13) has an agent that waits for others
(the round to reopen once the last one's participants left, the round to fill, the others to see
it full) read the shared state, then sleep one second (``_delay(seconds=1)``), and serves reads
from a cache of one second (``_BackendRendezvousStateHolder``). A re-forming in the allocation
passes two or three such waits in a row (the survivors leave the last round, join the reopened
one, see it complete), each one up to a second, on average half; and the agents that see the
round complete late start their ranks late, which every rank's process-group set-up then waits
for. In the soak of 2026-11-28 the set-up of the first step after a re-form took 0.13-0.83 s,
the new ranks started 1.4-1.9 s after the old ones left.

So the agent of each in-allocation step (``ENV``, set by the launcher to ``poll_for(nodes)``)
waits that long between its reads inside a round, its state cache half as long and only there:
the reads of its monitoring loop (``num_nodes_waiting``, every ``--monitor-interval``) keep
torch's one-second cache. What it costs: while a round forms, each waiting agent reads the state
(a pickle of ~100 bytes per node, from the batch host's store) 1 / poll times a second instead
of once. The poll grows with the nodes (``POLL_S`` up to 32, torch's own 1 s from 128), so that
all of them together never read more often than 128 agents do with torch's poll. Reads never
make another agent's compare-and-set fail (only writes do): the keep-alive race ``nodesteps``
explains is not made worse.

This uses torch's private names (torch 2.13); where they are missing nothing is changed.

It lives in ``slurmft.train`` because it touches torch (only inside ``install``, which the agent
(``slurmft.launch.agent``) calls); the launcher reads its names, torch-free.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

ENV = "SLURMFT_RDZV_POLL_S"
POLL_S = 0.25
TORCH_POLL_S = 1      # torch's own: the wait between reads in a round, and the cache of a read
_MIN_S, _MAX_S = 0.05, 1.0


def poll_for(nodes: int) -> float:
    """The poll for a job of ``nodes`` (active and spare): ``POLL_S`` to 32, 1 s from 128."""
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
    original = handler_cls.next_rendezvous

    def next_rendezvous(self):
        holder = getattr(self, "_state_holder", None)
        cached = getattr(holder, "_cache_duration", None)
        if cached is not None:
            holder._cache_duration = min(cached, poll / 2)   # a read after each wait is fresh
        try:
            return original(self)
        finally:
            if cached is not None:
                holder._cache_duration = cached

    dr._delay = _delay
    handler_cls.next_rendezvous = next_rendezvous   # type: ignore[method-assign]
    return True
