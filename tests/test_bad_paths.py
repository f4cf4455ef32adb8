"""A path of the wrong kind (a folder where a file goes, a file where a folder goes or
above it) is refused by the command line before any work: exit code 2, one line on stderr
naming the flag (or the config file), no traceback, nothing written."""

import os
import subprocess
import sys

import pytest

from run_helpers import ROOT, TINY

CORPUS = '{"text": "alpha beta gamma delta"}\n' * 8


@pytest.fixture
def paths(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "corpus.jsonl").write_text(CORPUS)
    (tmp_path / "out_with_file").mkdir()
    (tmp_path / "out_with_file" / "checkpoint").write_text("in the way")
    (tmp_path / "prefix.bin").mkdir()  # PREFIX.bin is a folder
    (tmp_path / "prefix.bin" / "keep").write_text("mine")
    return tmp_path


def cases(p):
    f, d = p / "a_file", p / "a_folder"
    train = [*TINY, "--train_iters", "2"]
    return {
        "yaml_is_a_folder": (["pt", d, *train], "pt",
                             [f"config file {d} is a folder"]),
        # a second folder after a one-value flag lands in the config file's place
        "sft_two_cached_dataset_folders": (
            ["sft", *train, "--output_dir", p / "o", "--cached_dataset", d, p / "prefix.bin"],
            "sft", [f"--cached_dataset takes one value ({d}); the next word, "
                    f"{p / 'prefix.bin'}, was read as a config file", "is a folder"]),
        "pt_output_dir_is_a_file": (["pt", *train, "--output_dir", f], "pt",
                                    [f"--output_dir {f} is a file"]),
        "pt_output_dir_under_a_file": (["pt", *train, "--output_dir", f / "run"], "pt",
                                       [f"--output_dir {f / 'run'}", f"{f} is a file"]),
        "pt_checkpoint_folder_is_a_file": (
            ["pt", *train, "--output_dir", p / "out_with_file"], "pt",
            [f"{p / 'out_with_file' / 'checkpoint'} is a file"]),
        "pt_data_cache_path_is_a_file": (
            ["pt", *train, "--output_dir", p / "o", "--data_cache_path", f], "pt",
            [f"--data_cache_path {f} is a file"]),
        "pt_data_path_bin_is_a_folder": (
            ["pt", *train, "--output_dir", p / "o", "--data_path", p / "prefix"], "pt",
            [f"--data_path: {p / 'prefix.bin'} is a folder"]),
        "sft_output_dir_is_a_file": (
            ["sft", *train, "--dataset", p / "corpus.jsonl", "--output_dir", f], "sft",
            [f"--output_dir {f} is a file"]),
        "preprocess_prefix_bin_is_a_folder": (
            ["preprocess", "--input", p / "corpus.jsonl", "--output_prefix", p / "prefix",
             "--workers", "1"], "preprocess",
            ["--output_prefix", f"{p / 'prefix.bin'} is a folder"]),
        "preprocess_prefix_under_a_file": (
            ["preprocess", "--input", p / "corpus.jsonl", "--output_prefix", f / "data",
             "--workers", "1"], "preprocess",
            ["--output_prefix", f"{f} is a file"]),
        "export_output_dir_is_a_file": (
            ["export", "--to_hf", "--model", d, "--output_dir", f], "export",
            [f"--output_dir {f} is a file"]),
        "export_output_dir_under_a_file": (
            ["export", "--to_hf", "--model", d, "--output_dir", f / "hf"], "export",
            [f"--output_dir {f / 'hf'}", f"{f} is a file"]),
    }


NAMES = sorted(cases(ROOT))


@pytest.mark.parametrize("name", NAMES)
def test_path_of_the_wrong_kind_is_refused_before_any_work(paths, name, capsys, monkeypatch):
    from swift_mcore import cli
    from swift_mcore.data import encoding

    def no_work(*args, **kwargs):
        raise AssertionError("the command started working")

    monkeypatch.setattr(encoding, "encode_sources", no_work)
    monkeypatch.setattr("swift_mcore.training.trainer.Trainer.setup", no_work)
    argv, command, parts = cases(paths)[name]
    before = sorted(str(p.relative_to(paths)) for p in paths.rglob("*"))
    capsys.readouterr()
    assert cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"swift-mcore {command}: error: "), err
    for part in parts:
        assert str(part) in lines[0], lines[0]
    assert sorted(str(p.relative_to(paths)) for p in paths.rglob("*")) == before


def test_preprocess_prefix_bin_folder_stops_a_real_process_before_tokenizing(paths):
    """The folder used to be found when the finished .bin was renamed onto it, after every
    document was tokenized, as an IsADirectoryError traceback."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "swift_mcore", "preprocess", "--input",
         str(paths / "corpus.jsonl"), "--output_prefix", str(paths / "prefix")],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"swift-mcore preprocess: error: --output_prefix: {paths / 'prefix.bin'} is a folder, "
        f"but it is a file this command writes; move it away or choose another "
        f"--output_prefix"], proc.stderr
    assert "tokenizing" not in proc.stderr and proc.stdout == ""
    assert os.listdir(paths / "prefix.bin") == ["keep"]
    assert not list(paths.glob("prefix.tmp-*"))


@pytest.mark.parametrize("port", ["held", "29500x"])
def test_a_busy_or_bad_master_port_is_one_line(tmp_path, port):
    """A one-process command whose MASTER_PORT another process holds, or that is not a port
    number: one line naming MASTER_PORT, exit code 2 (it was torch's DistNetworkError or
    ValueError traceback), nothing trained."""
    import socket

    from run_helpers import child_env

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        value = str(held.getsockname()[1]) if port == "held" else port
        env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=value)
        proc = subprocess.run([sys.executable, "-m", "swift_mcore", "pt", *TINY,
                               "--train_iters", "2", "--output_dir", str(tmp_path / "run")],
                              capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    if port == "held":
        assert f"MASTER_ADDR:MASTER_PORT 127.0.0.1:{value}" in proc.stderr
        assert "set MASTER_PORT to a free port" in proc.stderr
    else:
        assert "MASTER_PORT='29500x': a port number (0 to 65535), or unset it" in proc.stderr
    assert not (tmp_path / "run" / "checkpoint").exists()
