"""Talking HTTP to vLLM servers and the proxy with the standard library (check, dev tooling)."""

from __future__ import annotations

import urllib.request

# Ignores http_proxy/https_proxy: P, D and the proxy are reached directly, and an operator's
# proxy variables must not route loopback or cluster-internal calls through a corporate proxy.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def normalize_url(url: str) -> str:
    """Accept ``host:port`` as well as ``http://host:port/``; return without trailing slash."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")
