"""Signal and inspect a process group by its id, read from /proc; never by process name.

``servers.VllmServer`` starts each server in its own session, so the group id is the PID it
started and the group holds exactly that server's APIServer, EngineCore and Worker.
"""

from __future__ import annotations

import os
from pathlib import Path


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``, read from /proc.

    Zombies are skipped: a reparented zombie that nobody reaps yet holds no memory and cannot be
    signalled away, so counting it would make stop() wait for nothing.
    """
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            members.append(int(entry))
    return members


def group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))
