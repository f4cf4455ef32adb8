"""Input files built as an attacker would: a FIFO named like a data file, a JSON row nested
100,000 levels deep. Each is refused in one line naming the file (and line), exit code 2,
before any output is written. A command reading nested JSON runs in a subprocess with a
timeout, so a hang or a crash of the parser fails the test instead of stalling or killing
pytest; one reading a FIFO runs in this process under a deadline (tests/bounded.py)."""

import os
import sys
from pathlib import Path

import pytest

from swift_mcore import input_files
from swift_mcore.errors import ArgumentError

from bounded import cli
from run_helpers import run_or_kill

ROOT = Path(__file__).resolve().parents[2]
DEEP = 100_000


def swift(*argv, timeout=120):
    """The CLI in its own process group; on timeout the group is killed and the test fails
    (a regression that blocks on a FIFO must not hang pytest)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    argv = [sys.executable, "-m", "swift_mcore", *map(str, argv)]
    proc = run_or_kill(argv, timeout, env=env, cwd=ROOT)
    if proc is None:
        pytest.fail(f"swift-mcore {argv[3]} still ran after {timeout} s (blocked on a FIFO?)")
    return proc


def error_line(proc):
    """The one line the CLI printed: exit code 2, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return lines[-1]


def refused(*argv):
    """The line the CLI (in this process, under a deadline) ended on: exit code 2."""
    code, lines = cli(*argv)
    assert code == 2, (code, lines)
    assert not any("Traceback" in line for line in lines), lines
    return lines[-1]


def deep_row(path, extra_key="text"):
    with open(path, "w") as fh:
        fh.write('{"text": "a fine first row"}\n')
        fh.write('{"%s": %s%s}\n' % (extra_key, "[" * DEEP, "]" * DEEP))
    return path


def test_preprocess_refuses_a_row_nested_100000_deep(tmp_path):
    data = deep_row(tmp_path / "deep.jsonl")
    out = tmp_path / "out" / "x"
    line = error_line(swift("preprocess", "--input", data, "--output_prefix", out,
                            "--workers", "1", "--progress_bar", "false"))
    assert line == (f"swift-mcore preprocess: error: --input {data}: line 2 is JSON nested "
                    f"{DEEP + 1} levels deep; at most {input_files.MAX_JSON_DEPTH} are read")
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_sft_refuses_a_conversation_row_nested_100000_deep(tmp_path):
    data = tmp_path / "chat.jsonl"
    with open(data, "w") as fh:
        fh.write('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
                 '"content": "hello"}], "meta": %s%s}\n' % ("[" * DEEP, "]" * DEEP))
    out = tmp_path / "run"
    line = error_line(swift("sft", "--dataset", data, "--output_dir", out, "--train_iters",
                            "1", "--num_layers", "1", "--hidden_size", "32",
                            "--num_attention_heads", "2", "--num_query_groups", "1",
                            "--seq_length", "32"))
    assert line.endswith(f"--dataset {data}: line 1 is JSON nested {DEEP + 1} levels deep; at "
                         f"most {input_files.MAX_JSON_DEPTH} are read"), line
    assert not (out / "checkpoint").exists()


def test_a_fifo_named_like_a_data_file_is_refused_without_blocking(tmp_path, gloo_group):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    out = tmp_path / "out" / "x"
    line = refused("preprocess", "--input", fifo, "--output_prefix", out, "--workers", "1")
    assert line == (f"swift-mcore preprocess: error: --input {fifo}: is a FIFO (named pipe), "
                    f"not a regular file; swift-mcore reads input only from regular files")


# ---- the module itself -------------------------------------------------------------------

def test_a_deadline_keeps_the_tests_outer_alarm():
    """tests/bounded.deadline inside a test run under pytest-timeout's signal method (an
    ITIMER_REAL alarm of its own) leaves that alarm pending and its handler in place after
    the block, so the rest of the test stays under it."""
    import signal

    from bounded import deadline

    def outer(signum, frame):
        pytest.fail("the outer alarm fired")

    previous = signal.signal(signal.SIGALRM, outer)
    signal.setitimer(signal.ITIMER_REAL, 600)
    try:
        with deadline(300, "nothing"):
            pass
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
        assert signal.getsignal(signal.SIGALRM) is outer
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_json_depth_ignores_brackets_inside_strings():
    assert input_files.json_depth('{"a": "[[[[[[", "b": [[1]]}') == 3
    assert input_files.json_depth(r'["\"[[[", {"x": []}]') == 3
    text = '{"s": "%s"}' % ("[" * 5000)
    input_files.check_json_depth(text, "row")  # 5000 brackets, all inside a string
    with pytest.raises(ArgumentError, match="row: JSON nested 600 levels deep"):
        input_files.check_json_depth("[" * 600 + "]" * 600, "row")


def test_loads_is_bounded_and_names_where():
    with pytest.raises(ArgumentError, match=r"^f, row 3: JSON nested 100000 levels deep"):
        input_files.loads("[" * DEEP + "]" * DEEP, "f, row 3")
    with pytest.raises(ArgumentError, match=r"^f, row 3: is not valid JSON"):
        input_files.loads("{nope", "f, row 3")


def test_open_regular_refuses_fifo_and_device_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ArgumentError, match="is a FIFO"):
        input_files.open_regular(str(fifo))  # would block forever with a plain open()
    with pytest.raises(ArgumentError, match="is a character device"):
        input_files.open_regular("/dev/zero")
    with pytest.raises(ArgumentError, match="is a folder"):
        input_files.open_regular(str(tmp_path))
    (tmp_path / "ok.txt").write_text("fine")
    with input_files.open_regular(str(tmp_path / "ok.txt"), "r") as fh:
        assert fh.read() == "fine"


def test_inside_refuses_names_that_leave_the_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "sub").mkdir()
    assert input_files.inside(str(folder), "sub/a.bin", "idx") == str(folder / "sub/a.bin")
    assert input_files.inside(str(folder), "sub/../a.bin", "idx") == str(folder / "a.bin")
    for name in ("../../../../etc/passwd", "/etc/passwd", "sub/../../x", "~/x", "..", "",
                 None, 3):
        with pytest.raises(ArgumentError, match=r"^idx: "):
            input_files.inside(str(folder), name, "idx")


def test_a_fifo_among_the_tokenizer_files_is_refused_without_blocking(tmp_path, gloo_group):
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import hf_helpers

    folder = tmp_path / "tok"
    hf_helpers.write_tokenizer(str(folder))
    config = folder / "tokenizer_config.json"
    os.remove(config)
    os.mkfifo(config)
    data = tmp_path / "a.jsonl"
    data.write_text('{"text": "hello"}\n')
    line = refused("preprocess", "--input", data, "--output_prefix", tmp_path / "x",
                   "--tokenizer", folder, "--workers", "1")
    assert line == (f"swift-mcore preprocess: error: --tokenizer {config}: is a FIFO (named "
                    f"pipe), not a regular file; swift-mcore reads input only from regular "
                    f"files")
    assert not (tmp_path / "x.bin").exists()


def test_a_fifo_named_like_megatron_data_or_a_yaml_config_is_refused(tmp_path, gloo_group):
    prefix = tmp_path / "tokens"
    os.mkfifo(f"{prefix}.idx")
    (tmp_path / "tokens.bin").write_bytes(b"")
    config = tmp_path / "run.yaml"
    os.mkfifo(config)
    line = refused("pt", "--data_path", prefix, "--output_dir", tmp_path / "a")
    assert line == (f"swift-mcore pt: error: --data_path: {prefix}.idx: is a FIFO (named "
                    f"pipe), not a regular file; swift-mcore reads input only from regular "
                    f"files")
    line = refused("pt", config, "--output_dir", tmp_path / "b")
    assert line == (f"swift-mcore pt: error: config file {config} is not a regular file; "
                    f"give a YAML file of flags")


def test_a_yaml_config_nested_100000_deep_is_one_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("lr: " + "[" * 100_000 + "]" * 100_000 + "\n")
    line = error_line(swift("pt", config, "--output_dir", tmp_path / "b"))
    assert line == (f"swift-mcore pt: error: config file {config} nests too deeply to be a "
                    f"file of flags")


# ---- a saved datasets folder (save_to_disk) -----------------------------------------------

def saved_dataset(folder):
    import datasets

    datasets.Dataset.from_dict({"text": ["first row", "second row"]}).save_to_disk(
        str(folder))
    return folder


@pytest.mark.parametrize("name", ["state.json", "dataset_info.json",
                                  "data-00000-of-00001.arrow"])
def test_a_fifo_in_a_saved_datasets_folder_is_refused(tmp_path, name, gloo_group):
    folder = saved_dataset(tmp_path / "saved")
    os.remove(folder / name)
    os.mkfifo(folder / name)
    line = refused("preprocess", "--input", folder, "--output_prefix", tmp_path / "out" / "x",
                   "--workers", "1")
    assert line == (f"swift-mcore preprocess: error: --input {folder}: {name} is a FIFO "
                    f"(named pipe), not a regular file; swift-mcore reads input only from "
                    f"regular files")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, message", [
    (lambda text: text.replace('"data-00000-of-00001.arrow"', '"../../../../etc/passwd"'),
     "names '../../../../etc/passwd', a path outside its folder"),
    (lambda text: text[:-1] + ', "deep": ' + "[" * DEEP + "]" * DEEP + "}",
     f"JSON nested {DEEP + 1} levels deep; at most 512 are read"),
])
def test_a_saved_datasets_state_json_is_bounded_and_kept_inside(tmp_path, change, message):
    from swift_mcore.data import sources

    folder = saved_dataset(tmp_path / "saved")
    state = folder / "state.json"
    state.write_text(change(state.read_text().strip()))
    with pytest.raises(ArgumentError) as err:
        sources.expand_inputs([str(folder)], "--input")
    assert str(err.value).startswith(f"--input {folder / 'state.json'}: "), str(err.value)
    assert message in str(err.value)


# ---- export --to_hf: the source folder's generation_config.json --------------------------

def test_a_fifo_as_generation_config_is_refused_before_export_writes(tmp_path, gloo_group):
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import hf_helpers

    folder = tmp_path / "hf"
    hf_helpers.make_family(str(folder), "llama")
    converted = tmp_path / "mcore"
    hf_helpers.convert(folder, converted, "to_mcore")
    generation = folder / "generation_config.json"
    if generation.exists():
        os.remove(generation)
    os.mkfifo(generation)
    out = tmp_path / "exported"
    tokenizer = tmp_path / "tok"  # a folder of its own: the model folder is read as the base
    hf_helpers.write_tokenizer(str(tokenizer))
    line = refused("export", "--to_hf", "--model", converted, "--tokenizer", tokenizer,
                   "--output_dir", out)
    assert line == (f"swift-mcore export: error: {generation}: is a FIFO (named pipe), not a "
                    f"regular file; swift-mcore reads input only from regular files")
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
