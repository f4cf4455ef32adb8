"""What swift-mcore's adaptations of megatron-core share: the versions they were tested with
(one check refuses any other unless SWIFT_MCORE_ALLOW_UNTESTED_MCORE=1), and the module
look-alike a patched megatron module gets in place of torch or numpy."""

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


class ModuleProxy:
    """A look-alike of ``MODULE`` for a patched megatron module: the names a subclass
    defines replace the module's; every other name is the module's own."""

    MODULE = None

    def __getattr__(self, name):
        value = getattr(self.MODULE, name)
        setattr(self, name, value)  # later lookups are plain attribute reads
        return value
