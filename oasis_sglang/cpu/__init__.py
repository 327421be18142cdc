"""SGLang's CPU engine without CUDA: the torch ``sgl_kernel`` ops it needs.

  finder          the import hook that serves ``sgl_kernel`` from ``sgl_kernel_ops`` when the
                  CUDA driver is absent (imported by ``oasis_sglang_cpu.pth`` at interpreter start)
  sgl_kernel_ops  torch versions of the ``sgl_kernel`` ops SGLang 0.5.17 calls on CPU

Kept import-light: ``finder`` runs in every Python process of the environment.
"""
