"""Benchmark libraries behind the scripts: ``serving`` (scripts/bench_oasis.py: OasisKV vs dense
SGLang through ``bench_serving``) and ``profile_trace`` (scripts/profile_trace.py)."""
