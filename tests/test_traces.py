"""Trace readers on the shared samples (figures from ../shared/traces/README.md), round trips through
``sim trace convert``, formats without a shared sample, and the documented errors on malformed files."""

import gzip
import json
import re
from pathlib import Path
from typing import get_args

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from conftest import shared_trace
from sim.config import ScenarioError, TraceWorkload
from traces.commands import trace_stats, workload_from_options
from traces.formats import FORMATS, open_trace
from traces.read import read_trace
from traces.workload import load_trace

runner = CliRunner()
AZURE = "azure_2023/AzureLLMInferenceTrace_conv.csv"

# ../shared/traces/README.md, "Figures": rows, span s, mean req/s, prompt and output (mean, p50, p99, max);
# None where the README gives no figure. The README rounds: a figure without decimals is compared to 0.5.
README_FIGURES = {
    AZURE: ("azure", 19_366, 3501.7, 5.53, (1154.7, 1020, 4142, 14050), (211.1, 129, 601, 1000)),
    "vidur/splitwise_conv.csv": ("vidur", 19_366, 3501.7, 5.53, (1154.7, 1020, 4142, 14050), (211.1, 129, 601, 1000)),
    "mooncake/conversation_trace.jsonl": ("mooncake", 12_031, 3537.0, 3.40, (12035, 6909, 85400, 126195),
                                          (342.6, 350, 1118.5, 2000)),
    "mooncake/synthetic_trace.jsonl": ("mooncake", 3_993, 1022.0, 3.91, (15325, 11587, 66456, 191378),
                                       (149.1, 69, 768, 893)),
    "lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv": ("lengths", 30_731, None, None,
                                                                (2340.0, 1730, 7434, None), (438.7, 415, 998, None)),
    "lengths/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv": ("lengths", 28_257, None, None,
                                                                           (2588.1, 2730, 3933, None),
                                                                           (291.4, 167, 3271, None)),
    "lengths/bwb_stats_llama2_tokenizer_filtered_v2.csv": ("lengths", 33_768, None, None, (1067.2, 1037, 1800, None),
                                                           (1612.8, 1601, 2533, None)),
}
STAT_KEYS = ("mean", "p50", "p99", "max")


def _tol(readme_value: float) -> float:
    return 0.05 if readme_value != int(readme_value) or isinstance(readme_value, float) else 0.5


def load(path, *settings, **kw):
    return load_trace(workload_from_options(Path(path), list(settings)), Path(path), **kw)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


# ---------------------------------------------------------------------------------------------- samples


@pytest.mark.parametrize("rel", list(README_FIGURES))
def test_shared_sample_matches_readme_figures(rel):
    fmt, rows, span, rate, prompt, output = README_FIGURES[rel]
    t = load(shared_trace(rel), allow_untimed=True)
    s = trace_stats(t, timed=fmt != "lengths")
    assert t.source.endswith(f"({fmt})") and len(t) == rows and t.num_rows_read == rows and not t.dropped
    if span is not None:
        assert s["span_s"] == pytest.approx(span, abs=0.05)
        assert s["mean_rate_per_min"] / 60 == pytest.approx(rate, abs=0.005)
    for key, want in (("prompt_tokens", prompt), ("output_tokens", output)):
        for stat, v in zip(STAT_KEYS, want):
            if v is not None:
                assert s[key][stat] == pytest.approx(v, abs=_tol(v)), (key, stat)


@pytest.mark.parametrize("rel", list(README_FIGURES))
def test_sim_trace_info_prints_the_readme_figures(rel):
    fmt, rows, span, rate, prompt, output = README_FIGURES[rel]
    r = runner.invoke(app, ["trace", "info", str(shared_trace(rel))])
    assert r.exit_code == 0, r.output
    assert f"format {fmt}, {rows:,} requests from {rows:,} rows" in r.output
    if span is not None:
        assert f"span            {span:,.1f} s" in r.output and f"({rate:.2f} /s)" in r.output
    printed = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in r.output.splitlines()
               if line.startswith(("prompt ", "output "))}
    for key, want in (("prompt", prompt), ("output", output)):
        mean, p50, _p90, p99, mx = printed[key]
        for got, v in zip((mean, p50, p99, mx), want):
            if v is not None:
                assert got == pytest.approx(v, abs=_tol(v)), (key, got, v)


def test_sim_trace_commands_find_traces_by_name_as_scenarios_do(tmp_path, monkeypatch):
    """``traces:REL`` on the command line is looked for in the traces folders, as a scenario's path is."""
    rel = "azure_2023/AzureLLMInferenceTrace_conv.csv"
    monkeypatch.setenv("KVSIM_TRACES", str(shared_trace(rel))[:-len(rel)])
    r = runner.invoke(app, ["trace", "info", "traces:" + rel, "-w", "window.end_s=600"])
    assert r.exit_code == 0 and "format azure" in r.output, r.output
    r = runner.invoke(app, ["trace", "convert", "traces:" + rel, str(tmp_path / "a.parquet"), "-w", "num_requests=10"])
    assert r.exit_code == 0 and (tmp_path / "a.parquet").is_file(), r.output
    r = runner.invoke(app, ["trace", "info", "traces:azure_2023/nope.csv"])
    assert r.exit_code == 2 and "nope.csv: no such trace file" in r.output, r.output
    r = runner.invoke(app, ["trace", "info", "traces:../../etc/passwd"])  # as in a scenario: inside the folders only
    assert r.exit_code == 2 and "leads out of them" in r.output, r.output


def test_mooncake_prefix_blocks_match_the_readme():
    t = load(shared_trace("mooncake/conversation_trace.jsonl"))
    h = t.prefix_hashes
    assert h.block_size == 512 and len(h.ids) == 288_500 and len(np.unique(h.ids)) == 182_790
    assert h.seen_fraction() == pytest.approx(1 - 182_790 / 288_500)
    assert np.array_equal(np.diff(h.offsets), -(-t.prompt_tokens // 512))  # one id per 512-token block
    r = runner.invoke(app, ["trace", "info", str(shared_trace("mooncake/conversation_trace.jsonl"))])
    assert "288,500 of 512 tokens, 36.6 % seen earlier in the trace" in r.output


def test_sim_trace_info_keeps_wide_figures_apart(tmp_path):
    """Figures of 1e9 tokens or more ran together ('1073741873.51073741873.5...')."""
    p = write(tmp_path, "wide.csv", "arrival_s,prompt_tokens,output_tokens\n0,1073741873,1\n1,2147483647,1\n2,5,3\n")
    r = runner.invoke(app, ["trace", "info", str(p)])
    rows = {line.split()[0]: line for line in r.output.splitlines() if line.startswith(("tokens", "prompt", "output"))}
    assert rows["prompt"].split()[1:] == ["1073741841.7", "1073741873", "1932735292.2", "2126008811.5", "2147483647"]
    assert len({len(line) for line in rows.values()}) == 1  # the header's columns over the figures


def test_azure_and_vidur_files_hold_the_same_requests():
    a, v = load(shared_trace(AZURE)), load(shared_trace("vidur/splitwise_conv.csv"))
    assert np.allclose(a.arrival_s, v.arrival_s, atol=1e-6)
    assert np.array_equal(a.prompt_tokens, v.prompt_tokens) and np.array_equal(a.output_tokens, v.output_tokens)
    assert a.arrival_s[0] == 0.0 and a.arrival_s[1] == pytest.approx(4.314579)  # 7-digit timestamps, from the start


CONVERT_SETTINGS = {"lengths/bwb_stats_llama2_tokenizer_filtered_v2.csv": ["arrival={kind: poisson, rate: 4}"]}


@pytest.mark.parametrize("rel", [AZURE, "vidur/splitwise_conv.csv", "mooncake/conversation_trace.jsonl",
                                 "lengths/bwb_stats_llama2_tokenizer_filtered_v2.csv"])
def test_each_format_round_trips_through_convert(rel, tmp_path):
    src = shared_trace(rel)
    settings = CONVERT_SETTINGS.get(rel, [])
    out = tmp_path / "t.parquet"
    r = runner.invoke(app, ["trace", "convert", str(src), str(out), *sum((["-w", s] for s in settings), [])])
    assert r.exit_code == 0, r.output
    a, b = load(src, *settings), load(out)
    assert b.source.endswith("(canonical)")
    for col in ("arrival_s", "prompt_tokens", "output_tokens"):
        assert np.array_equal(getattr(a, col), getattr(b, col)), col
    assert (a.prefix_hashes is None) == (b.prefix_hashes is None)
    if a.prefix_hashes is not None:
        assert b.prefix_hashes.block_size == 512
        assert np.array_equal(a.prefix_hashes.ids, b.prefix_hashes.ids)
        assert np.array_equal(a.prefix_hashes.offsets, b.prefix_hashes.offsets)


@pytest.mark.parametrize("rel", [AZURE, "mooncake/synthetic_trace.jsonl"])
def test_gzip_reads_the_same_as_plain(rel, tmp_path):
    src = shared_trace(rel)
    gz = tmp_path / (src.name + ".gz")
    gz.write_bytes(gzip.compress(src.read_bytes()))
    a, b = load(src), load(gz)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)


def test_small_chunks_read_the_same_as_one(tmp_path):
    from traces.formats import open_trace
    from traces.read import read_trace

    tf = open_trace(shared_trace(AZURE))
    a, b = read_trace(tf), read_trace(tf, chunk_rows=1000)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.output_tokens, b.output_tokens)


# ---------------------------------------------------------------------------------------------- formats


def test_config_and_readers_name_the_same_formats():
    assert set(get_args(TraceWorkload.model_fields["format"].annotation)) == {"auto", *FORMATS}


BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
5,GPT-4,1087,0,1087,Conversation log
7,ChatGPT,120,30,150,API log
9,GPT-4,300,200,500,API log
12,ChatGPT,88,0,88,Conversation log
"""


def test_burstgpt_drops_failed_rows_and_filters_by_model_and_log_type(tmp_path):
    p = write(tmp_path, "burst.csv", BURSTGPT)
    t = load(p)
    assert t.source.endswith("(burstgpt)") and list(t.arrival_s) == [0, 2, 4] and list(t.output_tokens) == [18, 30, 200]
    assert t.dropped == {"failed_request": 2} and t.num_rows_read == 5
    f = load(p, "models=[ChatGPT]", "log_types=[Conversation log]")
    assert list(f.prompt_tokens) == [472] and f.num_rows_read == 5
    assert f.dropped == {"not_in_models": 2, "not_in_log_types": 1, "failed_request": 1}
    # a failed request with no prompt either is a failed request (it read as zero_prompt_tokens)
    z = load(write(tmp_path, "z.csv", BURSTGPT.replace("12,ChatGPT,88,0,88", "12,ChatGPT,0,0,0")))
    assert z.dropped == {"failed_request": 2}
    with pytest.raises(ScenarioError, match="'models' selects rows of burstgpt traces; this is format azure"):
        load(write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.0000000,1,1\n"),
             "models=[x]")


def test_azure_2024_timestamps_across_midnight(tmp_path):
    p = write(tmp_path, "AzureLLMInferenceTrace_code_1week.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2024-05-10 23:59:59.9999999,2048,28\n2024-05-11 00:00:00.0000001,17,3\n2024-05-12 00:00:00.5000000,5,1\n")
    t = load(p)
    assert t.arrival_s[0] == 0 and t.arrival_s[1] == pytest.approx(2e-7, abs=2e-6)
    assert t.arrival_s[2] == pytest.approx(86400.5, abs=1e-5)


def test_generic_tables_by_column_mapping(tmp_path):
    csv = write(tmp_path, "g.csv", "t_ms,in,out,conv\n1000,10,2,a\n1500,20,3,b\n4000,30,4,a\n")
    cols = "columns={arrival: t_ms, arrival_unit: ms, prompt_tokens: in, output_tokens: out, session_id: conv}"
    t = load(csv, cols)
    assert list(t.arrival_s) == [0, 0.5, 3.0] and list(t.session_id) == ["a", "b", "a"]
    jl = tmp_path / "g.jsonl"
    jl.write_text("".join(json.dumps({"at": f"2024-01-01T00:00:0{i}Z", "p": 20, "o": 1, "blocks": [7, 8 + i]}) + "\n"
                          for i in range(3)))
    t = load(jl, "columns={arrival: at, arrival_unit: datetime, prompt_tokens: p, output_tokens: o, "
                 "hash_ids: blocks, hash_block_size: 16}")
    assert list(t.arrival_s) == [0, 1, 2] and t.prefix_hashes.block_size == 16 and list(t.prefix_hashes.of(2)) == [7, 10]
    assert t.prefix_hashes.seen_fraction() == pytest.approx(2 / 6)
    pq = tmp_path / "g.parquet"
    pd.DataFrame({"s": [0.0, 1.0], "p": [5, 6], "o": [1, 2]}).to_parquet(pq)
    t = load(pq, "columns={arrival: s, prompt_tokens: p, output_tokens: o}")
    assert list(t.prompt_tokens) == [5, 6] and t.source.endswith("(generic)")
    with pytest.raises(ScenarioError, match=r"g.csv:1: missing column\(s\) turn"):
        load(csv, "columns={arrival: t_ms, prompt_tokens: in, output_tokens: out, session_id: turn}")
    with pytest.raises(ScenarioError, match="holds lists of hash ids, which only JSONL or parquet can carry"):
        load(csv, "columns={arrival: t_ms, prompt_tokens: in, output_tokens: out, hash_ids: conv, hash_block_size: 4}")


def test_length_only_traces_need_an_arrival_process(tmp_path):
    p = write(tmp_path, "l.csv", "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n10,5,15,2\n20,4,24,5\n")
    with pytest.raises(ScenarioError, match="format lengths has no arrival times; give 'arrival'"):
        load(p)
    with pytest.raises(ScenarioError, match="no arrival times to window or scale"):
        load(p, "window.end_s=10", "arrival={kind: poisson, rate: 1}")
    t = load(p, "arrival={kind: gamma, rate: 2, cv: 3}", "seed=4")
    assert t.arrival_s[0] == 0 and t.arrival_s[1] > 0 and list(t.prompt_tokens) == [10, 20]


# ---------------------------------------------------------------------------------------------- bad input

HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
TS = "2023-11-16 18:15:47.0000000"


@pytest.mark.parametrize("name,text,message", [
    ("missing.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,374\n", "cannot tell the trace format from "
     "its columns (TIMESTAMP, ContextTokens); expected one of: azure (TIMESTAMP,ContextTokens,GeneratedTokens)"),
    ("nonnum.csv", HEAD + f"{TS},x,3\n", "nonnum.csv:3: ContextTokens = 'x', expected a whole number of tokens from 0 to 2,147,483,647"),
    ("negative.csv", HEAD + f"{TS},5,-3\n", "negative.csv:3: GeneratedTokens = -3, expected a whole number of tokens from 0 to 2,147,483,647"),
    ("nan.csv", HEAD + f"{TS},NaN,3\n", "nan.csv:3: ContextTokens = 'NaN', expected a whole number of tokens from 0 to 2,147,483,647"),
    ("blank.csv", HEAD + f"{TS},,3\n", "blank.csv:3: ContextTokens is empty, expected a whole number of tokens from 0 to 2,147,483,647"),
    ("fraction.csv", HEAD + f"{TS},2.5,3\n", "fraction.csv:3: ContextTokens = 2.5, expected a whole number of tokens from 0 to 2,147,483,647"),
    # 2^31 is past int32 (the bound was 2^31 itself)
    ("big.csv", HEAD + f"{TS},2147483648,3\n", "big.csv:3: ContextTokens = 2147483648, expected a whole number of tokens from 0 to 2,147,483,647"),
    ("empty.csv", "", "empty.csv: empty file; expected a header line naming the columns"),
    ("header.csv", HEAD.splitlines()[0] + "\n", "header.csv: no requests (the file has a header but no rows)"),
    ("time.csv", HEAD + "2023-11-16 25:15:47.0000000,5,3\n", "time.csv:3: TIMESTAMP = '2023-11-16 25:15:47.0000000', "
     "expected a date and time such as 2023-11-16 18:15:46.6805900"),
    ("order.csv", HEAD + "2023-11-16 18:15:45.6805900,5,3\n", "order.csv:3: TIMESTAMP = '2023-11-16 18:15:45.6805900' "
     "is 1 s before the previous request; expected rows in arrival order (sort the file)"),
    ("fields.csv", HEAD + f"{TS},5,3,9\n", "fields.csv: not a valid CSV (Expected 3 fields in line 3, saw 4)"),
    ("fields1.csv", HEAD.splitlines()[0] + f"\n{TS},5,3,9\n", "fields1.csv:2: 4 fields, expected 3 as in the header"),
    ("vidur.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,5\n-1,5,5\n",
     "vidur.csv:3: arrived_at = -1, expected a number of s >= 0"),
    ("bad.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_length": 5\n',
     "bad.jsonl:2: not valid JSON"),
    ("list.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n[1, 2]\n',
     "list.jsonl:2: expected a JSON object, got list"),
    ("hashes.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "two"]}\n',
     "hashes.jsonl:1: hash_ids = [1, 'two'], expected a list of integer hash ids"),
    # JSON's true is no id (numpy read [true, 5] as [1, 5]: a prefix shared with id 1); nested or ragged lists
    # made numpy raise before any check (a traceback)
    ("truth.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [true, 5]}\n',
     "truth.jsonl:1: hash_ids = [True, 5], expected a list of integer hash ids"),
    ("nested.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [[1], 2]}\n',
     "nested.jsonl:1: hash_ids = [[1], 2], expected a list of integer hash ids"),
    ("ragged.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [[1, 2], [3]]}\n',
     "ragged.jsonl:1: hash_ids = [[1, 2], [3]], expected a list of integer hash ids"),
    ("big.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [99999999999999999999]}\n',
     "big.jsonl:1: hash_ids = [99999999999999999999], expected a list of integer hash ids"),
    ("lost.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_length": 5}\n',
     "lost.jsonl:2: output_length is empty, expected a whole number of tokens from 0 to 2,147,483,647"),
    ("zero.csv", HEAD.splitlines()[0] + f"\n{TS},5,0\n", "no requests left: all 1 rows were dropped (zero_output_tokens: 1)"),
    ("huge.csv", HEAD + f"{TS},1e20,3\n", "huge.csv:3: ContextTokens = 1e+20, expected a whole number of tokens"),
    ("huge2.csv", HEAD + f"{TS},2147483649,3\n", "huge2.csv:3: ContextTokens = 2147483649, expected a whole number"),
    ("bool.jsonl", '{"timestamp": 0, "input_length": true, "output_length": 1}\n',
     "bool.jsonl:1: input_length = True, expected a whole number of tokens"),
    ("dupcol.csv", "TIMESTAMP,ContextTokens,GeneratedTokens,ContextTokens\n" + TS + ",5,3,9\n",
     "dupcol.csv:1: column 'ContextTokens' appears more than once"),
    ("dupkey.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "input_length": 7}\n',
     "dupkey.jsonl:1: column 'input_length' appears more than once"),
    # NaN is not an empty value (both read as a float NaN: "timestamp is empty")
    ("nan.jsonl", '{"timestamp": NaN, "input_length": 5, "output_length": 1}\n',
     "nan.jsonl:1: timestamp = NaN, expected a number of ms >= 0"),
    ("inf.jsonl", '{"timestamp": 0, "input_length": Infinity, "output_length": 1}\n',
     "inf.jsonl:1: input_length = Infinity, expected a whole number of tokens"),
    ("null.jsonl", '{"timestamp": null, "input_length": 5, "output_length": 1}\n',
     "null.jsonl:1: timestamp is empty, expected a number of ms >= 0"),
    # one hash id per 512-token block: more ids than the prompt's blocks were taken as they were
    ("ids.jsonl", '{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": ' + str(list(range(3))) + '}\n',
     "ids.jsonl:1: hash_ids has 3 ids, expected at most 2, one per 512-token block of the 1,000-token prompt"),
    # arrivals more than 1e9 s after the start: times in a finer unit, as a rule (they crashed trace info)
    ("late.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,10\n1.0,200,20\n1e300,50,5\n",
     "late.csv:4: arrived_at = 1e+300, expected an arrival at most 1,000,000,000 s (about 32 years) after the "
     "trace's start (are the times in a finer unit than s?)"),
    ("late.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1e20, "input_length": 5, '
     '"output_length": 1}\n', "late.jsonl:2: timestamp = 1e+20, expected an arrival at most 1,000,000,000 s"),
    # echoed whole: a message of 140 KB
    ("digits.csv", HEAD + f"{TS},{'9' * 140_000},3\n", "digits.csv:3: ContextTokens = '" + "9" * 39 + "… (140,002 "
     "characters), expected a whole number of tokens"),
    # read as a CSV ("column ' \"input_length\": 5' appears more than once") or as parquet (RecursionError)
    ("array.jsonl", '[{"timestamp": 0, "input_length": 5, "output_length": 1},\n {"timestamp": 1}]\n',
     "array.jsonl:1: a JSON array; expected JSONL, one JSON object per line"),
    ("deep.jsonl", '{"timestamp": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
     "deep.jsonl:1: nested too deeply to read; expected one JSON object per line"),
    ("deep2.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": ' + "[" * 100_000
     + "]" * 100_000 + "}\n", "deep2.jsonl:2: nested too deeply to read, expected one JSON object per line"),
    ("year.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n0001-01-01 00:00:00,374,44\n9999-12-31 23:59:59,396,109\n",
     "year.csv:3: TIMESTAMP = '9999-12-31 23:59:59', expected an arrival at most 1,000,000,000 s (about 32 years) "
     "after the trace's start"),
])
def test_malformed_file_gives_the_documented_error(tmp_path, name, text, message):
    p = write(tmp_path, name, text)
    with pytest.raises(ScenarioError) as e:
        load(p)
    assert message in str(e.value) and str(p) in str(e.value)
    r = runner.invoke(app, ["trace", "info", str(p)])
    assert r.exit_code == 2 and "Traceback" not in r.output and message in r.output.replace("\n", "")


def test_unreadable_files(tmp_path):
    for name, data, message in [("bin.csv", bytes(range(128, 256)), "bin.csv:1: not UTF-8 text (byte 0x80 at column 1)"),
                                ("t.csv.gz", b"\x1f\x8b\x08broken", "cannot read"),
                                ("t.parquet", b"PAR1 not really", "cannot read as parquet")]:
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(ScenarioError, match=re.escape(message)):
            load(p)
    with pytest.raises(ScenarioError, match="no such trace file"):
        load(tmp_path / "absent.csv")
    with pytest.raises(ScenarioError, match="not a file"):
        load(tmp_path)


def test_bad_rows_drop_counts_every_row_by_reason(tmp_path):
    text = HEAD + f"{TS},x,3\n{TS},5,-3\n{TS},,3\n2023-11-16 99:00:00,5,3\n{TS},0,3\n{TS},7,0\n\n{TS},8,2\n"
    t = load(write(tmp_path, "mixed.csv", text), "bad_rows=drop")
    assert list(t.prompt_tokens) == [374, 8]
    assert t.dropped == {"not_a_number": 1, "negative_value": 1, "missing_value": 1, "unreadable_timestamp": 1,
                         "zero_prompt_tokens": 1, "zero_output_tokens": 1, "blank_line": 1}
    assert t.num_rows_read == len(text.splitlines()) - 1  # every line but the header
    jl = write(tmp_path, "m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
               'oops\n\n{"timestamp": 3, "input_length": 5, "output_length": 1, "hash_ids": "x"}\n')
    t = load(jl, "bad_rows=drop")
    assert len(t) == 1 and t.dropped == {"invalid_json": 1, "blank_line": 1, "bad_hash_ids": 1}
    # a line of blanks is a blank line too (it read as a row whose first cell was '   ': not_a_number)
    t = load(write(tmp_path, "w.csv", HEAD + "   \n \t , ,\n"), "bad_rows=drop")
    assert t.dropped == {"blank_line": 2}
    t = load(write(tmp_path, "r.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
                   '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [[1], 2]}\n'), "bad_rows=drop")
    assert len(t) == 1 and t.dropped == {"bad_hash_ids": 1}


def test_json_nesting_is_measured_before_parsing_and_brackets_in_strings_do_not_count(tmp_path):
    """A line nested past ``MAX_JSON_DEPTH`` is refused before json recurses to its limit (there the collector's
    finalizers failed: "Exception ignored", and a flaky test); brackets inside a string are text."""
    from traces.formats import MAX_JSON_DEPTH

    deep = '{"timestamp": 0, "input_length": 5, "output_length": 1, "x": ' + "[" * (MAX_JSON_DEPTH + 1) + \
        "]" * (MAX_JSON_DEPTH + 1) + "}\n"
    with pytest.raises(ScenarioError, match="nested too deeply to read"):
        load(write(tmp_path, "d.jsonl", deep))
    ok = '{"timestamp": 0, "input_length": 5, "output_length": 1, "x": "' + "[" * 500 + '"}\n'
    assert len(load(write(tmp_path, "ok.jsonl", ok))) == 1
    from traces.formats import too_deep

    nest = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    assert not too_deep('{"x": "a \\" ' + "[" * 70 + '"}')  # an escaped quote does not end the string
    assert not too_deep('{"x": "a \\\\", "y": "' + "[" * 70 + '"}')  # an escaped backslash does not escape the quote
    assert too_deep('{"x": "a \\\\", "y": ' + nest + "}")


def test_a_gzipped_parquet_file_is_named_as_such(tmp_path):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"arrived_at": [0.0], "num_prefill_tokens": [5], "num_decode_tokens": [2]}),
                   tmp_path / "t.parquet")
    (tmp_path / "t.parquet.gz").write_bytes(gzip.compress((tmp_path / "t.parquet").read_bytes()))
    with pytest.raises(ScenarioError, match="t.parquet.gz: gzip holding a parquet file; .*decompress it"):
        load(tmp_path / "t.parquet.gz")


def test_a_session_id_that_is_a_list_or_a_mapping_is_a_bad_value(tmp_path):
    """A list (JSON, or a parquet list column) crashed the reader with "setting an array element with a
    sequence"; a mapping was kept as the text "{'a': 1}"."""
    rows = [{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1, "session_id": s} for s in ([1], {"a": 1}, "u")]
    p = write(tmp_path, "s.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ScenarioError, match=re.escape(f"{p}:1: session_id = [1], expected a session id (or set")):
        load(p)
    t = load(p, "bad_rows=drop")
    assert list(t.session_id) == ["u"] and t.dropped == {"bad_session_id": 2}
    pd.DataFrame({"arrival_s": [0.0, 1.0], "prompt_tokens": [5, 6], "output_tokens": [1, 1],
                  "session_id": [[1], [2]]}).to_parquet(tmp_path / "s.parquet")
    with pytest.raises(ScenarioError, match=re.escape("s.parquet: row 1: session_id = [1], expected a session id")):
        load(tmp_path / "s.parquet")
    with pytest.raises(ScenarioError, match="all 2 rows were dropped \\(bad_session_id: 2\\)"):
        load(tmp_path / "s.parquet", "bad_rows=drop")


def test_arrivals_past_the_time_bound_are_dropped_and_the_peak_needs_no_bin_per_minute(tmp_path):
    """An arrival more than 1e9 s after the start is a bad value (dropped and counted as too_large); the
    peak rate counts runs of sorted arrivals, so a span stretched by rate_scale allocates nothing per minute
    (np.bincount over 1e300 s raised, over 9999 years ran out of memory)."""
    p = write(tmp_path, "late.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n0.5,1,1\n59.9,1,1\n"
              "60,1,1\n1e9,1,1\n1e9,1,1\n1000000000.5,1,1\n")
    t = load(p, "bad_rows=drop")
    assert len(t) == 6 and t.dropped == {"too_large": 1}
    assert trace_stats(t, timed=True)["peak_rate_per_min"] == 3
    r = runner.invoke(app, ["trace", "info", str(p), "-w", "bad_rows=drop", "-w", "rate_scale=1e-9"])
    assert r.exit_code == 0 and "span            1,000,000,000,000,000,000.0 s" in r.output and "peak 2 /min" in r.output
    # a canonical table keeps its absolute times (epoch seconds): the bound counts from its first arrival
    import pandas as pd

    pd.DataFrame({"arrival_s": [1.7e9, 1.7e9 + 1, 1.7e9 + 2e9], "prompt_tokens": [10, 20, 30],
                  "output_tokens": [5, 5, 5]}).to_parquet(tmp_path / "epoch.parquet")
    t = load(tmp_path / "epoch.parquet", "bad_rows=drop")
    assert list(t.arrival_s) == [1.7e9, 1.7e9 + 1] and t.dropped == {"too_large": 1}


def test_hash_ids_name_at_most_the_prompts_blocks(tmp_path):
    """ceil(prompt / 512) ids, or fewer (a named prefix: the rest matches no other prompt); more are a bad
    value, dropped and counted with bad_rows: drop."""
    lines = [(1, [1]), (512, [1]), (513, [1, 2]), (513, [1]), (513, []), (100, list(range(50))), (1000, [1, 2, 3])]
    p = write(tmp_path, "m.jsonl", "".join(json.dumps({"timestamp": i, "input_length": n, "output_length": 1,
                                                       "hash_ids": ids}) + "\n" for i, (n, ids) in enumerate(lines)))
    with pytest.raises(ScenarioError, match=re.escape(f"{p}:6: hash_ids has 50 ids, expected at most 1, one per "
                                                      "512-token block of the 100-token prompt (or set bad_rows")):
        load(p)
    t = load(p, "bad_rows=drop")
    assert list(t.prompt_tokens) == [1, 512, 513, 513, 513] and t.dropped == {"too_many_hash_ids": 2}
    assert list(np.diff(t.prefix_hashes.offsets)) == [1, 1, 2, 1, 0]


def test_bad_rows_drop_skips_and_counts_lines_with_too_many_fields(tmp_path):
    """A line with more fields than the header, the first data line included (pandas would read that one
    as an index column): an error naming the line, or with bad_rows: drop a counted row (it was an error
    even then); lines after the skipped ones are still named right."""
    t0 = "2023-11-16 18:15:4{}.0"
    lines = [HEAD.splitlines()[0], t0.format(5) + ",5,3,9", t0.format(6) + ",6,3", t0.format(7) + ",7,3,1", "",
             t0.format(8) + ",8,3,1", t0.format(9) + ",9,3"]
    p = write(tmp_path, "extra.csv", "\n".join(lines) + "\n")
    with pytest.raises(ScenarioError, match=re.escape(f"{p}:2: 4 fields, expected 3 as in the header (or set bad_rows: drop")):
        load(p)
    t = load(p, "bad_rows=drop")
    assert list(t.prompt_tokens) == [6, 9] and t.num_rows_read == len(lines) - 1
    assert t.dropped == {"too_many_fields": 3, "blank_line": 1}
    q = write(tmp_path, "later.csv", "\n".join(lines[:1] + lines[2:] + [t0.format(1) + ",1,3"]) + "\n")
    with pytest.raises(ScenarioError, match=re.escape("not a valid CSV (Expected 3 fields in line 3, saw 4) (or set bad_rows")):
        load(q)
    two = write(tmp_path, "two.csv", "arrival_s,prompt_tokens,output_tokens\n1,5,3,4\n2,6,3,9\n3,7,3\n")
    t = read_trace(open_trace(two), bad_rows="drop")  # the second line, first once the first is skipped: cut, kept
    assert list(t.prompt_tokens) == [7] and t.dropped == {"too_many_fields": 2}
    blank = write(tmp_path, "blank.csv", "\n\narrival_s,prompt_tokens,output_tokens\n1,5,3\n2,x,3\n")
    with pytest.raises(ScenarioError, match=re.escape(f"{blank}:5: prompt_tokens = 'x'")):  # (EmptyDataError)
        read_trace(open_trace(blank))
    for chunk_rows in (1, 2, 100):  # the out-of-order row is line 7, past two skipped lines, in any chunking
        with pytest.raises(ScenarioError, match=re.escape(f"{q}:7: TIMESTAMP = '{t0.format(1)}' is 8 s before")):
            read_trace(open_trace(q), bad_rows="drop", chunk_rows=chunk_rows)


def test_a_field_past_the_csv_modules_limit_is_a_value_like_any_other(tmp_path):
    """A first data row with a field of more than 131,072 characters raised _csv.Error (plain or gzip, with
    bad_rows: drop too), and such a field in the header was "cannot read as parquet"."""
    head = "arrived_at,num_prefill_tokens,num_decode_tokens\n"
    for name, row, message, dropped in [("long.csv", "0,10,4" + "0" * 200_000, ":2: num_decode_tokens = '4000",
                                         {"not_a_number": 1}),
                                        ("wide.csv", "0,10,4," + "x" * 200_000, ":2: 4 fields, expected 3",
                                         {"too_many_fields": 1})]:
        p = write(tmp_path, name, head + row + "\n1,5,5\n")
        z = tmp_path / (name + ".gz")
        z.write_bytes(gzip.compress(p.read_bytes()))
        for f in (p, z):
            with pytest.raises(ScenarioError, match=re.escape(f"{f}{message}")):
                load(f)
            t = load(f, "bad_rows=drop")
            assert list(t.prompt_tokens) == [5] and t.dropped == dropped
    p = write(tmp_path, "header.csv", head.replace("\n", "y" * 200_000 + "\n") + "0,10,4\n")
    r = runner.invoke(app, ["trace", "info", str(p)])
    assert r.exit_code == 2 and r.output.startswith(f"error: {p}:1: not a CSV header (field larger than field limit"), \
        r.output


def test_a_byte_that_is_not_utf8_is_named_by_line_or_dropped_and_counted(tmp_path):
    good = "".join(f"{TS},5,3\n" for _ in range(3000))
    p = tmp_path / "b.csv"
    p.write_bytes((HEAD + good).encode() + f"{TS},3".encode() + b"\xe94,16\n" + good.encode())
    with pytest.raises(ScenarioError, match=re.escape(f"{p}:3003: not UTF-8 text (byte 0xe9 at column ")) as e:
        load(p)
    assert "bad_rows: drop" in str(e.value)
    t = load(p, "bad_rows=drop")
    assert len(t) == 1 + 6000 and t.dropped == {"not_a_number": 1}
    jl = tmp_path / "b.jsonl"  # JSONL: named by line too, with no hint that dropping would skip it
    jl.write_bytes(b'{"timestamp": 0, "input_length": 5, "output_length": 1}\n' * 3 + b'{"timestamp": 1, "input_length": 5\xe9}\n')
    with pytest.raises(ScenarioError, match=re.escape(f"{jl}:4: not UTF-8 text (byte 0xe9 at column 35)")) as e:
        load(jl)
    assert "bad_rows" not in str(e.value)


def test_workload_keys_on_the_command_line_are_checked(tmp_path):
    p = write(tmp_path, "a.csv", HEAD)
    for settings, message in [(["sample=2"], "-w: sample: Input should be less than or equal to 1 (got 2)"),
                              (["window.end_s=-1"], "-w: window.end_s: Input should be greater than 0"),
                              (["colour=red"], "-w: colour: unknown key"),
                              (["sample"], "-w 'sample': expected KEY=VALUE"),
                              (["path=x"], "the trace file is the FILE argument"),
                              (["arrival={kind: poisson, rate: 1}", "rate_scale=2"], "give either 'arrival'"),
                              (["format=azure", "columns={prompt_tokens: a, output_tokens: b}"], "give either 'format'"),
                              (["columns={prompt_tokens: a, output_tokens: b, hash_ids: h}"], "give 'hash_ids' and "
                               "'hash_block_size' together"),
                              # one column for two fields (a DataFrame's AttributeError before)
                              (["columns={arrival: ts, prompt_tokens: p, output_tokens: p}"],
                               "-w: columns: prompt_tokens and output_tokens both read column 'p'; expected a column per field"),
                              (["columns={arrival: ts, prompt_tokens: p, output_tokens: ts}"],
                               "columns: arrival and output_tokens both read column 'ts'"),
                              (["columns={arrival: ts, prompt_tokens: p, output_tokens: o, session_id: p}"],
                               "columns: prompt_tokens and session_id both read column 'p'"),
                              # the last was kept, silently
                              (["sample=0.5", "sample=0.9"], "-w 'sample=0.9': sample is already set (by -w "
                               "'sample=0.5'); give each key once"),
                              (["window.end_s=5", "window={start_s: 1}"], "-w 'window={start_s: 1}': window is "
                               "already set (by -w 'window.end_s=5')")]:
        with pytest.raises(ScenarioError, match=re.escape(message)):
            workload_from_options(p, settings)
    r = runner.invoke(app, ["trace", "convert", str(p), str(tmp_path / "out.csv")])
    assert r.exit_code == 2 and "name it *.parquet" in r.output
    assert workload_from_options(p, ["num_requests=010"]).num_requests == 10  # (as in a file: YAML 1.1 read 8)


def test_bom_and_long_fractions_are_read(tmp_path):
    """A UTF-8 byte-order mark is not part of the first column's name; timestamps may have more than 9
    fractional digits (the rest is below a nanosecond)."""
    p = write(tmp_path, "bom.csv", "\ufeff" + HEAD + "2023-11-16 18:15:47.000000000123,5,3\n")
    t = load(p)
    assert len(t) == 2 and t.arrival_s[1] == pytest.approx(1 - 0.6805900, abs=1e-9)


def test_parquet_timestamps_are_not_seconds(tmp_path):
    df = pd.DataFrame({"arrived_at": pd.to_datetime(["2024-01-01 00:00:00", "2024-01-01 00:00:01"]),
                       "num_prefill_tokens": [5, 6], "num_decode_tokens": [3, 4]})
    p = tmp_path / "t.parquet"
    df.to_parquet(p)
    with pytest.raises(ScenarioError, match="holds date-times.*arrival_unit: datetime"):
        load(p)


@pytest.mark.parametrize("size", [b"abc", b"0", b"-5", b"99999999999999999999", b"\xff"])
def test_a_parquet_tables_hash_block_size_is_checked(tmp_path, size):
    """Not a whole number was a ValueError traceback; 0 passed sim check, then divided by zero in the run;
    negative or huge ones were taken as they were."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"arrival_s": [0.0, 1.0], "prompt_tokens": [5, 6], "output_tokens": [1, 2],
                      "hash_ids": [[1], [1]]})
    p = tmp_path / "t.parquet"
    pq.write_table(table.replace_schema_metadata({b"kvsim.hash_block_size": size}), p)
    with pytest.raises(ScenarioError, match=re.escape(f"{p}: metadata kvsim.hash_block_size = ")) as e:
        load(p)
    assert "expected a whole number of tokens per hashed block from 1 to 1,048,576" in str(e.value)
    pq.write_table(table.replace_schema_metadata({b"kvsim.hash_block_size": b"16"}), p)
    assert load(p).prefix_hashes.block_size == 16


def test_a_nan_is_named_as_such_and_an_empty_cell_as_empty(tmp_path):
    """In parquet (and JSON) a NaN and an empty cell (null) are different mistakes: both read as a float NaN,
    both were 'is empty'; with bad_rows: drop they are counted apart."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"arrival_s": [0.0, float("nan"), None, 3.0], "prompt_tokens": [5, 6, 7, 8],
                             "output_tokens": [1.0, 2.0, 3.0, 4.0], "session_id": [1.5, 2.5, 3.5, float("nan")]}), p)
    with pytest.raises(ScenarioError, match=re.escape(f"{p}: row 2: arrival_s = NaN, expected a number of s >= 0")):
        load(p)
    t = load(p, "bad_rows=drop")
    assert len(t) == 1 and t.dropped == {"not_a_number": 2, "missing_value": 1}  # row 4: its session id is NaN
    pq.write_table(pa.table({"arrival_s": [0.0, None], "prompt_tokens": [5, 6], "output_tokens": [1, 2]}), p)
    with pytest.raises(ScenarioError, match=re.escape(f"{p}: row 2: arrival_s is empty")):
        load(p)
    jl = write(tmp_path, "s.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "session_id": NaN}\n')
    cols = "columns={arrival: timestamp, prompt_tokens: input_length, output_tokens: output_length, session_id: session_id}"
    with pytest.raises(ScenarioError, match=re.escape(f"{jl}:1: session_id = NaN, expected a session id")):
        load(jl, cols)


@pytest.mark.parametrize("command", ["info", "convert"])
def test_a_max_model_len_without_truncation_is_refused(tmp_path, command):
    """Without cap_lengths=truncate --max-model-len was ignored: trace info showed 100-token prompts under
    --max-model-len 5 without a word, and convert wrote them."""
    p = write(tmp_path, "a.csv", "num_prefill_tokens,num_decode_tokens\n100,20\n50,5\n")
    out = [str(tmp_path / "o.parquet"), "-w", "arrival={kind: poisson, rate: 2}"] if command == "convert" else []
    r = runner.invoke(app, ["trace", command, str(p), *out, "--max-model-len", "5"])
    assert r.exit_code == 2 and "--max-model-len 5: read only with -w cap_lengths=truncate" in r.output, r.output
    assert not (tmp_path / "o.parquet").exists()


def test_convert_onto_its_own_input_is_refused(tmp_path):
    """OUT the input file itself was overwritten by the transformed table: -w sample=0.5 halved the trace."""
    p = write(tmp_path, "a.csv", "num_prefill_tokens,num_decode_tokens\n100,20\n50,5\n30,3\n")
    t = tmp_path / "t.parquet"
    r = runner.invoke(app, ["trace", "convert", str(p), str(t), "-w", "arrival={kind: poisson, rate: 2}"])
    assert r.exit_code == 0, r.output
    before = t.read_bytes()
    r = runner.invoke(app, ["trace", "convert", str(t), str(t), "-w", "sample=0.5"])
    assert r.exit_code == 2 and "is the trace being converted; write the table to another file" in r.output, r.output
    assert t.read_bytes() == before


def test_a_max_model_len_below_two_is_refused(tmp_path):
    """Truncation keeps max_model_len - 1 prompt tokens: at 1 it made empty prompts that 'finished'."""
    p = write(tmp_path, "a.csv", HEAD)
    r = runner.invoke(app, ["trace", "info", str(p), "-w", "cap_lengths=truncate", "--max-model-len", "1"])
    assert r.exit_code == 2 and "--max-model-len" in r.output and "Traceback" not in r.output


def test_max_model_len_is_bounded_by_the_token_limit(tmp_path):
    """--max-model-len 2**31 was accepted (one past the int32 limit the rest of the code holds): a truncated
    request reached 2**31 tokens."""
    from sim.catalog import MAX_TOKENS

    p = write(tmp_path, "a.csv", "num_prefill_tokens,num_decode_tokens\n100,20\n")
    for n, code in ((MAX_TOKENS + 1, 2), (MAX_TOKENS, 0)):
        r = runner.invoke(app, ["trace", "info", str(p), "-w", "cap_lengths=truncate", "--max-model-len", str(n)])
        assert r.exit_code == code, r.output


def test_a_workload_key_without_its_kind_says_which_kinds(tmp_path):
    """-w arrival.rate=5 said "arrival: Unable to extract tag using discriminator 'kind'"; a misspelt key had no hint."""
    p = write(tmp_path, "a.csv", "num_prefill_tokens,num_decode_tokens\n100,20\n")
    r = runner.invoke(app, ["trace", "info", str(p), "-w", "arrival.rate=5"])
    assert r.exit_code == 2 and "-w: arrival: no 'kind' given: expected kind: gamma | poisson" in r.output, r.output
    r = runner.invoke(app, ["trace", "info", str(p), "-w", "windw.end_s=5"])
    assert r.exit_code == 2 and "windw: unknown key (did you mean 'window'?)" in r.output, r.output
