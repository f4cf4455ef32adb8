"""--streaming: the global stream continued from any saved position equals the straight stream, for jsonl, parquet and saved folders; runs resume exactly; bad input refused in one line."""

import json
import random
import subprocess
import sys

import pytest

from run_helpers import ROOT, TINY, child_env, losses, run_sft

WORDS = ("alpha beta gamma delta river stone cloud paper orange silver seven north winter "
         "garden quiet simple").split()


def rows(n=40, seed=3):
    """``n`` conversations of 1 to 3 turns and very different lengths."""
    rng = random.Random(seed)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    out = []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": text(1, 6)},
                         {"role": "assistant", "content": text(1, 8)}]
        out.append({"messages": messages})
    return out


def write_jsonl(path, data):
    with open(path, "w") as fh:
        for row in data:
            fh.write(json.dumps(row) + "\n")
            if len(row["messages"]) == 4:
                fh.write("\n")  # blank lines are not rows
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same 40 conversations as two jsonl files (25 + 15 rows), a parquet file of
    small row groups and a saved datasets folder."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = tmp_path_factory.mktemp("stream_files")
    data = rows()
    a, b = write_jsonl(base / "a.jsonl", data[:25]), write_jsonl(base / "b.jsonl", data[25:])
    pq.write_table(pa.Table.from_pylist(data), base / "c.parquet", row_group_size=7)
    datasets.Dataset.from_list(data).save_to_disk(str(base / "saved"))
    return {"jsonl": [a, b], "parquet": [base / "c.parquet"], "saved": [base / "saved"]}


@pytest.fixture(scope="module")
def template():
    from swift_mcore.data import default_tokenizer
    from swift_mcore.data.templates import Template

    return Template("plain", default_tokenizer())


def stream(paths, template, state=None, packing=True, buffer=6, seq=96):
    from swift_mcore.data.sources import expand_inputs
    from swift_mcore.data.streaming import Stream

    sources = expand_inputs([str(p) for p in paths], "--dataset")
    return Stream(sources, {}, template, "all_turns", seq, "drop", packing, buffer, seed=5,
                  state=state)


def key(item):
    return [(s.loc[:2], s.k, s.ids.tolist(), s.targets.tolist()) for s in item]


@pytest.mark.parametrize("kind,packing", [("jsonl", True), ("jsonl", False),
                                          ("parquet", True), ("saved", False)])
def test_a_stream_continued_from_any_position_equals_the_straight_stream(
        files, template, kind, packing):
    """At every position of the first 30 rows (over two epochs of the files), the stream
    rebuilt from ``state()`` (through JSON, as a checkpoint stores it) yields the very
    rows the straight stream yields next: none replayed, none skipped."""
    straight = stream(files[kind], template, packing=packing)
    expected = [key(straight.next_item()) for _ in range(45)]
    assert straight.epoch >= 1  # the files were read more than once
    s = stream(files[kind], template, packing=packing)
    for position in range(30):
        state = json.loads(json.dumps(s.state()))
        resumed = stream(files[kind], template, state=state, packing=packing)
        assert [key(resumed.next_item()) for _ in range(15)] == \
            expected[position:position + 15], position
        s.next_item()


@pytest.mark.parametrize("packing", [True, False])
def test_rows_encoded_several_per_call_are_those_encoded_one_by_one(files, template,
                                                                    monkeypatch, packing):
    """The stream tokenizes ENCODE_ROWS drawn rows per call: the training rows, their
    tokens and targets are those of drawing and encoding one row at a time."""
    from swift_mcore.data import streaming

    def items(count):
        monkeypatch.setattr(streaming, "ENCODE_ROWS", count)
        s = stream(files["jsonl"], template, packing=packing)
        return [key(s.next_item()) for _ in range(45)]

    assert streaming.ENCODE_ROWS > 1
    assert items(streaming.ENCODE_ROWS) == items(1)


def test_the_order_is_the_same_for_every_file_kind(files, template):
    """Locators differ (byte offsets in jsonl), the rows and their order do not."""
    def ids(kind):
        s = stream(files[kind], template)
        return [[x.ids.tolist() for x in s.next_item()] for _ in range(12)]

    assert ids("jsonl") == ids("parquet") == ids("saved")


def test_the_shuffle_buffer_shuffles_and_a_buffer_of_one_keeps_the_file_order(files,
                                                                               template):
    s = stream(files["jsonl"], template, packing=False, buffer=1, seq=512)
    order = [s.next_item()[0].loc[:2] for _ in range(40)]
    assert order == [(0, i) for i in range(25)] + [(1, i) for i in range(15)]
    s = stream(files["jsonl"], template, packing=False, buffer=8, seq=512)
    shuffled = [s.next_item()[0].loc[:2] for _ in range(40)]
    assert shuffled != order


@pytest.mark.parametrize("buffer", [42, 10 ** 9])
def test_a_buffer_larger_than_the_data_holds_each_row_once(files, template, buffer):
    """--shuffle_buffer_size above the data's 40 rows holds the whole data, each row once
    (filling it on would hold rows of the next epoch twice, and a huge buffer read the
    files without end); the stream continued from its position goes on exactly."""
    from swift_mcore.data.sources import expand_inputs
    from swift_mcore.data.streaming import ShuffledRows

    rows = ShuffledRows(expand_inputs([str(p) for p in files["jsonl"]], "--dataset"), buffer,
                        seed=5)
    drawn = rows.next_row()[0]
    held = [loc[:2] for loc, *_ in rows.buffer]
    # the row drawn left for the next epoch's first row
    every = {*((0, i) for i in range(25)), *((1, i) for i in range(15))}
    assert len(held) == 40 and set(held) == every - {drawn[:2]} | {(0, 0)}
    s = stream(files["jsonl"], template, packing=False, buffer=buffer, seq=512)
    order = [s.next_item()[0].loc[:2] for _ in range(80)]
    s = stream(files["jsonl"], template, packing=False, buffer=buffer, seq=512)
    for _ in range(7):
        s.next_item()
    resumed = stream(files["jsonl"], template, packing=False, buffer=buffer, seq=512,
                     state=json.loads(json.dumps(s.state())))
    assert [resumed.next_item()[0].loc[:2] for _ in range(73)] == order[7:]


def test_a_changed_row_held_by_the_stream_is_refused(tmp_path, template):
    """A resumed stream re-reads the rows it held; one that changed since is refused."""
    from swift_mcore.errors import CheckpointError

    data = rows(12)
    path = write_jsonl(tmp_path / "a.jsonl", data)
    s = stream([path], template, buffer=4)
    for _ in range(3):
        s.next_item()
    state = json.loads(json.dumps(s.state()))
    file, row, _ = state["buffer"][0]
    data[row]["messages"][1]["content"] = data[row]["messages"][1]["content"][::-1]
    write_jsonl(path, data)  # same lengths, the row's text reversed
    with pytest.raises(CheckpointError, match="the data changed since the checkpoint"):
        stream([path], template, state=state, buffer=4)


def test_a_row_that_does_not_encode_is_named(tmp_path, template):
    from swift_mcore.errors import ArgumentError

    data = rows(12)
    data[7] = {"messages": [{"role": "user", "content": "no answer"}]}
    path = write_jsonl(tmp_path / "a.jsonl", data)
    s = stream([path], template, buffer=2, packing=False)
    with pytest.raises(ArgumentError, match=r"a\.jsonl, row 7: "):
        for _ in range(20):
            s.next_item()


# ---- runs ---------------------------------------------------------------------------------

DATA = ("--seq_length", "96", "--template", "plain", "--streaming",
        "--shuffle_buffer_size", "8", "--train_iters", "6", "--log_sample_ids",
        "--global_batch_size", "4", "--num_workers", "1")


def sft(out, paths, *flags, **kwargs):
    return run_sft(out, "--dataset", *map(str, paths), *DATA, *flags, **kwargs)


def sample_ids(out):
    return [json.loads(line) for line in (out / "sample_ids.jsonl").read_text().splitlines()]


def test_a_stopped_stream_resumes_bit_exact(tmp_path, files, sft_here):
    """Stopped at iteration 3 (--exit_interval) and resumed in a new process, a packed
    stream with dropout trains the straight run's rows: the same sample ids per iteration
    and the same losses bit for bit."""
    flags = ["--packing", "--micro_batch_size", "2", "--hidden_dropout", "0.1"]
    # in this process without a loader worker: the stream is the same for any worker count
    sft_here(tmp_path / "whole", "--dataset", *map(str, files["jsonl"]), *DATA, *flags,
             "--num_workers", "0")
    split = tmp_path / "split"
    sft(split, files["jsonl"], *flags, "--exit_interval", "3")
    assert sorted(losses(split)) == [1, 2, 3]
    proc = sft(split, files["jsonl"], *flags, "--resume")
    assert "starting at iteration 3" in proc.stdout
    assert losses(split) == losses(tmp_path / "whole")
    assert sample_ids(split) == sample_ids(tmp_path / "whole")


def test_a_file_grown_or_reordered_since_the_checkpoint_is_named(tmp_path, files, sft_here):
    """A stream's files are fingerprinted by their sizes and ends; a resume on a file that
    grew since the checkpoint, or on the files in another order, names each file."""
    from swift_mcore.errors import CheckpointError

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_bytes(files["jsonl"][0].read_bytes())
    b.write_bytes(files["jsonl"][1].read_bytes())
    out = tmp_path / "run"
    flags = [*DATA, "--num_workers", "0", "--train_iters", "2"]
    sft_here(out, "--dataset", a, b, *flags)
    size = b.stat().st_size
    with open(b, "a") as fh:
        fh.write(a.read_text().splitlines()[0] + "\n")
    with pytest.raises(CheckpointError) as err:
        sft_here(out, "--dataset", a, b, *flags, "--resume", "--train_iters", "3")
    assert f"--dataset {b}: {size} bytes at the checkpoint, {b.stat().st_size} now" in \
        str(err.value)
    with pytest.raises(CheckpointError) as err:
        sft_here(out, "--dataset", b, a, *flags, "--resume", "--train_iters", "3")
    assert f"--dataset: file 1 was {a} at the checkpoint, now {b}" in str(err.value)


@pytest.mark.slow
def test_a_stream_resumes_on_another_data_parallel_size(tmp_path, files, sft_here):
    """DP 2's checkpoint at iteration 3 resumes on DP 1 with the straight DP-1 run's rows (no
    id twice, none missing) and its losses within 1e-5 (the gradient sum's order differs)."""
    flags = ["--micro_batch_size", "1", "--packing"]
    # in this process without a loader worker: the stream is the same for any worker count
    sft_here(tmp_path / "dp1", "--dataset", *map(str, files["jsonl"]), *DATA, *flags,
             "--num_workers", "0")
    dp2, resumed = tmp_path / "dp2", tmp_path / "resumed"
    sft(dp2, files["jsonl"], *flags, "--save_steps", "3", nproc=2)
    assert sample_ids(dp2) == sample_ids(tmp_path / "dp1")
    # a new process on one rank, from DP 2's checkpoint: iterations 4 to 6
    proc = sft(resumed, files["jsonl"], *flags, "--resume",
               dp2 / "checkpoint" / "iter_0000003")
    assert "starting at iteration 3" in proc.stdout
    ids = sample_ids(dp2)[:3] + sample_ids(resumed)
    assert ids == sample_ids(tmp_path / "dp1")
    flat = [i for record in ids for i in record["sample_ids"]]
    assert flat == list(range(24))
    whole = losses(tmp_path / "dp1")
    split = {**{i: v for i, v in losses(dp2).items() if i <= 3}, **losses(resumed)}
    assert sorted(losses(resumed)) == [4, 5, 6] and sorted(split) == sorted(whole)
    assert all(abs(split[i] - whole[i]) <= 1e-5 for i in whole)


def run_cli(tmp_path, *flags):
    cmd = [sys.executable, "-m", "swift_mcore", "sft", *TINY, "--output_dir",
           str(tmp_path / "out"), *map(str, flags)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=child_env(),
                          cwd=ROOT)


@pytest.mark.parametrize("flags,message", [
    (["--train_iters", None], "--streaming needs --train_iters: a stream has no length"),
    (["--num_workers", "2"], "--streaming reads the stream in one loader worker per rank"),
    (["--split_dataset_ratio", "0.1"], "--split_dataset_ratio holds out a share"),
    # refused without --streaming; the stream trained on, the mapping unused
    (["--columns", '{"conv": "messages"}'], "a.jsonl: --columns renames 'conv', a column "
     "the data does not have (the first row of each file has 'messages')"),
])
def test_streaming_flags_refused_in_one_line(tmp_path, files, flags, message):
    argv = ["--dataset", files["jsonl"][0], "--template", "plain", "--streaming",
            "--train_iters", "2"]
    if flags[1] is None:
        argv = argv[:-2]
    else:
        argv += flags
    proc = run_cli(tmp_path, *argv)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_file_that_cannot_stream_is_refused(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows(4)))
    proc = run_cli(tmp_path, "--dataset", path, "--template", "plain", "--streaming",
                   "--train_iters", "2")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"swift-mcore sft: error: --dataset {path}: --streaming reads .jsonl, .parquet and "
        f"saved datasets folders (it resumes from a row without reading the file up to it); "
        f"convert it, or train without --streaming"]


def test_a_bad_row_met_in_the_loader_worker_stops_the_run_naming_it(tmp_path, sft_here):
    """The row is encoded in the loader worker; its error reaches the trainer as the same
    one-line ArgumentError (the CLI prints it and exits 2), not as a worker traceback."""
    from swift_mcore.errors import ArgumentError

    data = rows(12)
    data[7] = {"messages": [{"role": "user", "content": "no answer"}]}
    path = write_jsonl(tmp_path / "bad.jsonl", data)
    with pytest.raises(ArgumentError) as err:
        sft_here(tmp_path / "out", "--dataset", path, *DATA, "--micro_batch_size", "2")
    assert str(err.value) == (f"--dataset {path}, row 7: the conversation has no assistant "
                              f"turn, so there is nothing to learn from it")


def last_records(out, name):
    """{iteration: value} of metrics.jsonl's loss or sample_ids.jsonl's ids; an iteration
    trained again after a SIGKILL (its checkpoint was not written) counts its last record."""
    if name == "loss":
        return losses(out)
    return {r["iteration"]: r["sample_ids"] for r in sample_ids(out)}


@pytest.mark.slow
def test_a_stream_killed_and_stopped_resumes_exactly(tmp_path, files, sft_here):
    """SIGKILL (a checkpoint every iteration) and then SIGTERM, each resumed: every
    iteration trains the straight run's rows with its losses bit for bit."""
    import os
    import signal
    import time

    flags = ["--packing", "--micro_batch_size", "2", "--hidden_dropout", "0.1",
             "--train_iters", "12", "--save_steps", "1"]
    sft_here(tmp_path / "whole", "--dataset", *map(str, files["jsonl"]), *DATA, *flags,
             "--num_workers", "0")
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "swift_mcore", "sft", *TINY, "--output_dir", str(out),
            "--dataset", *map(str, files["jsonl"]), *DATA, *flags]

    def run_until(iterations, sig):
        proc = subprocess.Popen(argv + ["--resume", "auto"], env=child_env(), cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        metrics = out / "metrics.jsonl"
        while proc.poll() is None and not (
                metrics.exists() and len(losses(out)) >= iterations):
            time.sleep(0.2)
        os.killpg(proc.pid, sig)
        proc.wait(240)
        return proc

    run_until(3, signal.SIGKILL)
    stopped = run_until(6, signal.SIGTERM)
    assert stopped.returncode == 0, stopped.stderr.read()[-2000:]
    sft(out, files["jsonl"], *flags, "--resume", "auto")
    whole = tmp_path / "whole"
    assert last_records(out, "loss") == last_records(whole, "loss")
    assert last_records(out, "ids") == last_records(whole, "ids")
    assert sorted(i for ids in last_records(out, "ids").values() for i in ids) == \
        list(range(48))


def test_preprocess_sft_accepts_a_shuffle_buffer_unused(tmp_path, files):
    """`preprocess sft` accepts training flags it does not use; sft's refusal of
    --shuffle_buffer_size without --streaming (which preprocess refuses) is not its."""
    from swift_mcore import preprocess

    folder = tmp_path / "prepared"
    assert preprocess.main(["sft", "--dataset", str(files["jsonl"][1]), "--template", "plain",
                            "--shuffle_buffer_size", "3", "--output_dir", str(folder)]) == 0
    assert (folder / "manifest.json").is_file()


def test_preprocess_sft_refuses_streaming(tmp_path, files, capsys):
    from swift_mcore import preprocess

    folder = tmp_path / "prepared"
    assert preprocess.main(["sft", "--dataset", str(files["jsonl"][0]), "--streaming",
                            "--output_dir", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--streaming reads the files while training; `preprocess sft` " \
        "tokenizes them whole" in err[0], err
    assert not folder.exists()


def test_validation_files_are_read_whole_beside_a_stream(tmp_path, files, sft_here):
    """--val_dataset with --streaming: validation runs on the files read whole (packed as
    the stream is), and its loss is logged."""
    sft_here(tmp_path / "out", "--dataset", *map(str, files["jsonl"]), *DATA,
             "--micro_batch_size", "2", "--packing", "--num_workers", "0", "--train_iters",
             "2", "--eval_steps", "2", "--eval_iters", "1", "--val_dataset",
             str(files["jsonl"][1]), "--no_save")
    records = [json.loads(line) for line in
               (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["split"] == "valid"]
    assert [r["iteration"] for r in valid] == [2] and valid[0]["val_loss"] > 0


@pytest.mark.parametrize("command", ["pt", "sft"])
def test_a_shuffle_buffer_without_streaming_is_refused(files, command):
    """--shuffle_buffer_size sizes the stream's buffer only: without --streaming it did
    nothing, silently."""
    from swift_mcore.arguments import RunArguments, SftArguments
    from swift_mcore.errors import ArgumentError
    from swift_mcore.run_config import resolve

    cls = SftArguments if command == "sft" else RunArguments
    flags = dict(dataset=[str(files["jsonl"][0])], train_iters=2, lr_warmup_iters=0)
    resolve(cls.from_flags(**flags, shuffle_buffer_size=8, streaming=True), world_size=1,
            cuda=False)
    with pytest.raises(ArgumentError, match=r"^--shuffle_buffer_size sizes --streaming's "
                                            r"shuffle buffer; without --streaming"):
        resolve(cls.from_flags(**flags, shuffle_buffer_size=8), world_size=1, cuda=False)


def test_the_resume_check_names_streaming_and_the_buffer():
    """A stream's checkpoint resumed without --streaming (or with another buffer) was
    refused with the data fingerprint's digests only."""
    from swift_mcore.checkpointing import compat

    saved = {"data": {"streaming": True, "shuffle_buffer_size": 5}}
    now = {"data": {"streaming": False, "shuffle_buffer_size": 1000}}
    assert compat.resume_differences(saved, now, None, None) == [
        "--streaming: checkpoint True, now False"]
    now["data"].update(streaming=True, shuffle_buffer_size=7)
    assert compat.resume_differences(saved, now, None, None) == [
        "--shuffle_buffer_size: checkpoint 5, now 7 (--streaming: the order of the rows "
        "depends on it)"]
    saved["data"]["streaming"] = now["data"]["streaming"] = False  # the buffer is not used
    assert compat.resume_differences(saved, now, None, None) == []


def test_the_resume_check_says_which_sft_flag_changed_the_data():
    """Another --packing (or template, truncation...) changes sft's data fingerprint: the
    flag is named beside it; with the fingerprint equal, the flags as given are not
    compared (--template auto and the template it picks train the same rows)."""
    from swift_mcore.checkpointing import compat

    saved = {"sft": {"packing": True, "template": "auto"}}
    now = {"sft": {"packing": False, "template": "plain"}}
    assert compat.resume_differences(saved, now, "abc", "def") == [
        "training data (content fingerprint): checkpoint 'abc', now 'def'",
        "--template: checkpoint 'auto', now 'plain'", "--packing: checkpoint True, now False"]
    assert compat.resume_differences(saved, now, "abc", "abc") == []
