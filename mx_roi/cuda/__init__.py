"""CUDA backend of mx_roi: CuPy raw kernels (``operators/*.cu``) on a GPU, and the same
kernels compiled for the host (the ``emulated-cuda`` backend) to prove them without one.

* :mod:`mx_roi.cuda.source`  -- kernel sources, name expressions, NVRTC options, signatures
* :mod:`mx_roi.cuda.loader`  -- module-loader seam (NVRTC through CuPy / g++ + ctypes),
  the trusted compiled-kernel cache, checked launches ``kernel(grid, block, args)``
* :mod:`mx_roi.cuda.backend` -- :class:`~mx_roi.cuda.backend.CudaBackend` (NDArray I/O through
  :mod:`mx_roi.ndio`, req handling, float16, deterministic mode, synchronisation), and
  :class:`~mx_roi.cuda.backend.Launch`, which binds kernel arguments by name
* :mod:`mx_roi.cuda.nvrtc`   -- NVRTC through ctypes (compile check without a GPU)
"""
