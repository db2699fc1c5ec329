import numpy as np
import pytest

from sim.config import LENGTH_PRESETS, ScenarioError, SyntheticWorkload
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
        return load_requests(make_scenario(workload={"kind": "table", "path": str(p), **kw}))

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
        load_requests(make_scenario(workload={"kind": "table", "path": str(tmp_path / "missing.csv")}))
