"""One gloo transport device for every gloo process group of this process (the CPU path).

torch gives each ``ProcessGroupGloo`` a device of its own, and each device runs a thread
(``gloo_tcp_loop``) that wakes about a hundred times a second. megatron-core makes about
twenty groups even on one rank, so a CPU run carried twenty such threads and their
wake-ups. Each one preempts a compute thread, and the others then wait for it at the next
barrier (what that costs a micro-step: benchmarks/README.md). gloo lets process groups share a device (the options of
``ProcessGroupGloo`` take the device list), and ``install`` makes every group created
afterwards use one. Checked against torch 2.13. With another torch, or without the options
API, torch's own class stays in place.
"""

from __future__ import annotations

import torch

TESTED_TORCH = ("2.13",)

_installed = False


def install() -> bool:
    """Swap torch's ``ProcessGroupGloo`` for one that shares a device; True when in place.
    Call it before the first process group is created."""
    global _installed
    if _installed:
        return True
    if not torch.__version__.startswith(TESTED_TORCH):
        return False
    import torch.distributed.distributed_c10d as c10d

    base = getattr(c10d, "ProcessGroupGloo", None)
    if base is None or not hasattr(getattr(base, "_Options", None), "_devices"):
        return False

    class SharedDeviceGloo(base):
        device = None

        def __init__(self, store, rank, size, timeout=c10d.default_pg_timeout):
            if SharedDeviceGloo.device is None:
                SharedDeviceGloo.device = base.create_default_device()
            options = base._Options()
            options._devices = [SharedDeviceGloo.device]
            options._timeout = timeout
            options._threads = 2  # what torch gives a group with its one device
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo
    _installed = True
    return True


def installed() -> bool:
    return _installed
