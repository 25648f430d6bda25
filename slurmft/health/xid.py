"""NVIDIA Xid errors from the kernel log: parse, classify from ONE table, remember across sweeps.

Source of the table: ``/work/shared/fixtures/xid-catalog.md`` (copied to
``tests/fixtures/health/xid-catalog.md``), which reads NVIDIA's Xid catalog
(docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), NVIDIA's older Xid table and
DCGM's ``DcgmHealthWatch::BuildXidMappings()``. Verdicts: ``drain`` (the GPU needs a reset or the
node a reboot: NVIDIA's immediate bucket RESET_GPU / RESTART_BM / workflow for DBE and NVLink),
``warn`` (watch: single-bit storms, remap events that take effect at the next reset, unknown
codes), ``ignore`` (the application faulted; the GPU is fine and the job is requeued elsewhere).

Line formats accepted (examples with sources in tests/fixtures/health/xid/README.md):
``NVRM: Xid (0000:03:00): 13, ...`` (older drivers), ``NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, ...``,
``NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, ...`` (R550+), behind any
prefix (``[ 123.4]``, ``[Fri Aug 30 11:43:09 2024]``, syslog ``host kernel:``). The code is the
number right after ``):`` — never "the last number after Xid" (Xid 45 says "caused by previous
Xid 149"; the GSP banner ``_kgspLogXid119:`` is not an Xid line).

Reading: ``/dev/kmsg`` (records carry a sequence number; position = (boot id, last sequence)) or a
log file (position = (inode, byte offset)). Drain-level Xids are remembered for the rest of the
boot: a GPU that fell off the bus stays drained after the line scrolls past, until the node
reboots or an admin runs ``slurmft sweep --forget-xids`` after resetting the GPU.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from slurmft.health.facts import Facts, Unavailable
from slurmft.health.result import CheckResult, findings
from slurmft.health.state import HealthState
from slurmft.health.state_check import XID

Verdict = Literal["drain", "warn", "ignore"]
XID_FACT = "xid"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
KMSG = Path("/dev/kmsg")
REMEMBER_MAX = 32

# code -> (NVIDIA mnemonic, verdict). Codes 145/149/154 are refined from the line text below.
XID_TABLE: dict[int, tuple[str, Verdict]] = {
    13: ("GR_EXCEPTION (application fault)", "ignore"),
    14: ("unused (NVIDIA's documentation example)", "ignore"),
    31: ("GPU memory page fault (application)", "ignore"),
    32: ("corrupted push buffer stream", "ignore"),
    38: ("driver firmware error", "ignore"),
    43: ("GPU stopped processing (application fault)", "ignore"),
    44: ("graphics engine fault during context switch", "ignore"),
    45: ("preemptive cleanup", "warn"),
    48: ("double-bit ECC error", "drain"),
    56: ("display engine error", "ignore"),
    61: ("PMU breakpoint", "warn"),
    62: ("PMU halt error", "drain"),
    63: ("row remap / page retirement event, reset to apply", "warn"),
    64: ("row remapping failure", "drain"),
    68: ("NVDEC0 exception", "ignore"),
    69: ("graphics engine class error", "ignore"),
    74: ("NVLink error", "drain"),
    79: ("GPU has fallen off the bus", "drain"),
    92: ("high single-bit ECC error rate", "warn"),
    94: ("contained memory error, reset to apply remap", "drain"),
    95: ("uncontained memory error", "drain"),
    109: ("context switch timeout", "drain"),
    119: ("GSP RPC timeout", "drain"),
    120: ("GSP error", "drain"),
    121: ("C2C link corrected error", "warn"),
    140: ("unrecovered ECC error", "drain"),
    143: ("GPU initialization error", "drain"),
    145: ("NVLink RLW error", "warn"),
    149: ("NVLink NETIR error", "warn"),
    154: ("GPU recovery action changed", "ignore"),
}

_LINE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-9a-fA-F])?\): "
    r"(?P<code>\d+)(?:,\s*(?P<body>.*))?$"
)
_RECOVERY_TARGET = re.compile(r"\bto\s+(?:0x[0-9a-fA-F]+\s*)?\(?(?P<action>[A-Za-z][A-Za-z0-9 ]*)\)?\s*$")


@dataclass(frozen=True)
class XidEvent:
    code: int
    pci: str
    body: str
    line: str

    @property
    def verdict(self) -> Verdict:
        return classify(self.code, self.body)

    @property
    def what(self) -> str:
        return XID_TABLE.get(self.code, ("unknown Xid",))[0]


def classify(code: int, body: str) -> Verdict:
    """The node verdict for one Xid line; 145/149 by Fatal/Nonfatal, 154 by its target action."""
    if code in (145, 149):
        words = body.split()
        if "Fatal" in words:
            return "drain"
        return "warn"
    if code == 154:
        m = _RECOVERY_TARGET.search(body)
        target = m.group("action").strip() if m else ""
        return "ignore" if target == "None" else "drain"
    entry = XID_TABLE.get(code)
    return entry[1] if entry else "warn"


def parse_line(line: str) -> XidEvent | None:
    """The Xid event on one kernel-log line (any prefix), or None."""
    text = line.rstrip("\n")
    m = _LINE.search(text)
    if not m:
        return None
    return XidEvent(int(m.group("code")), m.group("pci").lower(), (m.group("body") or "").strip(), text)


@dataclass(frozen=True)
class XidConfig:
    """``[health_xid]``: where the kernel log is read from."""

    source: Literal["kmsg", "file"] = "kmsg"
    # for source = "file" (kern.log...): the first sweep reads the whole file, so Xids logged
    # before the last reboot are taken as this boot's (clear them with --forget-xids)
    path: Path | None = None

    def __post_init__(self) -> None:
        if self.source == "file":
            if self.path is None:
                raise ValueError("path is required when source = \"file\"")
            if not Path(self.path).is_file():
                raise ValueError(f"path {self.path} does not exist")


@dataclass(frozen=True)
class XidRead:
    events: tuple[XidEvent, ...]
    position: dict
    boot_id: str


def boot_id() -> str:
    """This boot's id ("" if unreadable): remembered Xids and a lost memory last one boot."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def read_kmsg(last_seq: int, path: Path = KMSG) -> tuple[list[str], int]:
    """Messages of records with sequence > ``last_seq``; never blocks (O_NONBLOCK, EAGAIN = end)."""
    lines: list[str] = []
    newest = last_seq
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        while True:
            try:
                record = os.read(fd, 65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten while reading: go on
                    continue
                raise
            if not record:
                break
            head, _, msg = record.decode(errors="replace").partition(";")
            fields = head.split(",")
            if len(fields) < 3 or not fields[1].isdigit():
                continue
            seq = int(fields[1])
            if seq > last_seq:
                lines.append(msg.split("\n", 1)[0])
                newest = max(newest, seq)
    finally:
        os.close(fd)
    return lines, newest


def read_file(path: Path, inode: int | None, offset: int) -> tuple[list[str], int, int]:
    """Lines appended since ``offset``; a rotated or truncated file is read from the start."""
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        if st.st_ino != inode or st.st_size < offset:
            offset = 0
        fh.seek(offset)
        data = fh.read()
    complete = data.rfind(b"\n") + 1  # a half-written last line is read next time
    text = data[:complete].decode(errors="replace")
    return text.splitlines(), st.st_ino, offset + complete


def gather_xids(cfg: XidConfig, state: HealthState) -> XidRead | Unavailable:
    """New Xid events since the position remembered in ``state`` (state itself is not changed)."""
    boot = boot_id()
    saved = state.get(XID, {})
    pos = saved.get("position", {})
    if cfg.source == "kmsg":
        # kmsg sequence numbers restart at every boot; a log file's offset does not
        last = int(pos.get("kmsg_seq", -1)) if saved.get("boot_id") == boot else -1
        try:
            lines, seq = read_kmsg(last)
        except FileNotFoundError:
            return Unavailable(f"{KMSG} does not exist")
        except PermissionError as exc:
            return Unavailable(f"cannot read {KMSG}: {exc.strerror}")
        new_pos = {"kmsg_seq": seq}
    else:
        if cfg.path is None:
            return Unavailable('[health_xid] source = "file" needs a path')
        lines, inode, offset = read_file(cfg.path, pos.get("inode"), int(pos.get("offset", 0)))
        new_pos = {"inode": inode, "offset": offset}
    events = tuple(e for e in map(parse_line, lines) if e is not None)
    return XidRead(events, new_pos, boot)


def forget(state: HealthState) -> None:
    """Drop remembered drain-level Xids (the admin reset the GPU); keep the log position."""
    saved = state.get(XID)
    if saved:
        state.set(XID, {**saved, "remembered": []})


def check_gpu_xid(facts: Facts, cfg: XidConfig, state: HealthState) -> CheckResult:
    read: XidRead = facts.need(XID_FACT)
    saved = state.get(XID, {})
    remembered = list(saved.get("remembered", [])) if saved.get("boot_id") == read.boot_id else []
    warn, ignored = [], 0
    for e in read.events:
        verdict = e.verdict
        if verdict == "drain":
            remembered.append({"code": e.code, "pci": e.pci, "what": e.what})
        elif verdict == "warn":
            warn.append(f"Xid {e.code} on {e.pci} ({e.what})")
        else:
            ignored += 1
    remembered = remembered[-REMEMBER_MAX:]
    state.set(XID, {"boot_id": read.boot_id, "position": read.position, "remembered": remembered})
    fail = sorted({f"Xid {r['code']} on {r['pci']} ({r['what']})" for r in remembered})
    if fail:  # tell the admin reading `sinfo -R` how this drain ends
        fail[-1] += " [kept until reboot or slurmft sweep --forget-xids]"
    ok = f"{len(read.events)} new Xid lines" + (f", {ignored} application-level ignored" if ignored else "")
    return findings("gpu_xid", fail, sorted(set(warn)), ok)
