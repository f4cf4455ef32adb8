"""`swift-mcore preprocess`: text files -> .bin/.idx; `preprocess sft`: conversations -> a tokenized folder."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

from .errors import ArgumentError
from .arguments.data import text_key_flag, tokenizer_flag, trust_remote_code_flag
from .arguments.fields import check_flags, flag
from .arguments.paths import check_output_files

DESCRIPTION = """Tokenize text into megatron's .bin/.idx format (the files `swift-mcore pt
--data_path PREFIX` and Megatron-LM read). One document per row (per line of a .txt file);
empty documents are skipped. Writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx atomically: an
error or Ctrl-C leaves an existing pair untouched."""


@dataclass
class PreprocessArguments:
    input: Optional[List[str]] = flag(
        None, "Files, folders or glob patterns (.jsonl .json .parquet .csv .txt), or a folder "
        "saved by datasets' save_to_disk. Required.")
    output_prefix: Optional[str] = flag(
        None, "Writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx. Required.")
    text_key: str = text_key_flag()
    tokenizer: Optional[str] = tokenizer_flag(default_source="")
    workers: Optional[int] = flag(
        None, "Tokenizer processes, one core each (1: in this process); the output is the same "
        "for any number. Default: the usable CPU cores.")
    append_eod: bool = flag(
        True, "Append the tokenizer's end-of-document token to each document (GPT pretraining "
        "separates documents with it); `--append_eod false` writes the bare tokens.")
    progress_bar: bool = flag(True, "Show a progress bar (documents/s, tokens/s) on stderr.")
    trust_remote_code: bool = trust_remote_code_flag()

    def validate(self) -> "PreprocessArguments":
        """Check every flag; raises ArgumentError naming it. Fills the defaults."""
        check_flags(self)
        if not self.input:
            raise ArgumentError("--input is required: files, folders or glob patterns")
        if not self.output_prefix or not str(self.output_prefix).strip():
            raise ArgumentError("--output_prefix is required (writes PREFIX.bin and PREFIX.idx)")
        for suffix in (".bin", ".idx"):
            if self.output_prefix.endswith(suffix):
                self.output_prefix = self.output_prefix[: -len(suffix)]
        if os.path.isdir(self.output_prefix):
            raise ArgumentError(f"--output_prefix {self.output_prefix} is a folder; give a "
                                f"file prefix inside it, like {self.output_prefix}/data")
        # PREFIX.bin as a folder, or a file where the folder should be: refused now, not
        # when the finished files are renamed into place after tokenizing everything.
        check_output_files([self.output_prefix + ".bin", self.output_prefix + ".idx"],
                           "--output_prefix")
        from .data.indexed import replaceable

        replaceable(self.output_prefix, "--output_prefix")
        if self.workers is None:
            self.workers = usable_cores()
        if self.workers < 1:
            raise ArgumentError(f"--workers must be a positive integer, got {self.workers}")
        if not str(self.text_key).strip():
            raise ArgumentError("--text_key must not be empty")
        return self


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def parse(argv: List[str]) -> PreprocessArguments:
    from .arguments.parser import add_flags

    parser = argparse.ArgumentParser(prog="swift-mcore preprocess", description=DESCRIPTION,
                                     argument_default=argparse.SUPPRESS)
    add_flags(parser, PreprocessArguments)
    return PreprocessArguments(**vars(parser.parse_args(argv))).validate()


# ---- the run --------------------------------------------------------------------------------

class _Progress:
    """tqdm over documents (its rate is documents/s), tokens/s alongside."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None
        self.documents = 0

    def __call__(self, stats) -> None:
        if not self.enabled:
            return
        if self.bar is None:  # at the first chunk: input errors come before any bar
            from tqdm import tqdm

            self.bar = tqdm(unit=" docs", dynamic_ncols=True, mininterval=0.5,
                            file=sys.stderr, desc="tokenizing")
        self.bar.update(stats.documents - self.documents)
        self.documents = stats.documents
        rate = stats.tokens / stats.seconds if stats.seconds else 0.0
        self.bar.set_postfix_str(f"{stats.tokens / 1e6:.1f}M tokens, {rate / 1e3:,.0f}k tokens/s",
                                 refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def preprocess(args: PreprocessArguments) -> dict:
    """Run the whole command; returns the summary (also what it prints)."""
    from .data.encoding import encode_sources
    from .data.sources import expand_inputs, total_bytes
    from .data.tokenizer import default_tokenizer, load_tokenizer

    start = time.perf_counter()
    sources = expand_inputs(args.input, flag="--input")
    tokenizer = (load_tokenizer(args.tokenizer, trust_remote_code=args.trust_remote_code)
                 if args.tokenizer else default_tokenizer())
    progress = _Progress(args.progress_bar)
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    if args.workers == 1:
        # One worker means one core: without this the tokenizer's own threads take them all.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        stats = encode_sources(sources, args.text_key, tokenizer, args.output_prefix,
                               workers=args.workers, append_eod=args.append_eod,
                               flag="--input", on_progress=progress)
    finally:
        progress.close()
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    prefix = args.output_prefix
    return {
        "output_prefix": prefix, "inputs": len(sources), "input_bytes": total_bytes(sources),
        **stats.as_dict(),
        "bin_bytes": os.path.getsize(prefix + ".bin"),
        "idx_bytes": os.path.getsize(prefix + ".idx"),
        "tokens_per_s": stats.tokens / max(stats.seconds, 1e-9),
        "documents_per_s": stats.documents / max(stats.seconds, 1e-9),
        "workers": args.workers, "tokenizer": args.tokenizer or "built-in byte-level BPE",
        "tokenizer_flag": args.tokenizer,
        "vocab_size": tokenizer.vocab_size, "wall_seconds": time.perf_counter() - start,
    }


def format_summary(s: dict) -> str:
    prefix = s["output_prefix"]
    return "\n".join([
        f"wrote {prefix}.bin ({s['bin_bytes'] / 1e6:,.1f} MB) and {prefix}.idx "
        f"({s['idx_bytes'] / 1e6:,.2f} MB)",
        f"  documents  {s['documents']:,} from {s['inputs']} input(s) of "
        f"{s['input_bytes'] / 1e6:,.1f} MB ({s['empty_skipped']:,} empty, skipped)",
        f"  tokens     {s['tokens']:,} (tokenizer {s['tokenizer']}, {s['vocab_size']:,} tokens)",
        f"  time       {s['seconds']:,.1f} s with {s['workers']} worker(s): "
        f"{s['documents_per_s']:,.0f} documents/s, {s['tokens_per_s']:,.0f} tokens/s "
        f"({s['wall_seconds']:,.1f} s in all)",
        f"  train on it: swift-mcore pt --data_path {prefix}"
        + (f" --tokenizer {s['tokenizer_flag']}" if s["tokenizer_flag"] else ""),
    ])


def main(argv: List[str]) -> int:
    from .launch import run_command

    if argv[:1] == ["sft"]:
        return run_command("preprocess sft", argv[1:], parse_sft, _preprocess_sft_and_report,
                           shutdown=False)
    return run_command("preprocess", argv, parse, _preprocess_and_report, shutdown=False)


# ---- sft: conversations tokenized into a folder for `sft --cached_dataset` -----------------

def parse_sft(argv: List[str]):
    """`preprocess sft` takes sft's own flags (the data, tokenizer and template ones matter;
    the others are accepted and unused) and requires --output_dir, the folder to write."""
    from .arguments import SftArguments
    from .arguments.parser import parse_args
    from .run_config import resolve

    if not any(a == "--output_dir" or a.startswith("--output_dir=") for a in argv):
        raise ArgumentError("--output_dir is required (the folder to write; "
                            "then train with `swift-mcore sft --cached_dataset FOLDER`)")
    args = parse_args(argv, prog="swift-mcore preprocess sft", cls=SftArguments)
    if args.data.streaming:
        raise ArgumentError("--streaming reads the files while training; `preprocess sft` "
                            "tokenizes them whole into --output_dir: leave --streaming out")
    args.explicit.discard("shuffle_buffer_size")  # a training flag: accepted and unused here
    config = resolve(args, world_size=1, cuda=False)
    s, folder = config.sft, config.logging.output_dir
    if s.cached_dataset:
        raise ArgumentError("--cached_dataset is what it writes; give "
                            "--dataset, the raw conversation files")
    if s.val_dataset:
        raise ArgumentError("--val_dataset is not stored; prepare it into a "
                            "folder of its own, or hold out a share with "
                            "--split_dataset_ratio when training")
    if os.path.lexists(folder):
        raise ArgumentError(f"--output_dir {folder}: exists; give a new folder (nothing is "
                            f"overwritten)")
    return config


def preprocess_sft(config) -> dict:
    """Tokenize --dataset into --output_dir; returns the summary."""
    from .arguments.sft import column_map
    from .data.templates import Template
    from .data.token_cache import write_sft_dataset
    from .data.tokenizer import build_tokenizer

    start = time.perf_counter()
    s, folder = config.sft, config.logging.output_dir
    tokenizer = build_tokenizer(config)
    template = Template(s.template, tokenizer, system=s.system,
                        train_separator=s.train_separator,
                        ignore_empty_think=s.ignore_empty_think)
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    if config.model.vision_config:  # image rows: the images stay in their files
        from .data.image_cache import image_encoder, write_image_sft_dataset

        write_image_sft_dataset(folder, list(config.dataset_sources), column_map(s.columns),
                                image_encoder(config, tokenizer), s.dataset_num_proc)
    else:
        write_sft_dataset(folder, list(config.dataset_sources), column_map(s.columns),
                          template, s.loss_on, s.dataset_num_proc)
    packed = _store_pack_plan(config, folder, template, tokenizer) if s.packing else None
    manifest = json.loads(open(os.path.join(folder, "manifest.json"), encoding="utf-8").read())
    shapes = manifest["arrays"]
    images = shapes["grids"]["shape"][0] if "grids" in shapes else None
    videos = shapes["video_grids"]["shape"][0] if "video_grids" in shapes else None
    flags = [f"--{name} {value}" for name, value in (
        ("tokenizer", config.data.tokenizer), ("model", config.model.model),
        ("template", s.template if s.template != "auto" else None),
        ("max_pixels", s.max_pixels), ("min_pixels", s.min_pixels),
        *((name, getattr(s, name, None)) for name in (
            "fps", "fps_min_frames", "fps_max_frames", "video_min_pixels",
            "video_max_pixels", "video_total_pixels") if videos)) if value]
    return {"folder": folder, "conversations": manifest["meta"]["conversations"],
            "samples": shapes["answers"]["shape"][0], "tokens": shapes["ids"]["shape"][0],
            "template": template.describe(), "flags": " ".join(flags), "packed": packed,
            "images": images, "videos": videos,
            "seconds": time.perf_counter() - start}


def _store_pack_plan(config, folder: str, template, tokenizer) -> dict:
    """--packing: the packing plan for --seq_length and --truncation_strategy stored in the
    folder (an index over its samples; `sft --cached_dataset --packing` with these flags
    maps it, with others re-plans from the stored lengths). A plan that cannot be made
    leaves no folder behind."""
    import shutil

    from .arguments.sft import column_map
    from .data.token_cache import load_sft_dataset, write_pack_plan

    s, seq = config.sft, config.model.seq_length
    try:
        if config.model.vision_config:  # image rows are never cut: each must fit
            from .data.image_cache import check_lengths, image_encoder, load_image_sft_dataset

            images, _ = load_image_sft_dataset(folder, image_encoder(config, tokenizer),
                                               column_map(s.columns), "--output_dir")
            check_lengths(images, seq)
            samples = images.tokenized.encoded
        else:
            tokenized, _ = load_sft_dataset(folder, template, s.loss_on,
                                            column_map(s.columns))
            samples = tokenized.fit(seq, s.truncation_strategy)
        if len(samples) == 0:
            raise ArgumentError(f"--packing: no conversation fits --seq_length {seq}; raise "
                                f"it or use --truncation_strategy left|right")
        rows = write_pack_plan(folder, samples.positions(), seq)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return {"seq_length": seq, "truncation_strategy": s.truncation_strategy,
            "samples": len(samples), "rows": rows}


def format_sft_summary(s: dict) -> str:
    return "\n".join([
        f"wrote {s['folder']}: {s['conversations']:,} conversations as {s['samples']:,} "
        f"samples, {s['tokens']:,} tokens (template: {s['template']}) in {s['seconds']:,.1f} s"
        + (f"; {s['images']:,} images" + (f" and {s['videos']:,} videos" if s.get("videos")
                                         else "")
           + ", read from their files at training (keep them where they are: each is checked "
           "by its sha256)" if s.get("images") is not None else ""),
        f"  train on it: swift-mcore sft --cached_dataset {s['folder']}"
        + (f" {s['flags']}" if s["flags"] else "")
        + " (and the --system, --loss_on, --columns, --ignore_empty_think flags used here)",
    ] + ([f"  packing plan stored for --seq_length {s['packed']['seq_length']} "
          f"--truncation_strategy {s['packed']['truncation_strategy']}: "
          f"{s['packed']['samples']:,} samples in {s['packed']['rows']:,} rows (another "
          f"--seq_length re-plans from the stored tokens)"] if s.get("packed") else []))


def _preprocess_sft_and_report(config) -> None:
    try:
        summary = preprocess_sft(config)
    except KeyboardInterrupt:
        print("swift-mcore preprocess sft: interrupted; nothing was written", file=sys.stderr)
        raise SystemExit(130) from None
    print(format_sft_summary(summary), flush=True)


def _preprocess_and_report(args) -> None:
    try:
        summary = preprocess(args)
    except KeyboardInterrupt:
        print("swift-mcore preprocess: interrupted; nothing was written", file=sys.stderr)
        raise SystemExit(130) from None
    print(format_summary(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
