"""SGLang glue: the only part of ``oasis_sglang`` (with ``disagg``) that imports sglang.

It delegates: the logic lives in ``oasis_sglang.core``. Every SGLang symbol it touches is
listed in ``hooks.HOOKS`` and checked to resolve at start-up.
"""
