"""Spans reproduce stepping on real traces too: every preset, per-request results identical (token
counts, preemptions, finish order; times to 1e-9 relative). Skips when ../shared/traces is absent."""

import pytest

from kvsim import run  # with the trace readers
from sim.config import parse_scenario
from conftest import shared_trace
from test_engine import assert_same_requests

PRESETS = ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm", "vllm-v1",
           {"preset": "vllm", "name": "vllm-swap", "preemption": "swap", "swap_space_gib": 1}]

CASES = {
    # trace, model, GPU, workload keys: slices keep the test short; rate_scale makes them busy enough that
    # vllm, vllm-v1 and vllm-swap preempt (asserted below where PREEMPTING says so)
    "azure_conv": ("azure_2023/AzureLLMInferenceTrace_conv.csv", "llama-2-7b", "a100-40gb",
                   {"num_requests": 700, "rate_scale": 4}),
    "mooncake_conversation": ("mooncake/conversation_trace.jsonl", "mistral-7b", "h100",
                              {"num_requests": 300, "cap_lengths": "truncate"}),
    "sharegpt_lengths": ("lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv", "llama-3-8b", "l4",
                         {"num_requests": 300, "arrival": {"kind": "poisson", "rate": 5.0}}),
}
PREEMPTING = {"azure_conv", "sharegpt_lengths"}  # cases whose slice must exercise recompute and swap preemption


@pytest.mark.parametrize("case", list(CASES))
def test_spans_match_stepping_on_shared_traces(case):
    rel, model, gpu, extra = CASES[case]
    path = shared_trace(rel)
    s = parse_scenario({"name": case, "model": model, "gpu": gpu, "policies": PRESETS,
                        "workload": {"kind": "trace", "path": str(path), **extra}})
    exact, fast = run(s.model_copy(update={"exact": True})), run(s)
    for name in exact.policies:
        e, f = exact.policies[name], fast.policies[name]
        assert_same_requests(e.requests, f.requests)
        assert e.summary["num_preemptions"] == f.summary["num_preemptions"]
        assert e.summary["num_steps"] == f.summary["num_steps"]
        assert e.summary["num_finished"] > 0
    if case in PREEMPTING:
        assert all(exact.policies[n].summary["num_preemptions"] > 0 for n in ("vllm", "vllm-v1", "vllm-swap"))
