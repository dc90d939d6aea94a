"""Greedy completions with logprobs, and a margin-aware comparison of two of them.

The P/D tests compare a candidate output (decode instance after a KV transfer) against a
reference (aggregated serving of the same prompt). Random tiny models have near-tied top tokens,
so a bit-level difference in the logits can legitimately flip a greedy choice. ``compare`` accepts
a differing token only where the *reference's own* top-1/top-2 logprob margin at that position is
below ``tie_margin`` (float32 noise floor on CPU is ~5e-7, bf16 ~4e-3; docs/testing.md),
and only if the two tokens are each other's alternatives; anything after an accepted tie is not
compared, since the sequences have legitimately diverged.

Logprob keys: vLLM's OpenAI completion response keys ``top_logprobs`` by *decoded token text*,
which is neither unique nor invertible for byte-level BPE (partial UTF-8 sequences all decode to
U+FFFD). We therefore send ``"return_tokens_as_token_ids": true`` (supported by vLLM 0.32.0's
``CompletionRequest``), which makes every key and every entry of ``logprobs.tokens`` the string
``"token_id:<id>"`` (``format_token_id_placeholder`` in vllm/entrypoints/generate/base/serving.py);
we parse the id back and cross-check ``logprobs.tokens`` against ``choices[0].token_ids``.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence
from pd_connector.urls import OPENER

__all__ = [
    "Completion",
    "CompletionError",
    "Verdict",
    "complete",
    "parse_completion",
    "compare",
    "top_margin",
]

_TOKEN_ID_PREFIX = "token_id:"


class CompletionError(RuntimeError):
    """Non-200 answer or a response we cannot interpret; carries status and body."""

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass
class Completion:
    prompt_ids: list[int]
    #: generated token ids, in order
    token_ids: list[int]
    #: logprob of each generated (chosen) token; empty if logprobs were not requested
    logprobs: list[float] = field(default_factory=list)
    #: per position: token id -> logprob for the top-k alternatives plus the chosen token
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None
    finish_reason: str | None = None
    elapsed_s: float = 0.0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


def _token_id(key: str) -> int:
    if not key.startswith(_TOKEN_ID_PREFIX):
        raise CompletionError(
            f"logprob key {key!r} is not of the form 'token_id:N'; did the server ignore "
            "return_tokens_as_token_ids?"
        )
    return int(key[len(_TOKEN_ID_PREFIX) :])


def parse_completion(raw: Mapping[str, Any], prompt_ids: Sequence[int] = ()) -> Completion:
    """Build a :class:`Completion` from a ``/v1/completions`` response body (one choice)."""
    try:
        choice = raw["choices"][0]
    except (KeyError, IndexError, TypeError) as e:
        raise CompletionError(f"response has no choices: {json.dumps(raw)[:500]}") from e
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise CompletionError("response has no choices[0].token_ids (return_token_ids not honoured)")
    token_ids = [int(t) for t in token_ids]
    logprobs: list[float] = []
    top: list[dict[int, float]] = []
    lp = choice.get("logprobs")
    if lp is not None:
        tokens = [_token_id(t) for t in lp.get("tokens") or []]
        if tokens != token_ids:
            raise CompletionError(f"logprobs.tokens {tokens} disagree with token_ids {token_ids}")
        logprobs = [float(x) if x is not None else math.nan for x in lp.get("token_logprobs") or []]
        for step in lp.get("top_logprobs") or []:
            top.append({_token_id(k): float(v) for k, v in (step or {}).items()})
    return Completion(
        prompt_ids=list(prompt_ids),
        token_ids=token_ids,
        logprobs=logprobs,
        top_logprobs=top,
        kv_transfer_params=raw.get("kv_transfer_params"),
        finish_reason=choice.get("finish_reason"),
        raw=dict(raw),
    )


def complete(
    base_url: str,
    model: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    logprobs: int | None = 5,
    kv_transfer_params: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    extra: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> Completion:
    """Greedy completion of a token-id prompt via ``POST base_url/v1/completions``.

    temperature 0 and ignore_eos (random models emit EOS early, which would shorten outputs and
    truncate comparisons); ``logprobs=k`` asks for the top-k alternatives (>= 2 for the margin
    check; 5 by default so that ties of more than two tokens are visible), None for none. ``extra`` is merged into the body last (e.g. ``{"seed": 1}``); ``headers``:
    more HTTP headers (e.g. vLLM's ``X-data-parallel-rank``).
    """
    body: dict[str, Any] = {
        "model": model,
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": int(max_tokens),
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stream": False,
    }
    if logprobs is not None:
        body["logprobs"] = int(logprobs)
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    body.update(extra or {})
    req = urllib.request.Request(
        f"{base_url.rstrip('/')}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    t0 = time.monotonic()
    try:
        with OPENER.open(req, timeout=timeout) as resp:
            text = resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        err = e.read().decode("utf-8", "replace")
        # 404 here usually means `model` differs from the server's --served-model-name.
        raise CompletionError(f"HTTP {e.code} from {base_url}: {err[:1000]}", e.code, err) from e
    elapsed = time.monotonic() - t0
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise CompletionError(f"non-JSON response from {base_url}: {text[:500]}", 200, text) from e
    out = parse_completion(raw, prompt_ids)
    out.elapsed_s = elapsed
    return out


def top_margin(top: Mapping[int, float]) -> float:
    """top-1 minus top-2 logprob at one position (inf if fewer than two alternatives known)."""
    values = sorted(top.values(), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else math.inf


@dataclass
class Verdict:
    #: same token ids, same length
    identical: bool
    #: identical, or differing only after an accepted near-tie (and within logprob_tol if given)
    ok: bool
    #: first position whose tokens differ (or the shorter length on a length mismatch), else None
    first_diff: int | None
    #: max |ref - cand| chosen-token logprob over the matching prefix (0.0 if not available)
    max_logprob_diff: float
    #: positions compared as equal (the matching prefix)
    n_matched: int = 0
    #: reference's top-1/top-2 margin at first_diff (None if no diff or unknown)
    ref_margin: float | None = None
    tie_accepted: bool = False
    reason: str = ""

    def describe(self) -> str:
        lp = f"max|dlogprob| {self.max_logprob_diff:.2e} over {self.n_matched} tokens"
        if self.identical:
            head = "identical"
        elif self.tie_accepted:
            head = f"near-tie accepted at {self.first_diff}"
        else:
            head = f"MISMATCH at {self.first_diff}"
        verdict = "OK" if self.ok else "FAIL"
        return f"{verdict}: {head}; {lp}" + (f"; {self.reason}" if self.reason else "")

    def __bool__(self) -> bool:
        return self.ok


def compare(
    reference: Completion,
    candidate: Completion,
    *,
    tie_margin: float,
    logprob_tol: float | None = None,
    require_cross_membership: bool = True,
) -> Verdict:
    """Compare ``candidate`` against ``reference`` token by token.

    - Tokens before the first difference must match exactly; over that prefix the chosen-token
      logprob difference is measured (and must be <= ``logprob_tol`` if given: a P/D offset error
      can shift logprobs without flipping a token).
    - At the first difference, accept it as noise only if the reference's margin between its token
      and the candidate's (top-1/top-2 if the candidate's is not among its alternatives) is below
      ``tie_margin`` and (with ``require_cross_membership``) each side's token is
      among the other side's returned alternatives (a genuine tie swaps the two top tokens; a
      desync typically picks an unrelated token). The rest is then not compared.
    - A length mismatch without an earlier accepted tie fails (both sides use ignore_eos and the
      same max_tokens, so lengths must agree).
    """
    ref, cand = reference.token_ids, candidate.token_ids
    n = min(len(ref), len(cand))
    have_lp = len(reference.logprobs) >= n and len(candidate.logprobs) >= n
    max_diff = 0.0
    first_diff: int | None = None
    for i in range(n):
        if ref[i] != cand[i]:
            first_diff = i
            break
        if have_lp:
            d = abs(reference.logprobs[i] - candidate.logprobs[i])
            max_diff = d if math.isnan(d) else max(max_diff, d)
    n_matched = first_diff if first_diff is not None else n
    lp_ok = logprob_tol is None or max_diff <= logprob_tol  # NaN compares False -> fails
    lp_reason = "" if lp_ok else f"logprob diff {max_diff:.2e} > tol {logprob_tol:.1e}"

    if first_diff is None:
        if len(ref) != len(cand):
            return Verdict(
                identical=False, ok=False, first_diff=n, max_logprob_diff=max_diff,
                n_matched=n_matched, reason=f"length {len(cand)} != reference {len(ref)}",
            )  # fmt: skip
        return Verdict(
            identical=True, ok=lp_ok, first_diff=None, max_logprob_diff=max_diff,
            n_matched=n_matched, reason=lp_reason,
        )  # fmt: skip

    i = first_diff
    r_tok, c_tok = ref[i], cand[i]
    ref_top = reference.top_logprobs[i] if i < len(reference.top_logprobs) else {}
    cand_top = candidate.top_logprobs[i] if i < len(candidate.top_logprobs) else {}
    margin: float | None = top_margin(ref_top) if ref_top else math.inf
    if math.isinf(margin):
        margin = None  # fewer than two alternatives known: no margin to judge by
    elif c_tok in ref_top and r_tok in ref_top:
        # The margin between the two tokens actually chosen: bf16 logits collide exactly, and a
        # three-way tie's third token is as legitimate a choice as the second (seen on the tiny
        # Qwen3-Next: margin 0 between top-1 and top-2, the candidate took a token tied with both).
        margin = ref_top[r_tok] - ref_top[c_tok]
    detail = f"ref {r_tok} vs cand {c_tok}"
    if margin is None:
        reason = f"{detail}; reference has no top-2 logprobs here (request logprobs>=2)"
        accepted = False
    elif margin >= tie_margin:
        reason = f"{detail}; ref margin {margin:.2e} >= tie_margin {tie_margin:.1e}"
        accepted = False
    elif require_cross_membership and (c_tok not in ref_top or (cand_top and r_tok not in cand_top)):
        reason = f"{detail}; ref margin {margin:.2e} is a tie but the tokens are not each other's alternatives"
        accepted = False
    else:
        reason = f"{detail}; ref margin {margin:.2e} < tie_margin {tie_margin:.1e}"
        accepted = True
    if lp_reason:
        reason = f"{reason}; {lp_reason}"
    return Verdict(
        identical=False, ok=accepted and lp_ok, first_diff=i, max_logprob_diff=max_diff,
        n_matched=n_matched, ref_margin=margin, tie_accepted=accepted, reason=reason,
    )  # fmt: skip
