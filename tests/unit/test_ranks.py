"""The side-channel port scheme under data parallelism x tensor parallelism (pd_connector.core.ranks)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pd_connector.core import ranks

shapes = st.tuples(st.integers(1, 8), st.integers(1, 8))  # (dp_size, tp_size)


def ports_of(base: int, dp_size: int, tp_size: int) -> list[int]:
    return [ranks.side_channel_port(base, k, r, tp_size) for k in range(dp_size) for r in range(tp_size)]


@given(st.integers(1024, 60000), shapes)
def test_no_two_ranks_of_one_instance_share_a_port(base, shape):
    dp_size, tp_size = shape
    got = ports_of(base, dp_size, tp_size)
    assert len(set(got)) == len(got)
    assert sorted(got) == list(ranks.instance_ports(base, dp_size, tp_size))


@given(st.integers(1024, 30000), shapes, shapes, st.integers(0, 64))
def test_two_instances_whose_bases_are_a_range_apart_never_clash(base, a, b, gap):
    second = base + a[0] * a[1] + gap
    assert not set(ports_of(base, *a)) & set(ports_of(second, *b))


@given(st.integers(1024, 60000), st.integers(0, 7), st.integers(1, 8))
def test_d_reaches_every_tp_rank_of_the_named_engine_at_remote_port_plus_rank(base, dp_index, tp_size):
    remote_port = ranks.engine_base_port(base, dp_index, tp_size)
    for r in range(tp_size):
        assert remote_port + r == ranks.side_channel_port(base, dp_index, r, tp_size)


def test_tp_1_is_nixl_connectors_base_plus_dp_index():
    assert [ranks.side_channel_port(5660, k, 0, 1) for k in range(4)] == [5660, 5661, 5662, 5663]


def test_dp_x_tp_numbers_ranks_dp_major():
    assert ports_of(5660, 2, 2) == [5660, 5661, 5662, 5663]
    assert ranks.engine_base_port(5660, 1, 2) == 5662


def test_a_rank_past_the_last_port_is_refused_naming_the_setting():
    assert ranks.port_scheme_problem(65534, 1, 1) is None
    problem = ranks.port_scheme_problem(65534, 1, 2)
    assert problem is not None and "side_channel_port" in problem and "65535" in problem and "65532" in problem


def test_a_rank_outside_its_tp_group_has_no_port():
    with pytest.raises(ValueError):
        ranks.side_channel_port(5660, 0, 2, 2)
    with pytest.raises(ValueError):
        ranks.side_channel_port(5660, -1, 0, 1)


def test_the_scheme_in_words_names_the_setting_and_the_rank():
    words = ranks.describe_scheme(5660, 1, 2)
    assert "side_channel_port" in words and "DP rank 1" in words
