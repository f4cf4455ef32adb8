"""pt --streaming: raw text read lazily, tokenized and cut into rows as the cached path cuts them; continued from any saved position it equals the straight stream; runs resume exactly (also DP 2 -> 1); bad input refused in one line."""

import json
import random
import subprocess
import sys

import pytest

from run_helpers import ROOT, TINY, child_env, losses, run_pt

WORDS = ("alpha beta gamma delta river stone cloud paper orange silver seven north winter "
         "garden quiet simple").split()


def texts(n=30, seed=7):
    """``n`` texts of very different lengths; two of them empty (skipped, as pt's cached
    path skips them)."""
    rng = random.Random(seed)
    out = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(n)]
    for i in (4, 17):
        if i < n:
            out[i] = ""
    return out


def write_jsonl(path, values):
    with open(path, "w") as fh:
        for i, text in enumerate(values):
            fh.write(json.dumps({"id": i, "text": text}) + "\n")
            if i % 9 == 0:
                fh.write("\n")  # blank lines are not rows
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same 30 texts as two jsonl files (20 + 10), a parquet file of small row groups
    and a saved datasets folder."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = tmp_path_factory.mktemp("pt_stream_files")
    data = texts()
    a = write_jsonl(base / "a.jsonl", data[:20])
    b = write_jsonl(base / "b.jsonl", data[20:])
    rows = [{"id": i, "text": t} for i, t in enumerate(data)]
    pq.write_table(pa.Table.from_pylist(rows), base / "c.parquet", row_group_size=7)
    datasets.Dataset.from_list(rows).save_to_disk(str(base / "saved"))
    return {"jsonl": [a, b], "parquet": [base / "c.parquet"], "saved": [base / "saved"]}


def stream(paths, tokenizer, state=None, buffer=5, seq=24):
    from swift_mcore.data.sources import expand_inputs
    from swift_mcore.data.text_stream import TextStream

    sources = expand_inputs([str(p) for p in paths], "--dataset")
    return TextStream(sources, "text", tokenizer, seq, buffer, seed=5, state=state)


def test_the_rows_are_the_documents_cut_as_the_cached_path_cuts_them(files, tokenizer):
    """With a buffer of one row (the files' order) the stream is the texts tokenized, an
    end-of-document token after each, empty texts skipped, laid end to end and cut into
    seq + 1 token rows each starting at the previous row's last token (GPTDataset's cut)."""
    seq = 24
    flat = []
    for ids in tokenizer.encode_batch([t for t in texts() if t]):
        flat += list(ids) + [tokenizer.eod]
    flat += flat  # the second pass follows on
    expected = [flat[i * seq:i * seq + seq + 1] for i in range((len(flat) - 1) // seq)]
    s = stream(files["jsonl"], tokenizer, buffer=1, seq=seq)
    assert [s.next_item().tolist() for _ in range(len(expected))] == expected


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved"])
def test_a_text_stream_continued_from_any_position_equals_the_straight_stream(
        files, tokenizer, kind):
    """At each of the first 30 positions (into the second pass over the files), the stream
    rebuilt from ``state()`` (through JSON, as a checkpoint stores it) yields the rows the
    straight stream yields next: no token replayed, none skipped."""
    straight = stream(files[kind], tokenizer)
    expected = [straight.next_item().tolist() for _ in range(40)]
    assert straight.epoch >= 1
    s = stream(files[kind], tokenizer)
    for position in range(30):
        state = json.loads(json.dumps(s.state()))
        resumed = stream(files[kind], tokenizer, state=state)
        assert [resumed.next_item().tolist() for _ in range(10)] == \
            expected[position:position + 10], position
        s.next_item()


def test_rows_tokenized_several_per_call_are_those_tokenized_one_by_one(files, tokenizer,
                                                                         monkeypatch):
    from swift_mcore.data import text_stream

    def items(count):
        monkeypatch.setattr(text_stream, "ENCODE_ROWS", count)
        s = stream(files["jsonl"], tokenizer)
        return [s.next_item().tolist() for _ in range(40)]

    assert text_stream.ENCODE_ROWS > 1
    assert items(text_stream.ENCODE_ROWS) == items(1)


def test_the_order_is_the_same_for_every_file_kind(files, tokenizer):
    def rows(kind):
        s = stream(files[kind], tokenizer)
        return [s.next_item().tolist() for _ in range(12)]

    assert rows("jsonl") == rows("parquet") == rows("saved")


def _three_rows_in(tmp_path, tokenizer):
    """(the texts, their jsonl file, the position of a stream (buffer 4) after three rows,
    as a checkpoint's JSON holds it)."""
    data = texts()
    path = write_jsonl(tmp_path / "a.jsonl", data)
    s = stream([path], tokenizer, buffer=4)
    for _ in range(3):
        s.next_item()
    return data, path, json.loads(json.dumps(s.state()))


def test_a_changed_held_row_is_refused(tmp_path, tokenizer):
    from swift_mcore.errors import CheckpointError

    data, path, state = _three_rows_in(tmp_path, tokenizer)
    _file, row, _ = state["carry"][-1]
    data[row] = data[row][::-1]  # same length, the text reversed
    write_jsonl(path, data)
    with pytest.raises(CheckpointError, match="the data changed since the checkpoint"):
        stream([path], tokenizer, state=state, buffer=4)


@pytest.mark.parametrize("cut", ["end", "middle"])
def test_a_file_cut_before_a_held_row_is_refused_naming_it(tmp_path, tokenizer, cut):
    """Resumed (--override_resume_check lifts the size check) on a file cut or shifted
    since, a held row's saved offset starts no row: named as a changed file, not as a bad
    JSON row of the data."""
    from swift_mcore.errors import CheckpointError

    data, path, state = _three_rows_in(tmp_path, tokenizer)
    _file, row, offset = state["buffer"][0]
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:row]) if cut == "end" else b"xx" + b"".join(lines))
    detail = "the file ends before it" if cut == "end" else "is not valid JSON"
    with pytest.raises(CheckpointError) as err:
        stream([path], tokenizer, state=state, buffer=4)
    assert str(err.value).startswith(
        f"the stream position names --dataset {path}, row {row} at byte {offset}, which is "
        f"not a row now ({detail}"), err.value
    assert str(err.value).endswith("the data changed since the checkpoint; resume on the "
                                   "same files")


def test_a_row_without_text_is_named(tmp_path, tokenizer):
    from swift_mcore.errors import ArgumentError

    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(10)[:6]) +
                    json.dumps({"text": 5}) + "\n")
    s = stream([path], tokenizer, buffer=1)
    with pytest.raises(ArgumentError, match=r"a\.jsonl, row 6: column 'text' holds a int "
                                            r"value, not text"):
        for _ in range(40):
            s.next_item()


# ---- runs ---------------------------------------------------------------------------------

DATA = ("--seq_length", "24", "--streaming", "--shuffle_buffer_size", "5", "--train_iters",
        "6", "--log_sample_ids", "--global_batch_size", "4", "--micro_batch_size", "2",
        "--num_workers", "1")


def pt(out, paths, *flags, **kwargs):
    return run_pt(out, "--dataset", *map(str, paths), *DATA, *flags, **kwargs)


def sample_ids(out):
    return [json.loads(line) for line in (out / "sample_ids.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def pt_here(gloo_group):
    from in_process import train_in_process

    return lambda out, *flags: train_in_process(out, *flags, command="pt")


def test_a_stopped_text_stream_resumes_bit_exact(tmp_path, files, pt_here):
    """Stopped at iteration 3 (--exit_interval) and resumed in a new process, the stream
    trains the straight run's rows: the same sample ids per iteration, the same losses bit
    for bit (with dropout)."""
    flags = ["--hidden_dropout", "0.1"]
    whole = tmp_path / "whole"
    pt_here(whole, "--dataset", *map(str, files["jsonl"]), *DATA, *flags, "--num_workers", "0")
    split = tmp_path / "split"
    pt(split, files["jsonl"], *flags, "--exit_interval", "3")
    assert sorted(losses(split)) == [1, 2, 3]
    proc = pt(split, files["jsonl"], *flags, "--resume")
    assert "starting at iteration 3" in proc.stdout
    assert losses(split) == losses(whole)
    assert sample_ids(split) == sample_ids(whole)


@pytest.mark.slow
def test_a_text_stream_resumes_on_another_data_parallel_size(tmp_path, files, pt_here):
    """DP 2 stopped at iteration 3 resumes on DP 1 with the straight DP-1 run's rows (no id
    twice, none missing) and its losses within 1e-5 (the gradient sum's order differs)."""
    flags = ["--micro_batch_size", "1"]
    # in this process without a loader worker: the stream is the same for any worker count
    pt_here(tmp_path / "dp1", "--dataset", *map(str, files["jsonl"]), *DATA, *flags,
            "--num_workers", "0")
    split = tmp_path / "split"
    pt(split, files["jsonl"], *flags, "--exit_interval", "3", nproc=2)
    assert sample_ids(split) == sample_ids(tmp_path / "dp1")[:3]
    pt(split, files["jsonl"], *flags, "--resume")
    ids = sample_ids(split)
    assert ids == sample_ids(tmp_path / "dp1")
    assert [i for record in ids for i in record["sample_ids"]] == list(range(24))
    whole = losses(tmp_path / "dp1")
    assert sorted(losses(split)) == sorted(whole)
    assert all(abs(losses(split)[i] - whole[i]) <= 1e-5 for i in whole)


@pytest.mark.slow
def test_a_killed_text_stream_resumes_exactly(tmp_path, files, pt_here):
    """SIGKILL mid-run (a checkpoint every iteration), resumed: every iteration trains the
    straight run's rows with its losses bit for bit."""
    import os
    import signal
    import time

    flags = ["--train_iters", "10", "--save_steps", "1"]
    whole = tmp_path / "whole"
    pt_here(whole, "--dataset", *map(str, files["jsonl"]), *DATA, *flags, "--num_workers", "0")
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "swift_mcore", "pt", *TINY, "--output_dir", str(out),
            "--dataset", *map(str, files["jsonl"]), *DATA, *flags]
    proc = subprocess.Popen(argv, env=child_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and len(losses(out)) >= 4):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(240)
    pt(out, files["jsonl"], *flags, "--resume", "auto")
    last = {r["iteration"]: r["sample_ids"] for r in sample_ids(out)}
    assert last == {r["iteration"]: r["sample_ids"] for r in sample_ids(whole)}
    assert losses(out) == losses(whole)


def run_cli(tmp_path, command, *flags):
    cmd = [sys.executable, "-m", "swift_mcore", command, *TINY, "--output_dir",
           str(tmp_path / "out"), *map(str, flags)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=child_env(),
                          cwd=ROOT)


@pytest.mark.parametrize("flags,message", [
    (["--train_iters", "2"], "--streaming reads raw text files: give them with --dataset"),
    (["--dataset", "FILE"], "--streaming needs --train_iters: a stream has no length"),
    (["--dataset", "FILE", "--train_iters", "2", "--split", "90,10,0"],
     "--split cuts a dataset read whole; a --streaming run trains on every row"),
    (["--dataset", "FILE", "--train_iters", "2", "--num_workers", "2"],
     "--streaming reads the stream in one loader worker per rank"),
    # it told to raise --split's validation share, which a stream refuses
    (["--dataset", "FILE", "--train_iters", "2", "--eval_steps", "1", "--metric_for_best",
      "val_loss"], "--metric_for_best val_loss needs validation data: a pt --streaming run "
     "has no validation data (every row streamed trains, and --split is refused)"),
])
def test_pt_streaming_flags_refused(tmp_path, files, flags, message):
    from swift_mcore.arguments import RunArguments, parse_args
    from swift_mcore.errors import ArgumentError
    from swift_mcore.run_config import resolve

    argv = [*TINY, "--output_dir", str(tmp_path / "out"), "--streaming",
            *(str(files["jsonl"][0]) if f == "FILE" else f for f in flags)]
    with pytest.raises(ArgumentError) as err:
        resolve(parse_args(argv, prog="swift-mcore pt", cls=RunArguments), world_size=1)
    assert message in str(err.value)


def test_a_missing_text_column_stops_the_run_in_one_line(tmp_path, files):
    """Checked on each file's first row before the model is built: exit 2, one line, no
    checkpoint."""
    proc = run_cli(tmp_path, "pt", "--streaming", "--dataset", files["jsonl"][0],
                   "--train_iters", "2", "--text_key", "body")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"swift-mcore pt: error: --dataset {files['jsonl'][0]}, row 0: no 'body' "
                     f"column (it has 'id', 'text'); choose the text column with --text_key"]
    assert not (tmp_path / "out" / "checkpoint").exists()


def test_rlhf_refuses_streaming(tmp_path):
    from swift_mcore.arguments import RlhfArguments
    from swift_mcore.errors import ArgumentError

    args = RlhfArguments.from_flags(dataset=["x.jsonl"], streaming=True, train_iters=2)
    with pytest.raises(ArgumentError, match="--streaming reads pt and sft data; `swift-mcore "
                                            "rlhf` reads its rows whole"):
        args.fill_defaults()
        args.check(1)
