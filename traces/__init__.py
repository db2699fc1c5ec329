"""Readers for real production trace formats, returning the canonical request table.

``formats`` (which column holds what; detection from the header) · ``read`` (chunked reading, checks,
the canonical parquet writer) · ``workload`` (transforms; ``load_trace``, what a scenario's
``kind: trace`` workload runs) · ``commands`` (``sim trace info`` and ``sim trace convert``).
"""
