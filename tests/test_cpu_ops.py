"""The torch sgl_kernel ops for CPU hosts, each against the formula it implements, and the
finder that serves them as ``sgl_kernel`` only where the CUDA driver is absent."""

import subprocess
import sys

import pytest
import torch

from oasis_sglang import cpu_ops


def test_assign_req_to_token_pool_cpu(seed):
    R, L = 5, 40
    table = torch.randint(0, 1000, (R, L), dtype=torch.int32)
    expected = table.clone()
    rows = torch.tensor([3, 0, 4])
    start = torch.tensor([2, 0, 10])
    end = torch.tensor([7, 3, 10 + 17])
    out = torch.randint(0, 10**6, (int((end - start).sum()),), dtype=torch.int64)
    o = 0
    for r, s, e in zip(rows.tolist(), start.tolist(), end.tolist()):
        expected[r, s:e] = out[o:o + e - s].to(torch.int32)
        o += e - s
    cpu_ops.assign_req_to_token_pool_cpu(rows, table, start, end, out, L)
    assert torch.equal(table, expected)
    with pytest.raises(ValueError, match="pool_len"):
        cpu_ops.assign_req_to_token_pool_cpu(rows[:1], table, start[:1], torch.tensor([L + 1]), out, L)


def test_copy_all_layer_kv_cache_cpu(seed):
    bufs = [torch.randn(50, 3, 8), torch.randn(50, 3, 8).to(torch.bfloat16), torch.randn(50, 2, 4)]
    expected = [b.clone() for b in bufs]
    src = torch.tensor([4, 9, 30, 31])
    tgt = torch.tensor([9, 40, 2, 49])   # 9 is both a source and a target: sources are read first
    for e in expected:
        e[tgt] = e[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    cpu_ops.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, e in zip(bufs, expected):
        assert torch.equal(b, e)


def test_import_only_ops_raise_clearly():
    for name in cpu_ops.IMPORT_ONLY:
        with pytest.raises(NotImplementedError, match="speculative"):
            getattr(cpu_ops, name)()


def _import_sgl_kernel(env_extra):
    code = ("import sgl_kernel, json; print(json.dumps([getattr(sgl_kernel, '__oasis_cpu_shim__', False), "
            "hasattr(sgl_kernel, 'copy_all_layer_kv_cache_cpu')]))")
    import os
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_finder_serves_the_shim_without_cuda():
    import oasis_sglang_cpu_shim as shim

    if shim.cuda_driver_present():
        pytest.skip("CUDA driver present: the real sgl_kernel must load (tested on the GPU host)")
    r = _import_sgl_kernel({})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[true, true]"


def test_finder_steps_aside_when_disabled_or_cuda_present():
    import oasis_sglang_cpu_shim as shim

    r = _import_sgl_kernel({"OASIS_DISABLE_CPU_SHIM": "1"})
    if shim.cuda_driver_present():
        assert "true" not in r.stdout
    else:   # the real package cannot load here: it needs libcuda
        assert r.returncode != 0 and "libcuda" in r.stderr
    # the decision itself: a finder never claims sgl_kernel when the driver loads
    f = shim.SglKernelCpuFinder()
    assert (f.find_spec("sgl_kernel") is None) == shim.cuda_driver_present()
    assert f.find_spec("numpy") is None
