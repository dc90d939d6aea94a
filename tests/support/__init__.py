"""Test-only tooling, imported by tests as ``support`` (tests/conftest.py puts tests/ on
sys.path): the fake upstreams of the proxy and check tests, vLLM-built pages for the shard-layout
tests, the TP and DP matrices of tests/e2e, vllm-router in front of test servers, the handoff
tests' strategies.

What a shipped tool also needs at run time (the demo, ``pd-connector bench``, scripts/) lives in
``pd_connector.dev.rig`` instead. Nothing in pd_connector imports this package
(tests/unit/test_house.py).
"""
