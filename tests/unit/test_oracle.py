"""Pure tests of rig.oracle (no server)."""

import math

import pytest

from rig.oracle import (
    Completion,
    CompletionError,
    compare,
    parse_completion,
    top_margin,
)


def comp(tokens, lps=None, tops=None):
    """A Completion whose chosen tokens are greedy top-1 unless `tops` says otherwise."""
    lps = lps if lps is not None else [-1.0] * len(tokens)
    if tops is None:
        tops = [{t: lp, (t + 1) % 1000: lp - 1.0} for t, lp in zip(tokens, lps)]
    return Completion(prompt_ids=[5, 6, 7], token_ids=list(tokens), logprobs=list(lps), top_logprobs=tops)


def test_identical():
    a = comp([10, 11, 12], [-1.0, -2.0, -3.0])
    b = comp([10, 11, 12], [-1.0, -2.0000004, -3.0])
    v = compare(a, b, tie_margin=1e-5)
    assert v.identical and v.ok and v.first_diff is None
    assert v.max_logprob_diff == pytest.approx(4e-7, rel=1e-3)
    assert v.n_matched == 3
    assert v.describe().startswith("OK: identical")
    assert bool(v)


def test_clear_mismatch_fails():
    a = comp([10, 11, 12])  # margin 1.0 everywhere
    b = comp([10, 99, 12])
    v = compare(a, b, tie_margin=1e-5)
    assert not v.identical and not v.ok and v.first_diff == 1
    assert v.ref_margin == pytest.approx(1.0)
    assert not v.tie_accepted
    assert "MISMATCH at 1" in v.describe()
    assert not bool(v)


def test_near_tie_accepted_and_rest_ignored():
    ref_tops = [{10: -1.0, 20: -2.0}, {11: -1.0, 42: -1.0000001}, {12: -1.0, 13: -3.0}]
    cand_tops = [{10: -1.0, 20: -2.0}, {42: -1.0, 11: -1.0000002}, {7: -1.0, 8: -3.0}]
    a = comp([10, 11, 12], [-1.0, -1.0, -1.0], ref_tops)
    b = comp([10, 42, 7], [-1.0, -1.0, -1.0], cand_tops)  # diverges afterwards: not compared
    v = compare(a, b, tie_margin=1e-5)
    assert not v.identical and v.ok and v.tie_accepted
    assert v.first_diff == 1 and v.n_matched == 1
    assert v.ref_margin == pytest.approx(1e-7, abs=1e-9)
    assert "near-tie accepted at 1" in v.describe()


def test_tie_margin_is_the_reference_margin_not_candidate():
    # Reference is well separated at the diff; candidate claims a tie: not accepted.
    a = comp([10, 11], [-1.0, -1.0], [{10: -1.0, 20: -2.0}, {11: -0.5, 42: -2.5}])
    b = comp([10, 42], [-1.0, -1.0], [{10: -1.0, 20: -2.0}, {42: -1.0, 11: -1.0}])
    v = compare(a, b, tie_margin=1e-3)
    assert not v.ok and v.ref_margin == pytest.approx(2.0)


def test_tie_requires_cross_membership():
    # Reference top-2 is near-tied, but the candidate picked a token outside it.
    a = comp([10, 11], [-1.0, -1.0], [{10: -1.0, 20: -2.0}, {11: -1.0, 42: -1.0000001}])
    b = comp([10, 77], [-1.0, -1.0], [{10: -1.0, 20: -2.0}, {77: -0.1, 5: -3.0}])
    assert not compare(a, b, tie_margin=1e-5).ok
    assert compare(a, b, tie_margin=1e-5, require_cross_membership=False).ok


def test_three_way_bf16_tie_is_accepted_when_the_candidate_token_is_tied_too():
    """Regression (tiny Qwen3-Next, bf16, n=103): top-1 and top-2 exactly tied, the candidate
    took a third token with the same logprob. With only top-2 alternatives requested that read
    as a desync; the margin is now taken between the two tokens actually chosen."""
    ref_tops = [{10: -1.0, 20: -2.0}, {11: -2.5, 42: -2.5, 77: -2.5, 5: -3.0}]
    a = comp([10, 11], [-1.0, -2.5], ref_tops)
    b = comp([10, 77], [-1.0, -2.5], [{10: -1.0, 20: -2.0}, {77: -2.5, 11: -2.5, 42: -2.5}])
    v = compare(a, b, tie_margin=1e-3)
    assert v.ok and v.tie_accepted and v.ref_margin == 0.0
    # A candidate token among the alternatives but far below the reference's is no tie, even
    # though the reference's own top-2 are tied.
    c = comp([10, 5], [-1.0, -3.0], [{10: -1.0, 20: -2.0}, {5: -3.0, 11: -2.5}])
    v = compare(a, c, tie_margin=1e-3)
    assert not v.ok and v.ref_margin == pytest.approx(0.5)


def test_missing_top2_never_accepts():
    a = comp([10, 11], [-1.0, -1.0], [{10: -1.0}, {11: -1.0}])
    b = comp([10, 12], [-1.0, -1.0], [{10: -1.0}, {12: -1.0}])
    v = compare(a, b, tie_margin=1.0)
    assert not v.ok and v.ref_margin is None and "logprobs>=2" in v.reason


def test_logprob_tolerance_over_matching_prefix():
    a = comp([10, 11, 12], [-1.0, -2.0, -3.0])
    b = comp([10, 11, 12], [-1.0, -2.003, -3.0])
    assert compare(a, b, tie_margin=1e-5).ok
    v = compare(a, b, tie_margin=1e-5, logprob_tol=1e-5)
    assert v.identical and not v.ok and "logprob diff" in v.reason
    assert v.max_logprob_diff == pytest.approx(3e-3, rel=1e-3)


def test_logprob_diff_measured_only_before_first_diff():
    ref_tops = [{10: -1.0, 20: -2.0}, {11: -1.0, 42: -1.0000001}]
    a = comp([10, 11], [-1.0, -1.0], ref_tops)
    b = comp([10, 42], [-1.0000002, -5.0], [{10: -1.0, 20: -2.0}, {42: -5.0, 11: -5.0000001}])
    v = compare(a, b, tie_margin=1e-5)
    assert v.ok and v.max_logprob_diff == pytest.approx(2e-7, rel=1e-2)


def test_length_mismatch_fails():
    v = compare(comp([10, 11, 12]), comp([10, 11]), tie_margin=1e-5)
    assert not v.identical and not v.ok and v.first_diff == 2 and "length" in v.reason


def test_first_token_diff():
    a = comp([10], [-1.0], [{10: -1.0, 20: -1.0 - 1e-8}])
    b = comp([20], [-1.0], [{20: -1.0, 10: -1.0 - 1e-8}])
    v = compare(a, b, tie_margin=1e-6)
    assert v.ok and v.first_diff == 0 and v.n_matched == 0 and v.max_logprob_diff == 0.0


def test_nan_logprob_fails_tolerance():
    a = comp([10, 11], [-1.0, math.nan])
    b = comp([10, 11], [-1.0, -1.0])
    assert not compare(a, b, tie_margin=1e-5, logprob_tol=1e-3).ok


def test_top_margin():
    assert top_margin({1: -0.5, 2: -1.5, 3: -0.7}) == pytest.approx(0.2)
    assert math.isinf(top_margin({1: -0.5}))


def _response(tokens, lps, tops, kv=None):
    return {
        "id": "cmpl-1",
        "choices": [
            {
                "index": 0,
                "text": "xx",
                "token_ids": tokens,
                "finish_reason": "length",
                "logprobs": {
                    "text_offset": [0] * len(tokens),
                    "token_logprobs": lps,
                    "tokens": [f"token_id:{t}" for t in tokens],
                    "top_logprobs": [{f"token_id:{k}": v for k, v in d.items()} for d in tops],
                },
            }
        ],
        "kv_transfer_params": kv,
    }


def test_parse_completion_maps_token_id_keys():
    raw = _response([17, 900], [-0.1, -2.0], [{17: -0.1, 33: -2.5}, {900: -2.0, 4: -2.1}], kv={"a": 1})
    c = parse_completion(raw, [1, 2, 3])
    assert c.token_ids == [17, 900]
    assert c.logprobs == [-0.1, -2.0]
    assert c.top_logprobs == [{17: -0.1, 33: -2.5}, {900: -2.0, 4: -2.1}]
    assert c.kv_transfer_params == {"a": 1}
    assert c.prompt_ids == [1, 2, 3] and c.finish_reason == "length"


def test_parse_completion_rejects_text_keys():
    raw = _response([17], [-0.1], [{17: -0.1}])
    raw["choices"][0]["logprobs"]["top_logprobs"] = [{"hello": -0.1}]
    raw["choices"][0]["logprobs"]["tokens"] = ["hello"]
    with pytest.raises(CompletionError, match="token_id:N"):
        parse_completion(raw)


def test_parse_completion_requires_token_ids():
    raw = _response([17], [-0.1], [{17: -0.1}])
    del raw["choices"][0]["token_ids"]
    with pytest.raises(CompletionError, match="return_token_ids"):
        parse_completion(raw)


def test_parse_completion_cross_checks_tokens():
    raw = _response([17], [-0.1], [{17: -0.1}])
    raw["choices"][0]["logprobs"]["tokens"] = ["token_id:18"]
    with pytest.raises(CompletionError, match="disagree"):
        parse_completion(raw)


def test_parse_completion_without_logprobs():
    raw = _response([17], [-0.1], [{17: -0.1}])
    raw["choices"][0]["logprobs"] = None
    c = parse_completion(raw)
    assert c.token_ids == [17] and c.logprobs == [] and c.top_logprobs == []
