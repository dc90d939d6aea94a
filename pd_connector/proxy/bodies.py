"""What the proxy sends P and D for one client request (pure: no I/O).

The proxy owns the ``kv_transfer_params`` field: anything the client put there is replaced on P
and dropped on D, so a client cannot make D pull blocks that P never produced for its request.
"""

from __future__ import annotations

import copy

from pd_connector.core.params import KEY_DECODE_REQUESTS, KEY_MIN_RECOMPUTE, PREFILL_REQUEST_PARAMS

# The OpenAI routes split into a prefill and a decode.
ROUTES = ("/v1/completions", "/v1/chat/completions")

PREFILL_KV_PARAMS = PREFILL_REQUEST_PARAMS
# Fields that would make P generate more than one token or hold the response open.
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens")


def build_prefill_body(body: dict, decode_min_recompute: int | None = None) -> dict:
    """P's body: the client's request cut down to a one-token, non-streamed prefill (zero
    replay adds its fields on top: ``first_token.prefill_body``)."""
    p = copy.deepcopy(body)
    p["stream"] = False
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    for key in _PREFILL_DROP:
        p.pop(key, None)
    params = dict(PREFILL_KV_PARAMS)
    if decode_min_recompute is not None:
        # D's floor on recomputed prompt tokens; P picks a replay offset both sides accept.
        params[KEY_MIN_RECOMPUTE] = int(decode_min_recompute)
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        # n samples share one prompt: P prefills it once (vLLM would prefill n children and
        # return one child's params) and its lease waits for D's n requests.
        p["n"] = 1
        params[KEY_DECODE_REQUESTS] = n
    p["kv_transfer_params"] = params
    return p


def build_decode_body(body: dict, kv_params: dict | None) -> dict:
    """D's body: the client's original body plus P's params (if any; else D computes locally)."""
    d = dict(body)  # shallow: nothing below the top level is modified
    d.pop("kv_transfer_params", None)
    if kv_params:
        d["kv_transfer_params"] = kv_params
    return d
