"""Upstream pools for the proxy: selection policy, health state, in-flight counts and the proxy's
own Prometheus metrics.

Everything here runs on the proxy's single event loop, so no locks are needed: state changes
happen between awaits.

Health model (one pool each for P and D):

- an upstream starts healthy; the background poll (``health_loop``) or a probe from the proxy's
  ``/health`` sets it from the upstream's ``/health`` (200 = healthy);
- a request error (connection refused/reset, timeout) marks it unhealthy at once;
- any HTTP answer to a request other than a 5xx marks it healthy again;
- selection skips unhealthy upstreams, unless every upstream of the pool is unhealthy: then it
  tries them all anyway (stale health state must never refuse a request on its own);
- with the poll disabled (``recover_after_s`` set instead), an upstream marked unhealthy becomes
  selectable again that many seconds later, so a transient error does not exclude it forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import aiohttp

logger = logging.getLogger("pd_connector.proxy.server")

POLICIES = ("least-loaded", "round-robin")
DEFAULT_POLICY = "least-loaded"


@dataclass(eq=False)
class Upstream:
    """One vLLM instance (P or D) as the proxy sees it."""

    role: str  # "prefill" | "decode"
    url: str
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0  # requests sent (each attempt counts)
    stale_connection_retries: int = 0  # resent after a kept-alive connection closed under them
    marked_unhealthy: int = 0  # healthy -> unhealthy transitions
    last_error: str | None = None
    probe_status: int | None = None  # HTTP status of the last /health probe (None: no answer)
    changed_at: float = field(default_factory=time.monotonic)

    def snapshot(self) -> dict:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "status": self.probe_status,
            "marked_unhealthy": self.marked_unhealthy,
            "last_error": self.last_error,
        }


class Pool:
    """The P or the D instances, with a selection policy.

    ``least-loaded`` picks the upstream with the fewest requests in flight *at this proxy*; ties
    (including the all-idle case) go round-robin. ``round-robin`` ignores load.
    """

    def __init__(
        self,
        role: str,
        urls: Sequence[str],
        policy: str = DEFAULT_POLICY,
        *,
        recover_after_s: float | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if not urls:
            raise ValueError(f"need at least one {role} URL")
        unique = list(dict.fromkeys(urls))
        if len(unique) != len(urls):
            # An instance is one upstream (its load and health are per instance): a URL listed
            # twice would otherwise get a double round-robin share.
            logger.warning("%s URLs listed more than once, using each once: %s", role, unique)
        self.role, self.policy, self.recover_after_s = role, policy, recover_after_s
        self.upstreams = [Upstream(role, u) for u in unique]
        self._next = 0  # round-robin cursor

    def __len__(self) -> int:
        return len(self.upstreams)

    @property
    def urls(self) -> list[str]:
        return [u.url for u in self.upstreams]

    @property
    def all_down(self) -> bool:
        return not any(u.healthy for u in self.upstreams)

    def _selectable(self, up: Upstream, now: float) -> bool:
        if up.healthy:
            return True
        return self.recover_after_s is not None and now - up.changed_at >= self.recover_after_s

    def select(self, exclude: Iterable[str] = ()) -> Upstream:
        """Pick an upstream, avoiding the URLs in ``exclude`` when any other is left.

        Unhealthy upstreams are skipped while a healthy one remains; when none does, all of them
        are candidates again (the health state may be stale; the request decides).
        """
        excluded = set(exclude)
        n = len(self.upstreams)
        ordered = [self.upstreams[(self._next + i) % n] for i in range(n)]
        candidates = [u for u in ordered if u.url not in excluded] or ordered
        now = time.monotonic()
        candidates = [u for u in candidates if self._selectable(u, now)] or candidates
        if self.policy == "least-loaded":
            chosen = min(candidates, key=lambda u: u.in_flight)  # first of ties: round-robin
        else:
            chosen = candidates[0]
        self._next = (self.upstreams.index(chosen) + 1) % n
        return chosen

    @contextlib.contextmanager
    def track(self, up: Upstream) -> Iterator[Upstream]:
        """Count a request to ``up`` as in flight for the duration of the block."""
        up.in_flight += 1
        up.requests += 1
        try:
            yield up
        finally:
            up.in_flight -= 1

    def mark_unhealthy(self, up: Upstream, reason: str) -> None:
        up.last_error = reason
        if up.healthy:
            up.healthy, up.changed_at = False, time.monotonic()
            up.marked_unhealthy += 1
            logger.warning("%s instance %s marked unhealthy: %s", self.role, up.url, reason)
        elif self.recover_after_s is not None:
            up.changed_at = time.monotonic()  # failed again after its grace period: restart it

    def mark_healthy(self, up: Upstream) -> None:
        if not up.healthy:
            up.healthy, up.changed_at = True, time.monotonic()
            logger.info("%s instance %s is healthy again", self.role, up.url)

    def snapshot(self) -> list[dict]:
        return [u.snapshot() for u in self.upstreams]


# ---- health probes ------------------------------------------------------------------------------

async def probe(session: aiohttp.ClientSession, pool: Pool, up: Upstream, timeout: float) -> bool:
    """GET ``up.url/health`` and record the result in ``pool``; True when it answered 200."""
    try:
        async with session.get(
            up.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            await resp.read()
            up.probe_status = resp.status
            ok = resp.status == 200
            reason = None if ok else f"/health answered HTTP {resp.status}"
    except asyncio.TimeoutError:
        up.probe_status, ok, reason = None, False, f"/health timed out after {timeout:g} s"
    except aiohttp.ClientError as e:
        up.probe_status, ok, reason = None, False, f"/health failed: {type(e).__name__}: {e}"
    if ok:
        pool.mark_healthy(up)
    else:
        pool.mark_unhealthy(up, reason or "unhealthy")
    return ok


async def probe_all(session: aiohttp.ClientSession, pools: Sequence[Pool], timeout: float) -> None:
    await asyncio.gather(*(probe(session, p, u, timeout) for p in pools for u in p.upstreams))


async def health_loop(
    session: aiohttp.ClientSession, pools: Sequence[Pool], interval: float, timeout: float
) -> None:
    """Probe every upstream now and then every ``interval`` seconds, until cancelled."""
    while True:
        try:
            await probe_all(session, pools, timeout)
        except Exception:  # never let the poller die: selection would freeze on stale state
            logger.exception("health poll failed")
        await asyncio.sleep(interval)


# ---- the proxy's own metrics --------------------------------------------------------------------

class ProxyMetrics:
    """Counters rendered as Prometheus text (exposition format 0.0.4) by hand."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()  # (route, outcome)
        self.prefill_retries = 0
        self.decode_fallbacks = 0
        self.prefill_without_params = 0
        self.resume: Counter[tuple[str, str]] = Counter()  # (mode, reason)

    def count_request(self, route: str, outcome: str) -> None:
        self.requests[(route, outcome)] += 1

    def count_resume(self, mode: str, reason: str) -> None:
        self.resume[(mode, reason)] += 1

    def render(self, pools: Sequence[Pool]) -> str:
        out: list[str] = []

        def family(name: str, kind: str, doc: str, samples: Iterable[tuple[dict, float]]) -> None:
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                out.append(f"{name}{{{text}}} {_num(value)}" if text else f"{name} {_num(value)}")

        family("pd_proxy_requests_total", "counter",
               "Client requests by route and outcome.",
               [({"route": r, "outcome": o}, n) for (r, o), n in sorted(self.requests.items())])
        family("pd_proxy_prefill_retries_total", "counter",
               "Prefill attempts repeated after a P connection error, timeout or 5xx.",
               [({}, self.prefill_retries)])
        family("pd_proxy_decode_fallbacks_total", "counter",
               "Decodes re-sent to another D, without kv_transfer_params, after the first D "
               "failed before answering.",
               [({}, self.decode_fallbacks)])
        family("pd_proxy_prefill_without_params_total", "counter",
               "Prefills whose answer carried no kv_transfer_params (D computes the prompt).",
               [({}, self.prefill_without_params)])
        family("pd_proxy_resume_total", "counter",
               "Requests P answered, by how D resumed them: mode first_token (zero replay; "
               "reason decoded, prefill_finished when P's token ended the request, prefill_only "
               "for one-token requests) or replay (the standard flow; reason: why).",
               [({"mode": m, "reason": r}, n) for (m, r), n in sorted(self.resume.items())])
        ups = [u for p in pools for u in p.upstreams]
        family("pd_proxy_upstream_marked_unhealthy_total", "counter",
               "Times an upstream went from healthy to unhealthy.",
               [({"role": u.role, "upstream": u.url}, u.marked_unhealthy) for u in ups])
        family("pd_proxy_upstream_healthy", "gauge",
               "1 if the upstream is currently considered healthy, else 0.",
               [({"role": u.role, "upstream": u.url}, int(u.healthy)) for u in ups])
        family("pd_proxy_upstream_in_flight", "gauge",
               "Requests in flight from this proxy to the upstream.",
               [({"role": u.role, "upstream": u.url}, u.in_flight) for u in ups])
        family("pd_proxy_upstream_requests_total", "counter",
               "Requests sent to the upstream (every attempt counts).",
               [({"role": u.role, "upstream": u.url}, u.requests) for u in ups])
        family("pd_proxy_upstream_stale_connection_retries_total", "counter",
               "Requests resent to the upstream on a new connection because it closed the "
               "kept-alive one before answering (keep-alive timeout race).",
               [({"role": u.role, "upstream": u.url}, u.stale_connection_retries) for u in ups])
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
