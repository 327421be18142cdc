"""Offline evaluation of OasisKV's selection (transformers, CPU): ``sparse_sim``."""
