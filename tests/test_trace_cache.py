"""The parsed-trace cache (``traces/cache.py``): a trace read again comes from its numpy copy, equal to
parsing it; a changed file, another way of reading it, or other reader code parse it again; a file that
fails is never cached; a cache that is off, unwritable or damaged only means parsing."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from sim.config import ScenarioError
from traces import cache
from traces.commands import workload_from_options
from traces.workload import load_trace

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def azure_csv(path, rows):
    path.write_text(AZURE_HEADER + "".join(f"2023-11-16 18:15:{i:02d}.0000000,{p},{o}\n" for i, (p, o) in enumerate(rows)))
    return path


@pytest.fixture
def folder(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("KVSIM_TRACE_CACHE", str(d))
    return d


@pytest.fixture
def parses(monkeypatch):
    """How many times a trace file was parsed (``traces.read.read_trace`` called)."""
    import traces.read

    calls = []
    real = traces.read.read_trace
    monkeypatch.setattr(traces.read, "read_trace", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def load(path, *options):
    return load_trace(workload_from_options(path, list(options)), path)


def same(a, b):
    assert np.array_equal(a.arrival_s, b.arrival_s) and a.arrival_s.dtype == b.arrival_s.dtype
    assert np.array_equal(a.prompt_tokens, b.prompt_tokens) and np.array_equal(a.output_tokens, b.output_tokens)
    assert (a.source, a.dropped, a.truncated) == (b.source, b.dropped, b.truncated)
    assert (a.prefix_hashes is None) == (b.prefix_hashes is None)
    if a.prefix_hashes is not None:
        assert np.array_equal(a.prefix_hashes.ids, b.prefix_hashes.ids)
        assert np.array_equal(a.prefix_hashes.offsets, b.prefix_hashes.offsets)
        assert a.prefix_hashes.block_size == b.prefix_hashes.block_size
    assert (a.session_id is None) == (b.session_id is None)
    if a.session_id is not None:
        assert np.array_equal(a.session_id, b.session_id) and a.session_id.dtype == b.session_id.dtype


def test_a_trace_read_again_comes_from_its_copy_equal_to_parsing_it(tmp_path, folder, parses):
    p = azure_csv(tmp_path / "t.csv", [(10, 5), (20, 0), (30, 7)])  # a zero-output row: dropped, counted
    first, again = load(p), load(p)
    assert len(parses) == 1 and len(list(folder.glob("*.npz"))) == 1
    same(first, again)
    assert again.dropped == {"zero_output_tokens": 1}
    same(load(p, "bad_rows=drop"), first)  # another way of reading: its own entry, parsed once
    assert len(parses) == 2 and len(list(folder.glob("*.npz"))) == 2


def test_a_copy_found_through_another_path_names_the_path_this_run_read(tmp_path, folder, parses):
    """The cache is keyed on the resolved file: a run reading it through a link finds the copy another path
    filled, and its table (summary.json's workload.source) names the path this run gave, not the other."""
    (tmp_path / "real").mkdir()
    azure_csv(tmp_path / "real" / "t.csv", [(10, 5), (20, 6)])
    for link in ("a", "b"):
        (tmp_path / link).symlink_to(tmp_path / "real")
    via_a, via_b, direct = (load(tmp_path / d / "t.csv") for d in ("a", "b", "real"))
    assert len(parses) == 1, "one file, one parse"
    assert via_a.source == f"{tmp_path / 'a' / 't.csv'} (azure)"
    assert via_b.source == f"{tmp_path / 'b' / 't.csv'} (azure)"
    assert direct.source == f"{tmp_path / 'real' / 't.csv'} (azure)"
    assert np.array_equal(via_a.arrival_s, via_b.arrival_s)


def test_hash_ids_and_session_ids_survive_the_copy(tmp_path, folder, parses):
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 3,
                                     "hash_ids": [i % 2, 10 + i]}) + "\n" for i in range(5)))
    first, again = load(p), load(p)
    assert len(parses) == 1 and first.prefix_hashes is not None
    same(first, again)
    c = tmp_path / "c.csv"
    c.write_text("arrival_s,prompt_tokens,output_tokens,session_id\n0,5,5,a\n1,6,6,b\n2,7,7,a\n")
    first, again = load(c), load(c)
    assert len(parses) == 2 and list(again.session_id) == ["a", "b", "a"]
    same(first, again)


def test_a_changed_file_or_other_reader_code_is_parsed_again(tmp_path, folder, parses, monkeypatch):
    p = azure_csv(tmp_path / "t.csv", [(10, 5), (20, 6)])
    assert len(load(p)) == 2
    azure_csv(p, [(10, 5), (20, 6), (30, 7)])  # same name, other content
    assert len(load(p)) == 3 and len(parses) == 2
    assert len(list(folder.glob("*.npz"))) == 1  # the file's entry replaced, not a second one
    monkeypatch.setattr(cache, "_code_hash", lambda: "another reader")
    assert len(load(p)) == 3 and len(parses) == 3


def test_a_same_size_rewrite_that_keeps_the_files_time_is_parsed_again(tmp_path, folder, parses):
    """As ``cp -p`` or ``touch -r`` leave a file: same size, same time, same inode, other bytes (a fuzzing
    helper got the old table back without a word)."""
    import os

    p = azure_csv(tmp_path / "t.csv", [(10, 5), (20, 7)])
    st = p.stat()
    assert list(load(p).output_tokens) == [5, 7]
    with open(p, "r+b") as f:  # one digit, in place
        data = f.read()
        f.seek(data.rindex(b"7"))
        f.write(b"8")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    assert list(load(p).output_tokens) == [5, 8] and len(parses) == 2


def test_a_file_that_fails_is_never_cached(tmp_path, folder, parses):
    p = tmp_path / "bad.csv"
    p.write_text(AZURE_HEADER + "2023-11-16 18:15:00,10,5\n2023-11-16 18:15:01,ten,5\n")
    for _ in range(2):
        with pytest.raises(ScenarioError, match="bad.csv:3"):
            load(p)
    assert len(parses) == 2 and not list(folder.glob("*.npz"))


def test_off_unwritable_or_damaged_means_parsing(tmp_path, folder, parses, monkeypatch):
    p = azure_csv(tmp_path / "t.csv", [(10, 5), (20, 6)])
    monkeypatch.chdir(tmp_path)
    for off in ("0", "false", " Off "):  # ("false" made a cache folder named false)
        monkeypatch.setenv("KVSIM_TRACE_CACHE", off)
        load(p)
    assert len(parses) == 3 and not folder.exists() and not (tmp_path / "false").exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVSIM_TRACE_CACHE", str(blocker / "cache"))  # cannot be made: parsed every time
    same(load(p), load(p))
    assert len(parses) == 5
    monkeypatch.setenv("KVSIM_TRACE_CACHE", str(folder))
    good = load(p)
    (entry,) = folder.glob("*.npz")
    entry.write_bytes(b"not a numpy file")
    same(load(p), good)  # parsed again, and the entry made whole
    assert len(parses) == 7
    same(load(p), good)
    assert len(parses) == 7


def test_no_home_directory_means_no_cache_not_an_error(tmp_path, parses, monkeypatch):
    """With no cache folder named and no home directory to find (``Path.home`` raises), traces are parsed."""
    from pathlib import Path

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("KVSIM_TRACE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    p = azure_csv(tmp_path / "t.csv", [(10, 5), (20, 6)])
    assert cache.cache_dir() is None
    same(load(p), load(p))
    assert len(parses) == 2


def test_a_trace_command_from_the_copy_imports_no_pandas(tmp_path):
    """The second ``sim run`` of a trace scenario reads the trace's copy: pandas (the readers' parser)
    stays unloaded, as it does for a generated workload; so do the modules a plain run outside a terminal
    never needs (a progress bar, the decomposition, numpy's masked arrays and random numbers)."""
    p = azure_csv(tmp_path / "t.csv", [(100 + i, 20 + i) for i in range(40)])
    spec = tmp_path / "s.yaml"
    spec.write_text(json.dumps({"name": "t", "model": "llama-2-7b", "gpu": "a100-80gb", "policies": ["vllm"],
                                "workload": {"kind": "trace", "path": str(p)}}))
    code = ("import sys; from kvsim import run_to_dir; "
            f"run_to_dir({str(spec)!r}, {str(tmp_path / 'out')!r}, report=False); "
            "print([m for m in ('rich.progress', 'sim.decompose', 'numpy.ma', 'numpy.random') if m in sys.modules]); "
            "print('pandas' in sys.modules)")
    env = {**os.environ, "KVSIM_TRACE_CACHE": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    assert [r.stdout.strip().splitlines()[-1] for r in runs] == ["True", "False"]
    assert runs[1].stdout.strip().splitlines()[-2] == "[]"


def test_a_large_file_is_hashed_by_samples_that_still_see_a_rewrite(tmp_path, monkeypatch):
    """Past FULL_DIGEST_BYTES a file is hashed by 16 evenly spaced MiB and its last (a week-long trace, once
    per sweep task): a change inside a sample, or to the size, changes the digest."""
    from sim import userfile

    monkeypatch.setattr(userfile, "FULL_DIGEST_BYTES", 1 << 20)
    p = tmp_path / "big.bin"
    data = bytearray(40 << 20)
    p.write_bytes(data)
    first = userfile.file_digest(p)
    data[(40 << 20) // 16 * 3 + 5] = 1  # inside the fourth sample
    p.write_bytes(data)
    second = userfile.file_digest(p)
    assert second != first
    with open(p, "ab") as f:  # one byte more, past every sample: the size is hashed too
        f.write(b"\0")
    assert userfile.file_digest(p) not in (first, second)
