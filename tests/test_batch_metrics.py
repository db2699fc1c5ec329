"""The three batch measures, on runs small enough to count by hand (sim/metrics.py's docstring)."""

import numpy as np
import pytest

from sim.schema import METRICS
from sim.run import run
from sim.sweep.spec import summary_metric_names
from sim.workload import RequestTable

# Two requests at t = 0: A (prompt 4, output 2) and B (prompt 4, output 4). Under vLLM's scheduler:
#   step 1  prefill A and B        2 sequences, no decode   A, B hold KV; each samples its first token
#   step 2  decode A and B         2 decoding               A samples its last token and finishes
#   step 3  decode B               1 decoding
#   step 4  decode B               1 decoding               B finishes
TWO = RequestTable(np.array([0.0, 0.0]), np.array([4, 4]), np.array([2, 4]))


def two_requests(make_scenario, policy, requests=TWO, **over):
    s = make_scenario(policies=[policy], exact=True, **over)
    r = run(s, requests=requests).policies[s.policies[0].name]
    return r.summary, r.steps[r.steps.num_steps > 0]


def test_batch_measures_by_hand_vllm(make_scenario):
    m, steps = two_requests(make_scenario, "vllm")
    assert list(steps.num_seqs) == [2, 2, 1, 1] and list(steps.num_decode_tokens) == [0, 2, 1, 1]
    assert m["mean_batch_size"] == 6 / 4
    assert m["mean_decode_batch_size"] == 4 / 3  # the prefill-only step does not count
    d = steps.duration_s.to_numpy()
    assert m["duration_s"] == pytest.approx(d.sum(), rel=1e-12)
    assert m["mean_running_requests"] == pytest.approx((2 * d[0] + 2 * d[1] + d[2] + d[3]) / d.sum(), rel=1e-12)


def test_static_batch_holds_finished_requests(make_scenario):
    """FasterTransformer: A's slab stays reserved until B, its batch-mate, finishes."""
    m, steps = two_requests(make_scenario, "fastertransformer")
    assert list(steps.num_seqs) == [2, 2, 1, 1]
    assert m["mean_decode_batch_size"] == 4 / 3
    assert m["mean_running_requests"] == pytest.approx(2.0, rel=1e-12)  # both hold KV for the whole run


def test_idle_time_counts_as_zero_running(make_scenario):
    """A request alone, then nothing until a second one: the idle gap holds no request."""
    reqs = RequestTable(np.array([0.0, 100.0]), np.array([4, 4]), np.array([3, 3]))
    m, steps = two_requests(make_scenario, "vllm", requests=reqs)
    busy = steps.duration_s.sum()
    assert m["mean_running_requests"] == pytest.approx(busy / m["duration_s"], rel=1e-12)  # one at a time
    assert m["mean_decode_batch_size"] == 1.0 and m["mean_running_requests"] < 0.05


def test_samples_count_once_per_request(make_scenario):
    """Parallel sampling with n = 3: three sequences decode, one request holds KV."""
    reqs = RequestTable(np.array([0.0]), np.array([4]), np.array([3]))
    m, steps = two_requests(make_scenario, "vllm", requests=reqs, sampling={"kind": "parallel", "n": 3})
    assert list(steps.num_decode_tokens) == [0, 3, 3]
    assert m["mean_decode_batch_size"] == 3.0
    assert m["mean_running_requests"] == pytest.approx(1.0, rel=1e-12)


def test_spans_give_the_exact_batch_measures(make_scenario):
    s = make_scenario(policies=["fastertransformer", "orca-pow2", "vllm"],
                      workload={"arrival": {"kind": "poisson", "rate": 6.0}, "lengths": "sharegpt",
                                "num_requests": 60, "seed": 2}, decompose=False)
    exact, fast = run(s.model_copy(update={"exact": True})), run(s)
    for name in exact.policies:
        e, f = exact.policies[name], fast.policies[name]
        for k in ("mean_decode_batch_size", "mean_running_requests"):
            assert e.summary[k] == pytest.approx(f.summary[k], rel=1e-9), (name, k)
        # the timeline's bins integrate the same request-seconds
        assert f.timeline.running_request_s.sum() == pytest.approx(f.summary["mean_running_requests"]
                                                                   * f.summary["duration_s"], rel=1e-9)
        assert e.timeline.running_request_s.sum() == pytest.approx(f.timeline.running_request_s.sum(), rel=1e-9)


def test_new_metrics_are_declared_and_can_bound_an_slo():
    names = summary_metric_names()
    for k in ("mean_batch_size", "mean_decode_batch_size", "mean_running_requests"):
        assert k in names and METRICS[k].unit in ("sequences", "requests")
    assert set(names) <= set(METRICS)  # every summary metric is declared once
