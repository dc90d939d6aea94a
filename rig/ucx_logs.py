"""Which transport UCX chose, read from its ``UCX_PROTO_INFO=y`` tables (pure text parsing).

With ``UCX_PROTO_INFO=y`` UCX prints, once per endpoint configuration and operation, a table
like this (every line prefixed ``[time] [host:pid:thread]``)::

    +--------+--------------------+------------------------------------+
    | probe-d inter-node cfg#1                                         |
    | remote memory read by ucp_get*(multi) into host memory from host |
    +--------+--------------------+------------------------------------+
    | Range  |    Description     |               Config               |
    +--------+--------------------+------------------------------------+
    | 0..inf | software emulation | tcp/pdnetb13998                    |
    +--------+--------------------+------------------------------------+

The first title line names the worker and whether UCX put the peer on this node
("intra-node", where shared memory and cma qualify) or another ("inter-node"), or that the
endpoint is the worker's own ("self"); the Config cells
are ``transport/device`` (``tcp/eth0``, ``cma/memory``, ``posix/memory``...). A NIXL READ is
``ucp_get``: its table is the one whose operation starts with "remote memory read".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["ProtoTable", "SHARED_MEMORY_TRANSPORTS", "proto_tables", "read_tables", "transports"]

# Transports that only reach a peer on the same machine.
SHARED_MEMORY_TRANSPORTS = ("cma", "posix", "sysv", "xpmem", "knem")

_PREFIX = re.compile(r"^\[[\d.]+\] \[([^\]]+)\]\s+(.*)$")


@dataclass
class ProtoTable:
    source: str  # "host:pid:thread" of the printing process
    title: str  # e.g. "probe-d inter-node cfg#1"
    operation: str  # e.g. "remote memory read by ucp_get*(multi) into host memory from host"
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (range, description, config)

    @property
    def inter_node(self) -> bool:
        return " inter-node " in f" {self.title} "

    @property
    def to_peer(self) -> bool:
        """An endpoint to another worker ("inter-node" or "intra-node"), not the worker's
        endpoint to itself ("self", which NIXL's agent opens too and UCX serves over cma)."""
        return self.inter_node or " intra-node " in f" {self.title} "

    @property
    def configs(self) -> list[str]:
        return [config for _, _, config in self.rows]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def proto_tables(log_text: str) -> list[ProtoTable]:
    """Every UCX protocol table in ``log_text``, lines of several processes interleaved or not."""
    out: list[ProtoTable] = []
    # Per printing process: the table being read and which part of it comes next.
    state: dict[str, tuple[ProtoTable | None, str]] = {}
    for raw in log_text.splitlines():
        m = _PREFIX.match(raw.strip())
        if not m:
            continue
        source, line = m.group(1), m.group(2).rstrip()
        table, part = state.get(source, (None, "start"))
        if line.startswith("+"):
            # Borders: before the titles, after them, after the header, after the rows.
            if part == "start":
                state[source] = (None, "title")
            elif part == "titles" and table is not None:
                state[source] = (table, "header")
            elif part == "header_read" and table is not None:
                state[source] = (table, "rows")
            elif part == "rows" and table is not None:
                out.append(table)
                state[source] = (None, "start")
            continue
        if not line.startswith("|"):
            state[source] = (None, "start")
            continue
        cells = _cells(line)
        if part == "title":
            # A table's first title names its endpoint configuration ("... cfg#N"); anything
            # else is the middle of a table whose start is not in the text.
            state[source] = (ProtoTable(source, cells[0], ""), "operation") if "cfg#" in cells[0] else (None, "start")
        elif part == "operation" and table is not None:
            table.operation = cells[0]
            state[source] = (table, "titles")
        elif part == "header" and table is not None:
            state[source] = (table, "header_read")  # "Range | Description | Config"
        elif part == "rows" and table is not None and len(cells) >= 3:
            table.rows.append((cells[0], cells[1], cells[-1]))
    return out


def read_tables(log_text: str) -> list[ProtoTable]:
    """The tables of NIXL READs (``ucp_get``)."""
    return [t for t in proto_tables(log_text) if t.operation.startswith("remote memory read")]


def transports(tables: list[ProtoTable]) -> set[str]:
    """Transport names (``tcp``, ``cma``...) used by any row of ``tables``."""
    names = set()
    for t in tables:
        for config in t.configs:
            for lane in re.split(r"[,\s]+", config):
                if "/" in lane:
                    names.add(lane.split("/", 1)[0].split("(")[-1])
    return names
