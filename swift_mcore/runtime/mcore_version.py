"""The megatron-core versions swift-mcore's adaptations of it were tested with, and the one
check that refuses any other (unless SWIFT_MCORE_ALLOW_UNTESTED_MCORE=1)."""

from __future__ import annotations

import os

TESTED_MCORE_VERSIONS = ("0.16.1",)


def require_tested_version(adaptation: str, advice: str) -> str:
    """The installed megatron-core version; raises RuntimeError naming ``adaptation`` (what
    was tested) and ``advice`` (what else to do) when it is not one of the tested ones."""
    from megatron.core import package_info

    version = package_info.__version__
    if version not in TESTED_MCORE_VERSIONS and os.environ.get(
            "SWIFT_MCORE_ALLOW_UNTESTED_MCORE") != "1":
        raise RuntimeError(
            f"swift-mcore's {adaptation} was tested with megatron-core "
            f"{', '.join(TESTED_MCORE_VERSIONS)}, but {version} is installed. Install "
            f"megatron-core=={TESTED_MCORE_VERSIONS[-1]} (requirements/base.txt), {advice}")
    return version
