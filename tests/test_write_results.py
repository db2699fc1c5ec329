"""The result tables' ``policy`` column, built at once as a categorical, is what tagging each policy's
rows and converting the whole column would give (dtype, categories and their order), empty tables too;
the tables are written as pandas writes them, with dictionaries only where they pay; a run's own tables
(``Columns``) are written by pyarrow alone and read back as the same DataFrames, and ``sim run`` on a
generated workload never imports pandas."""

import pandas as pd
import pytest

from sim.run import _policy_codes


@pytest.mark.parametrize("lengths", [{"vllm": 3, "orca-max": 2, "fastertransformer": 1},
                                     {"b": 2, "a": 0, "c": 1}, {"only": 0}, {"x": 0, "y": 0}, {"z": 4}])
def test_policy_column_is_the_tagged_rows_as_a_category(lengths):
    frames = {n: pd.DataFrame({"v": pd.Series(range(k), dtype="int64")}) for n, k in lengths.items()}
    tagged = pd.concat([f.assign(policy=n) for n, f in frames.items()], ignore_index=True)
    expected = tagged["policy"].astype("category")
    codes, names = _policy_codes(frames)
    got = pd.Series(pd.Categorical.from_codes(codes, pd.Index(names, dtype="str")), name="policy")
    pd.testing.assert_series_equal(got, expected, check_exact=True)
    assert list(got.cat.categories) == sorted(n for n, k in lengths.items() if k)


def test_result_tables_read_back_as_pandas_writes_them_with_dictionaries_only_for_labels(tmp_path):
    """``write_parquet`` keeps what ``to_parquet`` writes (the frame read back, the schema with pandas'
    metadata) and dictionary-encodes only categorical and text columns: float and count columns, nearly
    all distinct, gained nothing from it and cost half the writing time."""
    import numpy as np
    import pyarrow.parquet as pq

    from sim.outputs import write_parquet

    n = 1000
    df = pd.DataFrame({"time_s": np.linspace(0, 1, n), "tokens": np.arange(n, dtype=np.int64),
                       "flag": np.arange(n) % 2 == 0, "status": pd.Categorical(["finished", "rejected"] * (n // 2)),
                       "name": pd.Series(["a", None] * (n // 2), dtype="str")})
    df.to_parquet(tmp_path / "pandas.parquet", index=False)
    write_parquet(df, tmp_path / "ours.parquet")
    ours, theirs = tmp_path / "ours.parquet", tmp_path / "pandas.parquet"
    pd.testing.assert_frame_equal(pd.read_parquet(ours), pd.read_parquet(theirs), check_exact=True)
    assert pq.read_schema(ours).equals(pq.read_schema(theirs), check_metadata=True)
    meta = pq.ParquetFile(ours).metadata.row_group(0)
    dictionary = {meta.column(i).path_in_schema: any("DICTIONARY" in e for e in meta.column(i).encodings)
                  for i in range(meta.num_columns)}
    assert dictionary == {"time_s": False, "tokens": False, "flag": False, "status": True, "name": True}


def test_columns_are_written_without_pandas_and_read_back_as_the_frame_pandas_would_write(tmp_path):
    """A ``Columns`` table (codes for categoricals, NaN floats, booleans, narrow ints) written by pyarrow
    alone reads back as the DataFrame that ``to_parquet`` of its ``frame()`` gives, value for value."""
    import numpy as np
    import pyarrow.parquet as pq

    from sim.outputs import Columns, concat_columns, write_parquet

    n = 1001
    parts = [Columns({"time_s": np.where(np.arange(n) % 7 == 0, np.nan, np.linspace(0, 1, n)),
                      "tokens": np.arange(n, dtype=np.int64) * k, "small": (np.arange(n) % 100).astype(np.int8),
                      "flag": np.arange(n) % 3 == 0, "status": (np.arange(n) % 3).astype(np.int8)},
                     {"status": ["pending", "finished", "rejected"]}) for k in (1, 2)]
    table = concat_columns(parts, "policy", np.repeat([1, 0], n), ["a", "b"], first=False)
    write_parquet(table, tmp_path / "ours.parquet")
    table.frame().to_parquet(tmp_path / "pandas.parquet", index=False)
    got = pd.read_parquet(tmp_path / "ours.parquet")
    pd.testing.assert_frame_equal(got, pd.read_parquet(tmp_path / "pandas.parquet"), check_exact=True)
    assert list(got.columns) == ["time_s", "tokens", "small", "flag", "status", "policy"]
    assert got.time_s.isna().sum() == 2 * len(range(0, n, 7))  # NaN written as null, as pandas writes it
    assert list(got.policy.cat.categories) == ["a", "b"] and (got.policy[:n] == "b").all()
    dictionary = {c.path_in_schema: any("DICTIONARY" in e for e in c.encodings)
                  for c in (pq.ParquetFile(tmp_path / "ours.parquet").metadata.row_group(0).column(i) for i in range(6))}
    assert dictionary == {"time_s": False, "tokens": False, "small": False, "flag": False, "status": True,
                          "policy": True}


@pytest.mark.parametrize("scenario", ["tiny-cpu.yaml", "tiny-hybrid-cpu.yaml"])
def test_a_run_that_only_writes_its_files_does_not_import_pandas(tmp_path, scenario):
    """``sim run --no-report`` on a generated workload: the tables go from numpy to parquet directly (pandas
    is a third of a second of the command's start); reading a result as a DataFrame still works. A model of
    several KV groups too (kv_groups.parquet was built as a DataFrame: pandas imported by every such run)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import sys; from sim.run import run_to_dir; "
            f"run_to_dir({str(root / 'scenarios' / scenario)!r}, {str(tmp_path)!r}); "
            "print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"
    assert len(pd.read_parquet(tmp_path / "requests.parquet")) > 0
    if scenario == "tiny-hybrid-cpu.yaml":
        groups = pd.read_parquet(tmp_path / "kv_groups.parquet")
        assert set(groups.group.astype(str)) == {"full (1 group)", "sliding W=8 (2 groups)"} and len(groups)
