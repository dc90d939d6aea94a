"""Blocking HTTP to one vLLM server for ``pd-connector check`` (standard library only, so
``check`` runs where aiohttp is not installed), and parsing of what vLLM answers.
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from pd_connector.urls import OPENER

DEFAULT_TIMEOUT_S = 120.0


@dataclass
class Answer:
    status: int | None  # None: no HTTP answer at all
    data: Any = None  # parsed JSON, or None
    text: str = ""
    elapsed_s: float = 0.0
    error: str | None = None  # why there was no answer

    def message(self) -> str:
        """Short description of a failed answer: the server's own error message if it sent one."""
        if self.status is None:
            return self.error or "no answer"
        err = self.data.get("error") if isinstance(self.data, dict) else None
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
        elif isinstance(self.data, dict) and self.data.get("message"):
            text = str(self.data["message"])
        else:
            text = self.text
        return f"HTTP {self.status}: {text.strip()[:300]}"


def http_request(url: str, body: dict | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 headers: dict[str, str] | None = None) -> Answer:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    t0 = time.monotonic()
    try:
        with OPENER.open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, ConnectionRefusedError):
            why = "connection refused"
        elif isinstance(reason, TimeoutError) or "timed out" in str(reason):
            why = f"no answer within {timeout:g} s"
        else:
            why = str(reason)
        return Answer(None, error=why, elapsed_s=time.monotonic() - t0)
    except (TimeoutError, OSError, http.client.HTTPException) as e:  # e.g. a read timeout
        why = f"no answer within {timeout:g} s" if isinstance(e, TimeoutError) else (
            f"{type(e).__name__}: {e}")
        return Answer(None, error=why, elapsed_s=time.monotonic() - t0)
    elapsed = time.monotonic() - t0
    text = raw.decode("utf-8", "replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    return Answer(status, parsed, text, elapsed)


@dataclass
class Generation:
    token_ids: list[int]
    top: list[dict[int, float]]  # per position: token id -> logprob (empty if not returned)
    text: str


def parse_generation(data: Any) -> Generation | None:
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        return None
    ids = choice.get("token_ids")
    lp = choice.get("logprobs") or {}
    top: list[dict[int, float]] = []
    try:
        for step in lp.get("top_logprobs") or []:
            top.append({int(str(k).rsplit(":", 1)[-1]): float(v) for k, v in (step or {}).items()})
        if ids is None and lp.get("tokens"):
            ids = [int(str(t).rsplit(":", 1)[-1]) for t in lp["tokens"]]
    except ValueError:
        top = []
    return Generation([int(t) for t in ids or []], top, str(choice.get("text") or ""))



_EVENT_RE = re.compile(r'^vllm:pd_events_total\{([^}]*)\}\s+(\S+)', re.M)
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_pd_events(text: str) -> dict[str, float]:
    """``vllm:pd_events_total`` samples summed by their ``event`` label."""
    out: dict[str, float] = {}
    for labels, value in _EVENT_RE.findall(text):
        event = dict(_LABEL_RE.findall(labels)).get("event")
        if event is not None:
            try:
                out[event] = out.get(event, 0.0) + float(value)
            except ValueError:
                continue
    return out


def read_events(url: str, timeout: float) -> dict[str, float] | None:
    ans = http_request(url + "/metrics", timeout=min(timeout, 10.0))
    if ans.status != 200:
        return None
    return parse_pd_events(ans.text)
