"""What the Mosaic GPU kernels of this folder share: the Pallas Mosaic GPU module (imported on first use, so that
every module here imports on any platform) and the device's SM count."""
from __future__ import annotations

import jax


def plgpu():
    """The Pallas Mosaic GPU module (``jax.experimental.pallas.mosaic_gpu``), imported on first use."""
    import jax.experimental.pallas.mosaic_gpu as module
    return module


def num_sms() -> int:
    """The default device's SM count (its ``core_count``); 132 (an H200's) where the device reports none or there
    is no device (the CPU tests size their grids as on the H200)."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0) or 0) or 132
    except RuntimeError:
        return 132
