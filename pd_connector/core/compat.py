"""Whether a P and a D engine can hand over to each other: the settings they must share,
compared field by field over the ``EngineCompat`` each sends in its handshake (pure).

A rule, kept out of the wire format (core/protocol.py): which differences are allowed depends
on how blocks pair (``pairing.recut_ratio``) and how TP shards split pages (core/shards.py).
"""

from __future__ import annotations

from pd_connector.core.pairing import recut_ratio
from pd_connector.core.protocol import EngineCompat, GroupDesc


def compat_differences(mine: EngineCompat, theirs: EngineCompat) -> list[str]:
    """Human-readable differences, one per setting (empty list = compatible)."""
    diffs = []
    # Ranks of different TP sizes hold pages of different sizes; the shard plan checks each
    # unit's size instead (``shards.plan_region``).
    same_tp = mine.tensor_parallel_size == theirs.tensor_parallel_size
    for field in EngineCompat.__struct_fields__:
        a, b = getattr(mine, field), getattr(theirs, field)
        if field == "tensor_parallel_size":
            continue
        if field == "groups":
            if len(a) != len(b):
                diffs.append(f"number of KV-cache groups: local {len(a)}, remote {len(b)}")
                continue
            for i, (ga, gb) in enumerate(zip(a, b)):
                # Attention blocks of sizes one of which divides the other are re-cut into
                # sub-blocks (core/block_phases.py); their pages differ in size with them.
                recut = ga.block_size != gb.block_size and recuttable_block_sizes(ga, gb)
                for sub in GroupDesc.__struct_fields__:
                    va, vb = getattr(ga, sub), getattr(gb, sub)
                    if va == vb or (sub == "page_bytes" and (recut or not same_tp)) or (sub == "block_size" and recut):
                        continue
                    why = " (not an integral ratio)" if sub == "block_size" and ga.kind == gb.kind else ""
                    diffs.append(f"group {i} {sub}: local {va!r}, remote {vb!r}{why}")
        elif a != b:
            diffs.append(f"{field}: local {a!r}, remote {b!r}")
    return diffs


def recuttable_block_sizes(a: GroupDesc, b: GroupDesc) -> bool:
    """Two token-block groups of one kind whose blocks D can read from P's sub-block by
    sub-block (``pairing.recut_ratio``)."""
    return a.kind == b.kind and recut_ratio(a.kind, b.block_size, a.block_size) is not None
