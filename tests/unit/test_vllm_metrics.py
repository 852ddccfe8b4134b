"""Reading vLLM 0.32's own exposition (lines as a real server prints them)."""

from __future__ import annotations

from kvscope.redact import safe_url
from kvscope.sidecar.exposition.vllm_metrics import parse

# ruff: noqa: E501 - exposition lines are kept verbatim

TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25531914893617025
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 25.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0",num_gpu_blocks="48",num_cpu_blocks="None"} 1.0
"""


def test_parse_derives_free_blocks_from_usage() -> None:
    m = parse(TEXT)["0"]
    assert (m.model, m.running, m.waiting, m.preemptions) == ("tiny", 3, 7, 25)
    assert (m.num_gpu_blocks, m.block_size) == (48, 32)
    assert m.free_blocks == 35  # (1 - 12/47) * 47


def test_safe_url_drops_credentials() -> None:
    assert safe_url("http://user:pw@127.0.0.1:8000/x?token=1") == "http://127.0.0.1:8000/x"
