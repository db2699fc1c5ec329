"""Figures and HTML pages built from result tables (summary.json, requests/steps parquet).

Nothing here computes a metric the simulator owns: it reads them and draws them."""
