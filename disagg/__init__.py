"""Prefill/decode disaggregation for OasisKV (imported as ``oasis_sglang.disagg``). See README.md."""
