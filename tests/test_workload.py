import re

import numpy as np
import pytest

from sim.config import LENGTH_PRESETS, ScenarioError, SyntheticWorkload
from kvsim import read_trace
from sim.workload import generate, load_requests, lognormal_mu


def wl(**kw):
    base = {"arrival": {"kind": "poisson", "rate": 2.0}, "lengths": "sharegpt", "num_requests": 500, "seed": 3}
    base.update(kw)
    return SyntheticWorkload.model_validate(base)


def test_same_seed_same_requests_other_seed_other_requests():
    a, b, c = generate(wl()), generate(wl()), generate(wl(seed=4))
    for col in ("arrival_s", "prompt_tokens", "output_tokens"):
        assert np.array_equal(getattr(a, col), getattr(b, col))
    assert not np.array_equal(a.prompt_tokens, c.prompt_tokens)


@pytest.mark.parametrize("preset,prompt,output", [("sharegpt", 161.31, 337.99), ("alpaca", 19.31, 58.45)])
def test_presets_match_published_means(preset, prompt, output):
    r = generate(wl(lengths=preset, num_requests=200_000))
    assert r.prompt_tokens.mean() == pytest.approx(prompt, rel=0.02)
    assert r.output_tokens.mean() == pytest.approx(output, rel=0.02)
    assert r.prompt_tokens.min() >= 1 and r.output_tokens.max() <= LENGTH_PRESETS[preset]["output"]["max"]


def test_clipped_lognormal_keeps_its_mean():
    mu, sigma = lognormal_mu(300.0, 1.2, 1000)
    x = np.minimum(np.random.default_rng(0).lognormal(mu, sigma, 400_000), 1000)
    assert x.mean() == pytest.approx(300.0, rel=0.01)


def test_poisson_and_gamma_rates_and_burstiness():
    p = generate(wl(num_requests=50_000))
    gaps = np.diff(p.arrival_s)
    assert p.arrival_s[0] == 0.0
    assert 1 / gaps.mean() == pytest.approx(2.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    g = generate(wl(arrival={"kind": "gamma", "rate": 2.0, "cv": 3.0}, num_requests=50_000))
    gg = np.diff(g.arrival_s)
    assert 1 / gg.mean() == pytest.approx(2.0, rel=0.05)
    assert gg.std() / gg.mean() == pytest.approx(3.0, rel=0.1)


def test_stop_by_duration_and_by_count():
    d = generate(wl(num_requests=None, duration_s=100.0))
    assert d.arrival_s.max() < 100.0 and len(d) == pytest.approx(200, rel=0.25)
    both = generate(wl(num_requests=10_000, duration_s=10.0))
    assert both.arrival_s.max() < 10.0 and len(both) < 100


def test_fixed_and_uniform_lengths():
    r = generate(wl(lengths=None, prompt={"kind": "fixed", "tokens": 7}, output={"kind": "uniform", "low": 2, "high": 4}))
    assert set(r.prompt_tokens) == {7} and set(r.output_tokens) == {2, 3, 4}


def test_table_replay_and_its_errors(tmp_path, make_scenario):
    """``kind: table`` (the older name of ``kind: trace``) replays a canonical table as written."""
    p = tmp_path / "t.csv"

    def load(text, **kw):
        p.write_text(text)
        return load_requests(make_scenario(workload={"kind": "table", "path": str(p), **kw}), read_trace)

    r = load("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1.5,20,1\n2,5,0\n")
    assert list(r.prompt_tokens) == [10, 20] and r.arrival_s[1] == 1.5 and r.dropped == {"zero_output_tokens": 1}
    assert len(load("arrival_s,prompt_tokens,output_tokens\n3,10,5\n4,20,1\n", num_requests=1)) == 1
    for text, msg in [("a,b\n1,2\n", "cannot tell the trace format"),
                      ("arrival_s,prompt_tokens,output_tokens\n", "no requests"),
                      ("arrival_s,prompt_tokens,output_tokens\n0,x,1\n", "t.csv:2: prompt_tokens = 'x'"),
                      ("arrival_s,prompt_tokens,output_tokens\n5,1,1\n2,1,1\n", "t.csv:3: arrival_s = 2 is 3 s before")]:
        with pytest.raises(ScenarioError, match=msg):
            load(text)
    with pytest.raises(ScenarioError, match="no such trace file"):
        load_requests(make_scenario(workload={"kind": "table", "path": str(tmp_path / "missing.csv")}), read_trace)


@pytest.mark.parametrize("kw", [{}, {"duration_s": 150.0}, {"lengths": None, "prompt": {"kind": "uniform", "low": 1, "high": 90},
                                                          "output": {"kind": "fixed", "tokens": 5}}])
def test_horizon_keeps_the_same_requests_and_counts_the_rest(kw, monkeypatch):
    """Requests arriving at or after the horizon are not generated, only counted; the ones kept are
    bit-identical to the same workload without a horizon (the random stream is drawn on, in chunks)."""
    import sim.workload as W

    monkeypatch.setattr(W, "_CHUNK", 37)  # many chunks: chunk borders must not change a single bit
    full = generate(wl(**kw))
    cut = generate(wl(**kw), horizon_s=60.0)
    k = int(np.searchsorted(full.arrival_s, 60.0, side="left"))
    assert 0 < k < len(full) and len(cut) == k and cut.beyond_horizon == len(full) - k
    for col in ("arrival_s", "prompt_tokens", "output_tokens"):
        assert np.array_equal(getattr(cut, col), getattr(full, col)[:k]), col


def test_memory_follows_the_horizon_not_the_request_count(make_scenario):
    """10^6 requests and a 1 s horizon: a couple of requests are materialised, the rest counted as
    unfinished, and the accounting identity holds over all of them."""
    from sim import run

    s = make_scenario(horizon_s=1.0, policies=["vllm"],
                      workload={"arrival": {"kind": "poisson", "rate": 2.0}, "lengths": "sharegpt",
                                "num_requests": 10**6, "seed": 0})
    r = run(s)
    assert len(r.requests) < 20 and r.requests.beyond_horizon == 10**6 - len(r.requests)
    m = r.policies["vllm"].summary
    assert m["num_requests"] == 10**6 == m["num_finished"] + m["num_rejected"] + m["num_unfinished"]
    assert len(r.policies["vllm"].requests) == len(r.requests)


def test_a_duration_beyond_what_a_run_can_hold_is_refused():
    with pytest.raises(ScenarioError, match="workload.duration_s: 1e.09 s .* more than"):
        generate(wl(num_requests=None, duration_s=1e9))
    assert len(generate(wl(num_requests=None, duration_s=1e9), horizon_s=10.0)) < 60  # bounded by the horizon


@pytest.mark.parametrize("kw, key", [({"num_requests": None, "duration_s": 1.0}, "workload.duration_s: 1 s at 1e+07"),
                                     ({"num_requests": 10**7}, "workload.num_requests: 10,000,000 requests"),
                                     ({"duration_s": 1.0, "num_requests": 10**8}, "workload.duration_s: 1 s")])
def test_a_workload_that_needs_more_memory_than_the_machine_has_is_refused(kw, key, monkeypatch):
    """Under the 1e8 cap: a run of 1e7 requests took 5.4 GB, 1e8 exhausted the machine's memory."""
    import sim.workload as W

    monkeypatch.setattr(W, "physical_memory", lambda: 4e9)
    with pytest.raises(ScenarioError, match=re.escape(key) + ".*, which need about 6.4 GB to simulate " + re.escape(
            "(at least 640 bytes a request), more than this machine's 4.0 GB of memory")):
        generate(wl(**{"arrival": {"kind": "poisson", "rate": 1e7}, **kw}))
    if kw["num_requests"] is None:  # a horizon bounds what is held (a count's gaps are drawn on: seconds)
        assert len(generate(wl(**{"arrival": {"kind": "poisson", "rate": 1e7}, **kw}), horizon_s=1e-4)) < 2000


def test_shared_prefixes_name_content_only_up_to_the_models_length():
    """A system prompt of 2^31 tokens (a valid token count) named in 16-token segments took 11 GB, even in
    `sim check`; such a request is rejected (longer than the model), so only the model's length is named."""
    w = wl(num_requests=3, shared_prefixes={"lengths": [2**31 - 1, 64], "popularity": [1, 1]})
    r = generate(w, max_model_len=4096)
    assert len(r.prefix_hashes.ids) <= 3 * 4096 // 16
    whole = generate(wl(num_requests=3, shared_prefixes={"lengths": [64], "hash_block": 16}), max_model_len=4096)
    assert whole.prefix_hashes.ids.tolist() == generate(wl(num_requests=3, shared_prefixes={"lengths": [64]})).prefix_hashes.ids.tolist()
