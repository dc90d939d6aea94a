"""D-side multi-turn reuse after a handoff, with prefix caching on (Mamba ``align`` mode).

The scenario of vllm#51295, scaled down: turn 1 has ``k*B + 1`` prompt tokens (the length that made
upstream fall to a full miss on D), turn 2 extends the conversation. P hands over N - 1 = k*B,
vLLM's prompt checkpoint, so D receives the recurrent state exactly where its own cache manager
checkpoints it, and D's turn 2 must hit its local prefix cache for the first k*B tokens.

Then every length around the grid (on, just above and well above one and two units): D
computes exactly its one-token tail (read from its own ``vllm:prompt_tokens_by_source``),
outputs match aggregated serving, P hands over the checkpoint below R that aggregated serving
keeps (core/checkpoints.py), and turn 2 on D hits at least what an aggregated conversation on A
in its own ``cache_salt`` namespace hits (references are salted too, so P's cache holds only
what P computed as P); turn 2 through P hits what the rule promises. At 2B + 20, D's turn 2
resumes on the received checkpoint below R and answers as aggregated serving does; with the
checkpoint withheld (negative control) its hit drops below aggregated serving's. Prefix
caching on one side only is pinned in process (tests/vllm/test_scheduler_integrity.py,
tests/vllm/test_checkpoint_handover.py): a third, uncached instance here froze on its first
connection in 2 of 5 runs (docs/operations.md, "Unanswered first calls").

The tests above run A as P with ``max_checkpoint_recompute`` 0 (P truncates its prefill to
N - 1 unless that is its checkpoint): the truncated path. The last two run the default with B as
P and A as D: P prefills the whole prompt and the handoff resumes on P's checkpoint C, directly
and behind vllm-router (the replay path, P's turn-2 hit at least aggregated serving's).

Qwen3-Next (GDN) is the only hybrid whose CPU kernels run prefix caching (the Mamba2 hybrids crash
in align mode, docs/testing.md); bf16, so outputs use the margin-aware oracle of
spec_matrix.check_bf16. Two kv_both instances: A is P and the aggregated reference, B is D (kept
free of reference traffic so its cache hits come only from the handoff).
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

from pd_connector.core.params import KEY_CHECKPOINTS, KEY_FIRST_TOKEN, KEY_RESUME, RESUME_FIRST_TOKEN
from rig.cpu_matrix import random_prompt
from rig.oracle import complete
from rig.spec_matrix import SPEC_EXTRA_CONFIG, InstanceSpec, handoff, make_instances, running
from rig.spec_matrix import check_bf16 as check
from rig.tiny_models import build_model
from rig import faults
from rig.ports import free_port
from rig.kv_events import HASH_ENV, KvEvents, by_group, kv_events_args
from rig.router import VllmRouter, router_binary

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def events_ports() -> tuple[int, int]:
    """Where A and B publish their KV events (test_kv_events_*)."""
    return free_port(), free_port()


@pytest.fixture(scope="module")
def pair(models_root, artifacts, events_ports):
    spec = InstanceSpec(
        model=str(build_model("qwen3_next_mtp", models_root)),
        log_dir=artifacts / "multiturn",
        max_model_len=2048,
        server_args=("--enable-prefix-caching", *kv_events_args(events_ports[0])),
        extra_config=SPEC_EXTRA_CONFIG,
        env=HASH_ENV,  # block hashes agree across the two instances (rig/kv_events.py)
    )
    # A as P truncates its prefill to N - 1 (a bound of 0 on D's extra tokens): the path the
    # tests above the last pin, checkpoints below R included. B keeps the default (P prefills
    # the whole prompt and the handoff resumes on its checkpoint), which the last test runs
    # with B as P and A as D.
    a = make_instances(dataclasses.replace(spec, extra_config={**SPEC_EXTRA_CONFIG, "max_checkpoint_recompute": 0}), ["off"])
    # B on the other core: two instances pinned to one core starve each other (cpu_binds). B
    # runs the rig's FaultInjectingConnector for the negative controls (inert unless asked).
    b_spec = dataclasses.replace(
        spec, log_dir=artifacts / "multiturn-d", faults=True,
        server_args=("--enable-prefix-caching", *kv_events_args(events_ports[1])),
    )
    b = make_instances(b_spec, ["off"], first_core=1)
    with running(a, b):
        yield a["off"], b["off"]


def _hits(inst) -> tuple[float, float]:
    s = inst.server
    return (s.metric("vllm:prefix_cache_hits_total") or 0.0, s.metric("vllm:prefix_cache_queries_total") or 0.0)


@pytest.mark.parametrize("k", [1, 2])
def test_turn_two_hits_the_decode_prefix_cache_after_a_handoff(pair, k):
    a, b = pair
    cache = b.server.cache_config()
    assert cache.get("mamba_cache_mode") == "align", cache
    block = int(cache["block_size"])
    turn1 = random_prompt(k * block + 1, seed=30 + k)
    params, out1 = handoff(a, b, turn1, MAX_TOKENS)
    assert params["replay_offset"] == k * block, params  # N - 1, vLLM's prompt checkpoint
    assert check(_salted(a, turn1, "ref"), out1).ok

    turn2 = turn1 + out1.token_ids + random_prompt(block // 2 + 7, seed=40 + k)
    before = _hits(b)
    params2, out2 = handoff(a, b, turn2, MAX_TOKENS)
    time.sleep(1.0)  # prefix-cache counters arrive with the step's stats
    after = _hits(b)
    hits = after[0] - before[0]
    assert hits >= k * block, f"turn 2 hit {hits} tokens on D, expected >= {k * block} (queries {after[1] - before[1]})"
    assert check(_salted(a, turn2, "ref"), out2).ok


# New tokens of turn 2 in the test below: a short user turn, so that D's first generated token
# lies 1 + MAX_TOKENS + 7 = 20 tokens past the checkpoint it resumes on (why: its docstring).
SHORT_TURN = 7


@pytest.mark.parametrize("corrupt", [False, True], ids=["as_received", "negative_control_corrupted_state"])
def test_turn_two_served_by_d_resumes_on_the_checkpoint_it_received(pair, corrupt):
    """D serves turn 2 itself from the recurrent state it received at the checkpoint k*B (its
    prefix-cache hit), and answers as aggregated serving does. The turn-2 handoff above cannot
    show that (P's state at its own offset replaces D's cached one). Negative control: the
    state corrupted on arrival (rig/fault_connector.py flips every byte of each state page, conv and
    SSM), so D's prefix cache holds a wrong state at k*B: turn 1, decoded one token past it,
    must differ from aggregated serving (the fault fired), and so must turn 2. (Turn 1 resumed
    one token early on P's state is no such control: D's cache still holds P's state at k*B,
    and turn 2 matched.)

    Turn 2 adds only SHORT_TURN tokens: the received state shows in D's output only for a few
    dozen tokens. The tiny Qwen3-Next's GDN heads forget their state by exp(-A * softplus(a +
    dt_bias)) per token, A = exp(A_log) drawn from (0, 16) by HF's init: at a = 0, 11 of 12 heads by
    30x and more per token, the slowest (A = 0.36) by about 0.6; past that, a corrupted state
    leaves only its trace in the full-attention KV of the first tokens D computed on it,
    diluted over the whole context. Measured (vLLM CPU, 12 prompts, outputs of 12 tokens):
    with turn 2's former B/2 + 7 new tokens (the first generated token 340 tokens past the
    checkpoint), the corrupted state moved the chosen-token logprobs by 2e-3 to 8e-3, under
    the oracle's 1e-2 (a near-tie flip accepted on 5 prompts): caught on 0 of 12, this
    control's own prompt included (it was an xfail, caught on one box and not on the next,
    read as "D's turn 2 does not always read the received state"). With SHORT_TURN: caught
    on 12 of 12, each at the first generated token; as received, D's outputs were
    bit-identical to aggregated serving's at both lengths."""
    a, b = pair
    block = int(b.server.cache_config()["block_size"])
    turn1 = random_prompt(block + 1, seed=60 + int(corrupt))
    params = a.prefill(turn1)
    assert params["replay_offset"] == block, params
    out1 = b.decode(turn1, {**params, faults.CORRUPT_STATE: True} if corrupt else params, MAX_TOKENS)
    first = check(_salted(a, turn1, f"d-turn1-{int(corrupt)}"), out1)
    turn2 = turn1 + out1.token_ids + random_prompt(SHORT_TURN, seed=70 + int(corrupt))
    time.sleep(1.0)  # turn 1's prefix-cache counters arrive with its last step's stats
    before = _hits(b)[0]
    out2 = b.reference(turn2, MAX_TOKENS)
    time.sleep(1.0)
    hits = _hits(b)[0] - before
    assert hits >= block, f"D's turn 2 hit {hits} tokens, expected its checkpoint {block}"
    second = check(_salted(a, turn2, f"d-turn2-{int(corrupt)}"), out2)
    compared = f"{MAX_TOKENS} greedy tokens and their logprobs vs aggregated serving (bf16 oracle)"
    if corrupt:
        assert not first.ok, (
            f"turn 1 decoded on D one token past the corrupted state matched ({compared}): "
            f"the fault did not fire? {first.describe()}"
        )
        assert not second.ok, (
            f"D's turn 2, resumed on its prefix-cache hit at {block} (the corrupted checkpoint) "
            f"{len(turn2) - block} tokens before its first output, matched ({compared}): {second.describe()}"
        )
    else:
        assert first.ok, f"turn 1 decoded on D after the handoff ({compared}): {first.describe()}"
        assert second.ok, (
            f"D's turn 2, resumed on its prefix-cache hit at {block} (the received checkpoint) "
            f"({compared}): {second.describe()}"
        )


def _salted(inst, prompt, salt, max_tokens=MAX_TOKENS):
    """Aggregated serving in its own prefix-cache namespace (vLLM's cache_salt)."""
    return complete(inst.server.base_url, inst.served_model_name, prompt, max_tokens, extra={"cache_salt": salt})


def _local_compute(inst) -> float:
    return inst.server.metric("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}) or 0.0


def _hit_delta(inst, send) -> float:
    before = _hits(inst)[0]
    send()
    time.sleep(1.0)  # prefix-cache counters arrive with the step's stats
    return _hits(inst)[0] - before


def _lengths(block: int) -> list[int]:
    b = block
    # On, just above and well above one and two units (2B + 20 = 1300 at B = 640: the issue's).
    return [b - 1, b, b + 1, b + 5, b + b // 4 + 5, 2 * b - b // 3, 2 * b - 1, 2 * b, 2 * b + 1, 2 * b + 20,
            2 * b + b // 4 + 5, 3 * b + 1]


def _sent(params) -> list[int]:
    """Positions of the prompt checkpoints below R that P handed over."""
    return [s["position"] for s in (params.get(KEY_CHECKPOINTS) or {}).get("states", [])]


def _bytes_read(inst) -> float:
    return inst.server.metric("vllm:pd_transfer_bytes_sum") or 0.0


@pytest.fixture(scope="module")
def turns(pair):
    """Per length around the grid, one conversation: turn 1 handed over from A to B (checked
    against aggregated serving), then turn 2 aggregated on A (its own cache_salt), through A as
    P, and on B; rows of offsets, D's computed tokens and turn-2 hits."""
    a, b = pair
    block = int(b.server.cache_config()["block_size"])
    rows = []
    for i, n in enumerate(_lengths(block)):
        turn1 = random_prompt(n, seed=300 + i)
        before, read_before = _local_compute(b), _bytes_read(b)
        params, out1 = handoff(a, b, turn1, MAX_TOKENS)
        time.sleep(1.0)
        computed = _local_compute(b) - before
        salt = f"agg-{n}"
        assert check(_salted(a, turn1, salt), out1).ok, n
        turn2 = turn1 + out1.token_ids + random_prompt(16, seed=400 + i)  # 3B+1 + 28 fits 2048 at B=640
        hit_agg = _hit_delta(a, lambda: _salted(a, turn2, salt, 1))
        hit_p = _hit_delta(a, lambda: a.prefill(turn2))
        hit_d = _hit_delta(b, lambda: b.reference(turn2, 1))
        checkpoint = get_mamba_prefill_checkpoint_position(n, block, False)
        rows.append(dict(n=n, offset=params.get("replay_offset"), computed=computed, checkpoint=checkpoint,
                         sent=_sent(params), bytes=_bytes_read(b) - read_before,
                         hit_aggregated=hit_agg, hit_p=hit_p, hit_d=hit_d))
        print(rows[-1])
    return rows


def test_d_computes_its_tail_and_hits_what_aggregated_serving_hits(turns):
    """D's local_compute grows by exactly 1 (its minimum) at every length; turn 2 on D hits at
    least the aggregated hit at every length, and where that hit is a checkpoint below R, P
    handed it over. Not vacuous: at B + 5 and 2B + 20 aggregated serving hits B and 2B, which D
    missed (hit 0) while it kept only the state at R. Where aggregated serving keeps nothing
    below R (B + B/4 + 5, 2B - B/3, 2B + B/4 + 5 on vLLM CPU's server: its chunks end on
    multiples of 128, mid-block there; core/checkpoints.CheckpointRule.split_block), P hands
    over nothing."""
    for row in turns:
        n = row["n"]
        assert row["offset"] == n - 1 and row["computed"] == 1, row
        assert row["hit_d"] >= row["hit_aggregated"], row
        if 0 < row["hit_aggregated"] < n - 1:
            assert row["hit_aggregated"] in row["sent"], row
    assert sum(bool(row["sent"]) and row["hit_aggregated"] in row["sent"] for row in turns) >= 2, turns


def test_turn_two_through_p_hits_what_aggregated_serving_hits(turns):
    """Turn 2 through P hits at least the aggregated conversation's hit, unless that hit needs
    state past the N - 1 tokens P computed. Not vacuous: at N = k*B + 1 aggregated serving hits
    k*B, and P did not (0 at N = B + 1) before it pinned the whole prompt's checkpoint past its
    truncation (checkpoints.checkpoint_to_keep). vLLM CPU's own aggregated hit falls below its
    checkpoint at some lengths (0 at 2B - 1 and 2B on the tiny Qwen3-Next): the reference is
    what aggregated serving achieves, not the checkpoint position."""
    on_grid = [row for row in turns if row["checkpoint"] == row["n"] - 1 > 0]
    assert on_grid and all(row["hit_aggregated"] == row["checkpoint"] for row in on_grid), on_grid
    for row in turns:
        n = row["n"]
        if row["hit_aggregated"] <= n - 1:
            assert row["hit_p"] >= row["hit_aggregated"], row


@pytest.mark.parametrize("withheld", [False, True], ids=["as_received", "negative_control_withheld"])
def test_turn_two_on_d_resumes_on_the_checkpoint_below_the_offset(pair, withheld):
    """N = 2B + 20 (1300 at B = 640): R = N - 1 lies above aggregated serving's checkpoint 2B,
    which P hands over besides the state at R. D serves turn 2 itself from it (a hit of 2B) and answers as
    aggregated serving does. Negative control: the same handoff with the checkpoint withheld
    (D places none: rig/fault_connector.py): the rest loads, and D's turn-2 hit falls below 2B."""
    a, b = pair
    block = int(b.server.cache_config()["block_size"])
    n = 2 * block + 20
    turn1 = random_prompt(n, seed=80 + int(withheld))
    params = a.prefill(turn1)
    assert params["replay_offset"] == n - 1 and _sent(params) == [2 * block], params
    read_before = _bytes_read(b)
    out1 = b.decode(turn1, {**params, faults.WITHHOLD_CHECKPOINTS: True} if withheld else params, MAX_TOKENS)
    assert check(_salted(a, turn1, f"ckpt-{int(withheld)}"), out1).ok
    turn2 = turn1 + out1.token_ids + random_prompt(16, seed=90 + int(withheld))
    time.sleep(1.0)  # turn 1's prefix-cache counters arrive with its last step's stats
    before = _hits(b)[0]
    out2 = b.reference(turn2, MAX_TOKENS)
    time.sleep(1.0)
    hits = _hits(b)[0] - before
    print(dict(n=n, withheld=withheld, hit_d=hits, bytes=_bytes_read(b) - read_before))
    if withheld:
        assert hits < 2 * block, f"D's turn 2 hit {hits} tokens with the checkpoint withheld"
    else:
        assert hits >= 2 * block, f"D's turn 2 hit {hits} tokens, expected the checkpoint {2 * block}"
    assert check(_salted(a, turn2, f"ckpt-turn2-{int(withheld)}"), out2).ok


KV_EVENT_MODES = ["replay", "zero_replay", "negative_control_withheld"]


@pytest.mark.parametrize("mode", KV_EVENT_MODES)
def test_d_announces_every_block_aggregated_serving_announces(pair, events_ports, mode):
    """KV events across the handoff (what a cache-aware router indexes): after A serves a prompt
    aggregated and then hands it over to B (replay, and zero replay with P's first token), B's
    ``BlockStored`` events include every (group, block hash) A announced, attention blocks and
    recurrent-state checkpoints alike. N = 2B + 20: the state at 2B is a checkpoint below R that
    P hands over (A truncates, test_turn_two_on_d_resumes_on_the_checkpoint_below_the_offset).
    Negative control: with that checkpoint withheld, B does not announce it."""
    a, b = pair
    block = int(b.server.cache_config()["block_size"])
    prompt = random_prompt(2 * block + 20, seed=900 + KV_EVENT_MODES.index(mode))
    with KvEvents(events_ports[0]) as on_a, KvEvents(events_ports[1]) as on_b:
        time.sleep(1.0)  # ZMQ's slow joiner: subscribed before anything is published
        mark = on_a.mark()
        reference = a.reference(prompt, MAX_TOKENS)
        aggregated = on_a.stored(mark)
        zero = mode == "zero_replay"
        params = a.prefill(prompt, **({KEY_RESUME: RESUME_FIRST_TOKEN} if zero else {}))
        mark = on_b.mark()
        if zero:
            first = params[KEY_FIRST_TOKEN]
            tokens = [first] + b.decode(prompt + [first], params, MAX_TOKENS - 1).token_ids
        else:
            withheld = mode == "negative_control_withheld"
            tokens = b.decode(prompt, {**params, faults.WITHHOLD_CHECKPOINTS: True} if withheld else params,
                              MAX_TOKENS).token_ids
        announced = on_b.stored(mark)
    missing = aggregated - announced
    row = dict(mode=mode, aggregated=by_group(aggregated), d=by_group(announced), missing=by_group(missing),
               same_tokens=tokens == reference.token_ids)
    print(row)
    assert aggregated and len(by_group(aggregated)) >= 2, row  # attention and state groups announced
    if mode == "negative_control_withheld":
        assert missing, row
    else:
        assert not missing, row

def test_whole_prompt_replay_resumes_on_ps_checkpoint_and_reuses_what_aggregated_serving_does(pair):
    """The default replay plan with real GDN state: B as P prefills the whole prompt as
    aggregated serving does and hands over the state it keeps at vLLM's prompt checkpoint C
    (not its tip, the state after all N tokens); A as D recomputes exactly N - R prompt tokens
    (its own ``local_compute``) and answers as aggregated serving does; turn 2 hits at least
    aggregated serving's on both sides. Runs last: B's prefix cache then holds P entries. Not
    vacuous: at B + 5 and 2B + 20, R = C lies below N - 1 (D recomputes 5 and 20 tokens), where a
    tip handed over as C (the state 5 or 20 tokens later) gave other text (tests/vllm/
    test_replay_turns.py pins the block)."""
    a, b = pair
    block = int(b.server.cache_config()["block_size"])
    below = 0
    for i, n in enumerate([block + 5, 2 * block + 20, block + 1, block + block // 4 + 5]):
        turn1 = random_prompt(n, seed=500 + i)
        before = _local_compute(a)
        params, out1 = handoff(b, a, turn1, MAX_TOKENS)
        time.sleep(1.0)
        r, computed = params.get("replay_offset"), _local_compute(a) - before
        checkpoint = get_mamba_prefill_checkpoint_position(n, block, False)
        row = dict(n=n, offset=r, computed=computed, checkpoint=checkpoint)
        print(row)
        assert r in (n - 1, checkpoint) and computed == n - r, row
        below += r < n - 1
        salt = f"whole-{n}"
        assert check(_salted(b, turn1, salt), out1).ok, row
        turn2 = turn1 + out1.token_ids + random_prompt(16, seed=600 + i)
        row["hit_aggregated"] = _hit_delta(b, lambda: _salted(b, turn2, salt, 1))
        row["hit_p"] = _hit_delta(b, lambda: b.prefill(turn2))
        row["hit_d"] = _hit_delta(a, lambda: a.reference(turn2, 1))
        assert row["hit_p"] >= row["hit_aggregated"] and row["hit_d"] >= row["hit_aggregated"], row
    assert below >= 2, "no length resumed below N - 1 on P's checkpoint"


@pytest.mark.skipif(router_binary() is None, reason="vllm-router is not installed (scripts/setup_router_venv.sh)")
def test_behind_vllm_router_p_and_d_reuse_what_aggregated_serving_does(pair, artifacts):
    """The replay path behind vllm-router (it sends D the client's request unchanged, so no
    first token travels): B as P prefills the whole prompt and the handoff resumes on its
    checkpoint C, A as D computes N - C prompt tokens and answers as aggregated serving does, and
    turn 2 through the router hits P's prefix cache at least as far as aggregated serving's."""
    a, b = pair
    block = int(b.server.cache_config()["block_size"])
    with VllmRouter([b.server.base_url], [a.server.base_url], log_path=artifacts / "multiturn-router" / "vllm-router.log") as router:
        for i, n in enumerate([block + 5, 2 * block + 20]):
            checkpoint = get_mamba_prefill_checkpoint_position(n, block, False)
            turn1 = random_prompt(n, seed=700 + i)
            before = _local_compute(a)
            out1 = complete(router.url, a.served_model_name, turn1, MAX_TOKENS)
            time.sleep(1.0)
            row = dict(n=n, checkpoint=checkpoint, computed=_local_compute(a) - before)
            salt = f"router-{n}"
            assert row["computed"] == n - checkpoint and check(_salted(b, turn1, salt), out1).ok, row
            turn2 = turn1 + out1.token_ids + random_prompt(16, seed=800 + i)
            row["hit_aggregated"] = _hit_delta(b, lambda: _salted(b, turn2, salt, 1))
            row["hit_p"] = _hit_delta(b, lambda: complete(router.url, a.served_model_name, turn2, 1))
            print(row)
            assert row["hit_aggregated"] >= checkpoint and row["hit_p"] >= row["hit_aggregated"], row
