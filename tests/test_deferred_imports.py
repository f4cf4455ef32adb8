"""Start-up: wandb, which megatron-core imports with itself, is only imported when used."""

import subprocess
import sys

import pytest

from run_helpers import ROOT, child_env
from swift_mcore import _deferred_imports


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package `deferred_probe` whose import is counted (in the module `builtins`)."""
    pkg = tmp_path / "deferred_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import builtins\nbuiltins.deferred_probe_runs = getattr(builtins, "
        "'deferred_probe_runs', 0) + 1\nVALUE = 42\n")
    (pkg / "sub.py").write_text("from deferred_probe import VALUE\nDOUBLE = 2 * VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_deferred_imports, "DEFERRED", ("deferred_probe", "not_installed_x"))
    import builtins

    monkeypatch.setattr(builtins, "deferred_probe_runs", 0, raising=False)
    yield builtins
    for name in ("deferred_probe", "deferred_probe.sub"):
        sys.modules.pop(name, None)


def test_a_deferred_package_is_imported_on_first_attribute(fake_package):
    import importlib.util
    import inspect

    _deferred_imports.defer_optional_imports()
    assert "not_installed_x" not in sys.modules  # a missing package stays missing
    import deferred_probe

    assert isinstance(deferred_probe, _deferred_imports.DeferredModule)
    # What torch's inspect.getmodule and find_spec ask of every module does not import it.
    assert inspect.getmodule(test_a_deferred_package_is_imported_on_first_attribute)
    assert deferred_probe.__file__.endswith("__init__.py")
    assert importlib.util.find_spec("deferred_probe").origin == deferred_probe.__file__
    assert fake_package.deferred_probe_runs == 0
    assert deferred_probe.VALUE == 42 and fake_package.deferred_probe_runs == 1
    real = sys.modules["deferred_probe"]
    assert not isinstance(real, _deferred_imports.DeferredModule)
    assert deferred_probe.VALUE == real.VALUE and fake_package.deferred_probe_runs == 1


def test_a_submodule_import_loads_the_package_first(fake_package):
    _deferred_imports.defer_optional_imports()
    from deferred_probe import sub

    assert sub.DOUBLE == 84 and fake_package.deferred_probe_runs == 1


def test_megatron_and_the_trainer_import_without_wandb_which_still_works():
    code = ("import sys; import swift_mcore.training.trainer, megatron.core.timers; "
            "import megatron.core.inference.contexts.dynamic_context as d; "
            "print(sorted(m for m in ('wandb.sdk', 'pydantic', 'click') if m in sys.modules)); "
            "import wandb; print(d.wandb.Settings.__name__, type(sys.modules['wandb']).__name__)")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                          text=True, timeout=240, cwd=ROOT, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["[]", "Settings module"], proc.stdout
