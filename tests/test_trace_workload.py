"""Workload transforms (window, sample, re-time, rate scale, head, length cap), their invariants as
properties, and scenarios that replay a trace through ``sim check`` and ``sim run``."""

import json
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cli import app
from conftest import ROOT, shared_trace
from sim.config import ScenarioError, TraceWorkload
from sim.workload import PrefixHashes, RequestTable
from traces.commands import workload_from_options
from traces.read import write_table
from traces.workload import load_trace, transform

runner = CliRunner()
AZURE = "azure_2023/AzureLLMInferenceTrace_conv.csv"


def azure(*settings, **kw):
    p = shared_trace(AZURE)
    return load_trace(workload_from_options(p, list(settings)), p, **kw)


def test_window_keeps_its_arrivals_from_zero_and_counts_the_rest():
    full, w = azure(), azure("window={start_s: 600, end_s: 1200}")
    inside = (full.arrival_s >= 600) & (full.arrival_s < 1200)
    assert len(w) == inside.sum() and np.allclose(w.arrival_s, full.arrival_s[inside] - 600)
    assert np.array_equal(w.prompt_tokens, full.prompt_tokens[inside])
    assert w.dropped == {"outside_window": len(full) - len(w)} and w.num_rows_read == len(full)
    with pytest.raises(ScenarioError, match="no requests left after the workload's transforms"):
        azure("window.start_s=99999")


def test_rate_scale_multiplies_the_rate_and_keeps_the_requests():
    full, fast = azure(), azure("rate_scale=4")
    assert np.allclose(fast.arrival_s * 4, full.arrival_s) and np.array_equal(fast.output_tokens, full.output_tokens)


def test_retime_to_a_poisson_rate_keeps_the_trace_lengths_in_order():
    full, r = azure(), azure("arrival={kind: poisson, rate: 20}", "seed=3")
    gaps = np.diff(r.arrival_s)
    assert 1 / gaps.mean() == pytest.approx(20, rel=0.03) and gaps.std() / gaps.mean() == pytest.approx(1, rel=0.05)
    assert np.array_equal(r.prompt_tokens, full.prompt_tokens)
    g = azure("arrival={kind: gamma, rate: 20, cv: 3}", "seed=3")
    gg = np.diff(g.arrival_s)
    assert gg.std() / gg.mean() == pytest.approx(3, rel=0.1)
    assert np.array_equal(azure("arrival={kind: poisson, rate: 20}", "seed=3").arrival_s, r.arrival_s)


def test_sample_and_head_are_seeded_and_counted():
    a, b, c = azure("sample=0.25", "seed=1"), azure("sample=0.25", "seed=1"), azure("sample=0.25", "seed=2")
    assert len(a) == round(0.25 * 19_366) and a.dropped == {"not_sampled": 19_366 - len(a)}
    assert np.array_equal(a.arrival_s, b.arrival_s) and not np.array_equal(a.arrival_s, c.arrival_s)
    h = azure("duration_s=600", "num_requests=1000")
    assert len(h) == 1000 and h.dropped == {"beyond_duration_s": 19_366 - (azure().arrival_s < 600).sum(),
                                            "beyond_num_requests": (azure().arrival_s < 600).sum() - 1000}


def test_cap_lengths_truncates_and_counts():
    full = azure()
    t = azure("cap_lengths=truncate", max_model_len=2048)
    assert (t.prompt_tokens + t.output_tokens).max() == 2048 and t.prompt_tokens.max() == 2047
    assert t.truncated == {"prompt_tokens": int((full.prompt_tokens > 2047).sum()),
                           "output_tokens": int((np.minimum(full.prompt_tokens, 2047) + full.output_tokens > 2048).sum())}
    assert np.array_equal(azure("cap_lengths=reject", max_model_len=2048).prompt_tokens, full.prompt_tokens)
    with pytest.raises(ScenarioError, match="needs the model's max length"):
        azure("cap_lengths=truncate")
    r = runner.invoke(app, ["trace", "info", str(shared_trace(AZURE)), "-w", "cap_lengths=truncate",
                            "--max-model-len", "2048"])
    assert r.exit_code == 0 and f"truncated       prompt_tokens {t.truncated['prompt_tokens']:,}" in r.output


def test_truncation_cuts_prefix_hashes_to_the_kept_blocks():
    p = shared_trace("mooncake/conversation_trace.jsonl")
    t = load_trace(workload_from_options(p, ["cap_lengths=truncate"]), p, 8192)
    assert np.array_equal(np.diff(t.prefix_hashes.offsets), -(-t.prompt_tokens // 512))
    assert t.prefix_hashes.of(0)[0] == 0


# ---------------------------------------------------------------------------------------------- properties


@st.composite
def tables(draw):
    n = draw(st.integers(1, 40))
    gaps = draw(st.lists(st.floats(0, 50, allow_nan=False), min_size=n, max_size=n))
    prompt = draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n))
    output = draw(st.lists(st.integers(1, 3000), min_size=n, max_size=n))
    lens = [draw(st.integers(0, min(4, -(-p // 16)))) for p in prompt]  # at most one id per 16-token block
    ids = draw(st.lists(st.integers(0, 20), min_size=sum(lens), max_size=sum(lens)))
    hashes = PrefixHashes(np.array(ids, dtype=np.int64), np.concatenate(([0], np.cumsum(lens))), 16)
    return RequestTable(np.cumsum(gaps), prompt, output, dropped={"blank_line": draw(st.integers(0, 3))},
                        prefix_hashes=hashes, session_id=np.array([f"s{i % 3}" for i in range(n)]))


@st.composite
def transforms(draw):
    w: dict = {"kind": "trace", "path": "x", "seed": draw(st.integers(0, 5))}
    if draw(st.booleans()):
        start = draw(st.floats(0, 500))
        w["window"] = {"start_s": start, "end_s": draw(st.none() | st.floats(start + 1, 2000))}
    if draw(st.booleans()):
        w["sample"] = draw(st.floats(0.01, 1))
    choice = draw(st.sampled_from(["none", "scale", "poisson", "gamma"]))
    if choice == "scale":
        w["rate_scale"] = draw(st.floats(0.1, 10))
    elif choice != "none":
        w["arrival"] = {"kind": choice, "rate": draw(st.floats(0.1, 100)), **({"cv": 2.0} if choice == "gamma" else {})}
    w["num_requests"] = draw(st.none() | st.integers(1, 50))
    w["duration_s"] = draw(st.none() | st.floats(1, 1000))
    w["cap_lengths"] = draw(st.sampled_from(["reject", "truncate"]))
    return TraceWorkload.model_validate(w)


@settings(max_examples=150, deadline=None)
@given(tables(), transforms(), st.integers(2, 4096))
def test_transforms_keep_rows_in_equal_to_requests_plus_dropped(t, w, max_model_len):
    out = transform(t, w, max_model_len)
    assert out.num_rows_read == t.num_rows_read  # nothing disappears uncounted
    assert np.all(np.diff(out.arrival_s) >= 0) and (len(out) == 0 or out.arrival_s[0] >= 0)
    assert len(out.prefix_hashes) == len(out.session_id) == len(out)
    assert out.prompt_tokens.min(initial=1) >= 1 and out.output_tokens.min(initial=1) >= 1
    if w.cap_lengths == "truncate":
        assert (out.prompt_tokens + out.output_tokens).max(initial=0) <= max_model_len
        assert np.all(np.diff(out.prefix_hashes.offsets) <= -(-out.prompt_tokens // 16))


@settings(max_examples=100, deadline=None)
@given(tables(), st.data())
def test_take_and_cut_match_plain_lists(t, data):
    index = np.array(sorted(data.draw(st.sets(st.integers(0, len(t) - 1)))), dtype=np.int64)
    h = t.prefix_hashes
    lists = [list(h.of(i)) for i in range(len(h))]
    taken = h.take(index)
    assert [list(taken.of(j)) for j in range(len(index))] == [lists[i] for i in index]
    cut = h.cut(t.prompt_tokens // 2 + 1)
    assert [list(cut.of(i)) for i in range(len(h))] == [lst[:-(-(p // 2 + 1) // 16)] for lst, p in zip(lists, t.prompt_tokens)]


@settings(max_examples=30, deadline=None)
@given(tables())
def test_canonical_parquet_round_trip(t):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.parquet"
        write_table(t, p)
        back = load_trace(TraceWorkload(kind="trace", path=str(p)), p)
    for col in ("arrival_s", "prompt_tokens", "output_tokens", "session_id"):
        assert np.array_equal(getattr(back, col), getattr(t, col)), col
    assert np.array_equal(back.prefix_hashes.ids, t.prefix_hashes.ids)
    assert np.array_equal(back.prefix_hashes.offsets, t.prefix_hashes.offsets)


# ---------------------------------------------------------------------------------------------- scenarios


def test_shipped_azure_scenario_checks():
    shared_trace(AZURE)
    r = runner.invoke(app, ["check", str(ROOT / "scenarios" / "azure_conv.yaml")])
    assert r.exit_code == 0, r.output
    assert "19,366 requests" in r.output and "(azure)" in r.output and "truncated: prompt_tokens" in r.output


def test_trace_scenario_runs_every_preset_and_reports_drops(tmp_path):
    trace = shared_trace(AZURE)
    s = tmp_path / "s.yaml"
    s.write_text(textwrap.dedent(f"""\
        name: azure-window
        model: llama-2-7b
        gpu: a100-80gb
        workload: {{kind: trace, path: {trace}, window: {{start_s: 600}}, num_requests: 150, cap_lengths: truncate}}
        policies: [fastertransformer, orca-max, orca-pow2, orca-oracle, vllm, vllm-v1]
        """))
    r = runner.invoke(app, ["run", str(s), "--out", str(tmp_path / "out"), "--no-report"])
    assert r.exit_code == 0, r.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    w = summary["scenario"]["resolved"]["workload"]
    assert w["num_requests"] == 150 and w["num_rows_read"] == 19_366
    assert w["num_requests"] + sum(w["dropped_rows"].values()) == w["num_rows_read"]
    assert set(w["dropped_rows"]) == {"outside_window", "beyond_num_requests"} and "prompt_tokens" in w["truncated_requests"]
    for name, m in summary["policies"].items():
        assert m["num_finished"] + m["num_rejected"] + m["num_unfinished"] == 150, name


def test_scenario_with_an_absent_trace_fails_clearly(tmp_path):
    s = tmp_path / "s.yaml"
    s.write_text("name: t\nmodel: opt-13b\ngpu: a100-40gb\n"
                 "workload: {kind: trace, path: ../nowhere/trace.csv}\npolicies: [vllm]\n")
    for cmd in ("check", "run"):
        r = runner.invoke(app, [cmd, str(s)])
        assert r.exit_code == 2 and "Traceback" not in r.output
        assert "workload.path:" in r.output and "nowhere/trace.csv: no such trace file" in r.output.replace("\n", "")


@pytest.mark.parametrize("path", ["/dev/null", "."])
def test_scenario_with_a_trace_path_that_is_not_a_file_says_so(tmp_path, path):
    """It said "no such trace file" of /dev/null, which exists."""
    s = tmp_path / "s.yaml"
    s.write_text(f"name: t\nmodel: opt-13b\ngpu: a100-40gb\nworkload: {{kind: trace, path: {path}}}\npolicies: [vllm]\n")
    r = runner.invoke(app, ["check", str(s)])
    assert r.exit_code == 2 and "workload.path: " in r.output and ": not a regular file (a folder or a device); " \
        "expected a trace file" in " ".join(r.output.split()), r.output


def test_trace_workload_keys_are_validated_with_their_line(tmp_path):
    s = tmp_path / "s.yaml"
    s.write_text("name: t\nmodel: opt-13b\ngpu: a100-40gb\nworkload:\n  kind: trace\n  path: t.csv\n"
                 "  window: {start_s: 10, end_s: 5}\n  sampel: 0.5\npolicies: [vllm]\n")
    r = runner.invoke(app, ["check", str(s)])
    assert r.exit_code == 2
    assert "s.yaml:7: workload.window: end_s (5.0) must be after start_s (10.0)" in r.output.replace("\n", "")
    assert "s.yaml:8: workload.sampel: unknown key" in r.output.replace("\n", "")
