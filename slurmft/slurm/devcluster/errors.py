"""The devcluster's one error type: every message is a single line a user can act on."""

from __future__ import annotations


class DevClusterError(RuntimeError):
    """The devcluster could not do what was asked; the message says what and why, in one line
    (plus, for a daemon that failed to start, the tail of its log on the following lines)."""
