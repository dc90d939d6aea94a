"""``pd-connector check`` behind a data-parallel API server: one handoff per P engine.

vLLM's API server sends a request to DP engine k when it carries ``X-data-parallel-rank: k``
(``_get_data_parallel_rank``, vllm/entrypoints/generate/base/serving.py) and answers 400
"data_parallel_rank k is out of range [0, n)" past its last engine, so the engines are found by
asking for rank 1, 2, ... and each is checked on its own.
"""

from __future__ import annotations

from typing import Any, Callable

from pd_connector.check.client import Generation, http_request, parse_generation
from pd_connector.core.params import KEY_REPLAY_OFFSET, PREFILL_REQUEST_PARAMS

RANK_HEADER = "X-data-parallel-rank"
MAX_DP_ENGINES = 64
PREFILL_KV_PARAMS = PREFILL_REQUEST_PARAMS

def _out_of_range(ans: Any) -> bool:
    return ans.status == 400 and "out of range" in ans.text


def check_dp_engines(rep: Any, p_url: str, d_url: str, base: dict, gen_body: dict,
                     salt: str, plain: Generation, timeout: float, say: Callable[[str], None]) -> None:
    """One handoff from each of P's DP engines (found by asking for rank 1, 2, ... until P's API
    server says the rank is out of range), each to D's engines in turn."""
    d_engines = 1
    while d_engines < MAX_DP_ENGINES:
        probe = http_request(d_url + "/v1/completions", {**base, "max_tokens": 1},
                             timeout, headers={RANK_HEADER: str(d_engines)})
        if probe.status != 200:
            break
        d_engines += 1
    reached: list[str] = []
    for rank in [*range(1, MAX_DP_ENGINES), 0]:
        if rank == 0 and not reached:
            return  # one engine behind P's API server: the check above was its handoff
        say(f"P: prefill on DP engine {rank}")
        ans = http_request(p_url + "/v1/completions", {
            **base, "max_tokens": 1, "kv_transfer_params": dict(PREFILL_KV_PARAMS),
            "cache_salt": f"pdcheck-{salt}-dp{rank}"}, timeout, headers={RANK_HEADER: str(rank)})
        if _out_of_range(ans) or (rank == 1 and ans.status == 400):
            if rank == 1:
                return
            continue  # past P's last engine: rank 0 comes last
        raw = ans.data.get("kv_transfer_params") if isinstance(ans.data, dict) else None
        if ans.status != 200 or not isinstance(raw, dict) or KEY_REPLAY_OFFSET not in raw:
            rep.problems.append(f"P's DP engine {rank} failed the prefill or returned no handoff "
                                f"({ans.message()}): see P's log for EngineCore_DP{rank}")
            reached.append(f"DP engine {rank}: failed")
            continue
        engine = f"{raw.get('remote_engine_id')} at {raw.get('remote_host')}:{raw.get('remote_port')}"
        d_rank = rank % d_engines
        got = http_request(d_url + "/v1/completions", {
            **gen_body, "kv_transfer_params": raw, "cache_salt": f"pdcheck-{salt}-dp{rank}"},
            timeout, headers={RANK_HEADER: str(d_rank)} if d_engines > 1 else None)
        gen = parse_generation(got.data) if got.status == 200 else None
        if gen is None:
            rep.problems.append(f"D (engine {d_rank}) failed the decode with the params of P's DP "
                                f"engine {rank}, {engine} ({got.message()}): see D's log")
            reached.append(f"DP engine {rank}: {engine}, D engine {d_rank} failed")
            continue
        same = gen.token_ids == plain.token_ids if gen.token_ids or plain.token_ids else gen.text == plain.text
        if not same:
            rep.problems.append(f"D (engine {d_rank}) with the handoff from P's DP engine {rank} "
                                f"({engine}) differs from D computing the prompt itself "
                                f"({gen.token_ids} vs {plain.token_ids}): see both logs")
        reached.append(f"DP engine {rank}: {engine} -> D engine {d_rank}, "
                       f"{'tokens match' if same else 'tokens DIFFER'}")
    rep.info.append(f"P's DP engines reached ({len(reached)}; D has {d_engines}): " + "; ".join(reached))

