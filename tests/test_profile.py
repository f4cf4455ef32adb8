"""--profile: torch's profiler trace of the chosen iterations and ranks under
output_dir/profile, readable as Chrome trace JSON (TensorBoard, Perfetto); the flag
checks, and --record_memory_history refused on CPU."""

import json
import os

import pytest

from swift_mcore.arguments import RunArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve

SMALL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, micro_batch_size=1,
             global_batch_size=2)


def test_profile_writes_a_trace_of_the_window(tmp_path, gloo_group):
    from in_process import train_in_process

    out = tmp_path / "run"
    proc = train_in_process(out, "--train_iters", "3", "--no_save", "--profile",
                            "--profile_step_start", "2", "--profile_step_end", "2",
                            command="pt")
    trace = out / "profile" / "rank_0.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    # megatron's forward ran inside the window: its linears' GEMMs are in the trace
    assert any("linear" in n or "addmm" in n or "mm" == n.split("::")[-1] for n in names)
    assert [p.name for p in (out / "profile").iterdir()] == ["rank_0.pt.trace.json"]
    assert "profile of iterations 2-2 (rank 0)" in proc.stdout


def test_a_window_that_training_ends_inside_is_still_written(tmp_path, gloo_group):
    from in_process import train_in_process

    out = tmp_path / "run"
    train_in_process(out, "--train_iters", "2", "--no_save", "--profile",
                     "--profile_step_start", "2", "--profile_step_end", "9", command="pt")
    assert (out / "profile" / "rank_0.pt.trace.json").stat().st_size > 0


@pytest.mark.parametrize("flags,world,message", [
    ({"profile_step_start": 3}, 1, "--profile_step_start needs --profile"),
    ({"record_memory_history": True}, 1, "--record_memory_history needs --profile"),
    ({"profile": True, "profile_step_start": 0}, 1, "--profile_step_start must be a positive"),
    ({"profile": True, "profile_step_start": 5, "profile_step_end": 4}, 1,
     "--profile_step_end \\(4\\) must not be below --profile_step_start \\(5\\)"),
    ({"profile": True, "profile_ranks": [0, 2]}, 2, "--profile_ranks \\[2\\]: ranks are 0 to 1"),
    ({"profile": True, "record_memory_history": True}, 1,
     "--record_memory_history records CUDA allocations: it needs a CUDA GPU"),
])
def test_profile_flags_are_checked(flags, world, message):
    with pytest.raises(ArgumentError, match=message):
        resolve(RunArguments.from_flags(**SMALL, **flags), world_size=world, cuda=False)
    assert resolve(RunArguments.from_flags(**SMALL, profile=True, record_memory_history=True),
                   world_size=1, cuda=True, transformer_engine=False).logging.profile


def test_a_link_planted_as_the_profile_folder_is_refused_before_training(tmp_path, gloo_group):
    """output_dir/profile -> a folder of the user: refused with one line before the first
    iteration; nothing is written into the folder the link points at."""
    from in_process import train_in_process

    from swift_mcore.errors import OutputError

    out, elsewhere = tmp_path / "run", tmp_path / "home"
    out.mkdir()
    elsewhere.mkdir()
    (out / "profile").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(OutputError, match="--profile: .*profile is not a folder") as err:
        train_in_process(out, "--train_iters", "2", "--no_save", "--profile",
                         "--profile_step_start", "2", "--profile_step_end", "2", command="pt")
    assert "\n" not in str(err.value)
    assert list(elsewhere.iterdir()) == []
    metrics = out / "metrics.jsonl"
    assert not metrics.exists() or '"split": "train"' not in metrics.read_text()


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_link_planted_as_the_trace_is_replaced_never_followed(tmp_path, gloo_group, kind):
    from in_process import train_in_process

    victim = tmp_path / "home" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text("the user's file\n")
    trace = tmp_path / "run" / "profile" / "rank_0.pt.trace.json"
    trace.parent.mkdir(parents=True)
    (os.symlink if kind == "symlink" else os.link)(victim, trace)
    train_in_process(tmp_path / "run", "--train_iters", "1", "--no_save", "--profile",
                     "--profile_step_start", "1", "--profile_step_end", "1", command="pt")
    assert victim.read_text() == "the user's file\n" and victim.stat().st_nlink == 1
    assert not trace.is_symlink() and json.loads(trace.read_text())["traceEvents"]
