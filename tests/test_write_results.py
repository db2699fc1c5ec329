"""The result tables' ``policy`` column, built at once as a categorical, is what tagging each policy's
rows and converting the whole column would give (dtype, categories and their order), empty tables too;
the tables are written as pandas writes them, with dictionaries only where they pay."""

import pandas as pd
import pytest

from sim.run import _policy_column


@pytest.mark.parametrize("lengths", [{"vllm": 3, "orca-max": 2, "fastertransformer": 1},
                                     {"b": 2, "a": 0, "c": 1}, {"only": 0}, {"x": 0, "y": 0}, {"z": 4}])
def test_policy_column_is_the_tagged_rows_as_a_category(lengths):
    frames = {n: pd.DataFrame({"v": pd.Series(range(k), dtype="int64")}) for n, k in lengths.items()}
    tagged = pd.concat([f.assign(policy=n) for n, f in frames.items()], ignore_index=True)
    expected = tagged["policy"].astype("category")
    got = pd.Series(_policy_column(frames), name="policy")
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
