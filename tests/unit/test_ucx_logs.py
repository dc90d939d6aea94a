"""Pure tests of rig.ucx_logs: UCX_PROTO_INFO tables read from a log."""

from rig.ucx_logs import SHARED_MEMORY_TRANSPORTS, proto_tables, read_tables, transports

# Two processes' tables interleaved, the first one cut off at the top (a log tail).
LOG = """\
[1.1] [p-host:11:1]   |     0 | short                | tcp/veth0 |
[1.1] [p-host:11:1]   +-------+----------------------+-----------+
[1.2] [d-host:12:0]   +--------+--------------------+------------------------------------+
[1.3] [p-host:11:1]   +-------------+----------------------+-----------------------------+
[1.2] [d-host:12:0]   | pd-d inter-node cfg#1                                            |
[1.3] [p-host:11:1]   | pd-p inter-node cfg#1                                            |
[1.2] [d-host:12:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.3] [p-host:11:1]   | active message by ucp_am_send*(fast-completion) from host memory |
[1.2] [d-host:12:0]   +--------+--------------------+------------------------------------+
[1.2] [d-host:12:0]   | Range  |    Description     |               Config               |
[1.3] [p-host:11:1]   +-------------+----------------------+-----------------------------+
[1.2] [d-host:12:0]   +--------+--------------------+------------------------------------+
[1.3] [p-host:11:1]   |    Range    |     Description      |           Config            |
[1.2] [d-host:12:0]   | 0..inf | software emulation | tcp/veth1                          |
[1.3] [p-host:11:1]   +-------------+----------------------+-----------------------------+
[1.2] [d-host:12:0]   +--------+--------------------+------------------------------------+
[1.3] [p-host:11:1]   |     0..8176 | short                | tcp/veth0                   |
[1.3] [p-host:11:1]   |  8177..inf  | zero-copy            | tcp/veth0                   |
[1.3] [p-host:11:1]   +-------------+----------------------+-----------------------------+
INFO 12-01 vLLM says something | with a pipe
[2.0] [one:13:0]   +--------+-------------+--------------+
[2.0] [one:13:0]   | pd-d self cfg#0                       |
[2.0] [one:13:0]   | remote memory write by ucp_put* from host memory to host |
[2.0] [one:13:0]   +--------+-------------+--------------+
[2.0] [one:13:0]   | Range  | Description | Config       |
[2.0] [one:13:0]   +--------+-------------+--------------+
[2.0] [one:13:0]   | 0..inf | zero-copy   | cma/memory   |
[2.0] [one:13:0]   +--------+-------------+--------------+
[2.0] [one:13:0]   +--------+-------------+--------------+
[2.0] [one:13:0]   | pd-d intra-node cfg#2                 |
[2.0] [one:13:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[2.0] [one:13:0]   +--------+-------------+--------------+
[2.0] [one:13:0]   | Range  | Description | Config       |
[2.0] [one:13:0]   +--------+-------------+--------------+
[2.0] [one:13:0]   | 0..inf | zero-copy   | cma/memory   |
[2.0] [one:13:0]   +--------+-------------+--------------+
"""


def test_tables_are_read_per_process_and_a_cut_off_table_is_ignored():
    tables = proto_tables(LOG)
    assert [(t.source, t.title) for t in tables] == [
        ("d-host:12:0", "pd-d inter-node cfg#1"),
        ("p-host:11:1", "pd-p inter-node cfg#1"),
        ("one:13:0", "pd-d self cfg#0"),
        ("one:13:0", "pd-d intra-node cfg#2"),
    ]
    assert tables[1].rows == [("0..8176", "short", "tcp/veth0"), ("8177..inf", "zero-copy", "tcp/veth0")]
    assert [t.inter_node for t in tables] == [True, True, False, False]
    assert [t.to_peer for t in tables] == [True, True, False, True]


def test_read_tables_are_the_ucp_get_ones_and_name_their_transports():
    reads = read_tables(LOG)
    assert [t.configs for t in reads] == [["tcp/veth1"], ["cma/memory"]]
    assert transports(reads[:1]) == {"tcp"}
    assert transports(reads) & set(SHARED_MEMORY_TRANSPORTS) == {"cma"}


def test_no_tables_in_a_log_without_them():
    assert proto_tables("INFO nothing here\n| a | b |\n+---+\n") == []
