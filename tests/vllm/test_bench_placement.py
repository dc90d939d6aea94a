"""``python -m benchmarks transfer --check-vllm``: the benchmark's KV-cache placement is vLLM's own
(``get_kv_cache_config_from_groups``, which vLLM 0.33 moved to kv_cache_planning.py)."""

import json

from benchmarks.transfer_shapes import child_check_vllm


def test_benchmark_placement_matches_vllms_get_kv_cache_config_from_groups(capsys):
    child_check_vllm()
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("CHECK ")][-1]
    cases = json.loads(line[len("CHECK "):])
    assert cases and all(case["match"] for case in cases), [c for c in cases if not c["match"]]
