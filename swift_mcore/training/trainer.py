"""The Trainer: builds every part of a run in order (docs/architecture.md), then runs the loop."""

from __future__ import annotations

import logging
import signal
import time
from functools import partial
from typing import Dict, Iterator, Optional

import torch
import torch.distributed as dist

from ..arguments import RunArguments
from ..checkpointing.state import TrainState
from ..run_config import RunConfig, check_vocab, resolve
from ..runtime import collectives, cpu, distributed, run_lock, seed
from . import best, moe_metrics, mtp_metrics, run_log
from .metrics import LogWindow, executed_flops_per_token, flops_per_token
from .moe_padding import routing_padding
from .nonfinite import NonFiniteGuard
from .peak import device_peak, peak_memory_gb
from .writers import MetricWriter, format_log_line, rng_untouched

logger = logging.getLogger("swift_mcore")


class Trainer:
    """``Trainer(args).train()``. Subclasses override ``forward_step`` or ``compute_loss``.

    ``self.args`` are the arguments as given (never changed); everything reads
    ``self.config``, the RunConfig resolved from them (complete once the data is read)."""

    def __init__(self, args: RunArguments | RunConfig):
        self.config = args if isinstance(args, RunConfig) else resolve(args)
        self.args = args.args if isinstance(args, RunConfig) else args
        self.start_time = time.time()
        self.state = TrainState()
        self._stop_signal: Optional[int] = None
        self._saved_handlers: Optional[dict] = None  # the process's, while training
        self.sample_audit = None  # training/sample_audit.py under --log_sample_ids
        self.trackers: list = []  # started in setup (--report_to), handed to the writer
        self.writer: Optional[MetricWriter] = None
        self.watchdog = None  # runtime/watchdog.py, started at the end of setup
        self.profiler = None  # --profile on this rank: training/profiler.py
        self.started_at: Optional[int] = None  # the iteration this segment started from
        self.attempt = None  # under torchrun: the group's attempt (runtime/elastic.py)

    # ---- the loop -----------------------------------------------------------------------
    def train(self) -> TrainState:
        try:
            return self.run_loop()
        except BaseException as err:
            self.close_outputs(failed=True)  # trackers learn that the run failed
            if isinstance(err, Exception):
                self.note_failure(err)
            raise
        finally:
            if self.watchdog is not None:
                self.watchdog.close()
            self.restore_signal_handlers()

    def run_loop(self) -> TrainState:
        self.setup()
        config, state = self.config, self.state
        total = config.training.train_iters
        exit_reason = None
        while state.iteration < total:
            self.watchdog.arm(f"iteration {state.iteration + 1}")
            if self.profiler:
                self.profiler.before_step(state.iteration + 1)
            step = self.train_step()
            self.checkpoints.finish_saves()  # --async_save: commit a background save once written
            self.advance(step)
            if self.profiler:
                self.profiler.after_step(state.iteration)
            self.report(step)
            improved = False
            if self.due(config.logging.eval_steps):
                improved = self.judge_best(self.evaluate())
            exit_reason = self.exit_reason()
            if exit_reason or self.due(config.checkpoint.save_steps) or improved:
                self.save_checkpoint()
            if exit_reason:
                break
        if not exit_reason and state.iteration == total:
            self.save_checkpoint()
        self.finish(exit_reason)
        return state

    # ---- setup: the order of docs/architecture.md -------------------------------------
    def setup(self) -> None:
        from .. import data
        from ..checkpointing import CheckpointManager
        from ..checkpointing.load import plan_load
        from ..models.gpt import count_parameters
        from ..runtime.ddp import wrap_model
        from .optimizer import build_optimizer, build_scheduler

        plan = self.config  # resolved from the flags; the data completes it below
        distributed.initialize(plan)
        # Before any work: one run per --output_dir (runtime/run_lock.py).
        run_lock.acquire_for_run(plan.logging.output_dir, f"swift-mcore {plan.COMMAND}")
        from .profiler import StepProfiler

        StepProfiler.check_folder(plan)  # a link planted at output_dir/profile: refused now
        self.tokenizer = data.build_tokenizer(plan)
        check_vocab(plan.model, self.tokenizer.vocab_size)
        seed.set_seed(plan.training.seed, plan.cuda)
        # What would be resumed, and whether it may be, is settled before anything is
        # written (megatron's index cache, the model, the logs).
        self.data_fingerprint = self.fingerprint_data()
        load_plan = plan_load(plan, self.data_fingerprint, log=self.writer_print_early)
        # The datasets (not their iterators) come before the model: bad data stops the run
        # first, and --num_train_epochs needs the training set's size.
        self.train_ds, self.valid_ds, self.test_ds = self.build_datasets()
        # A stream (--streaming) has no length: its run gives --train_iters.
        streaming = getattr(self.train_ds, "streaming", False)
        self.config = config = plan.complete(self.tokenizer.vocab_size,
                                             None if streaming else len(self.train_ds))
        self.check_validation_data()
        # Trackers start before the model is built: one that cannot start stops the run
        # before any training, with one line.
        self.trackers = self.start_trackers(load_plan)
        self.checkpoints = CheckpointManager(config, load_plan, log=self.writer_print_early)
        self.model = wrap_model(config, self.build_model())
        self.num_parameters = self.count_all_parameters(count_parameters(self.model))
        megatron_config = self.model[0].config
        from megatron.core.distributed import finalize_model_grads

        megatron_config.finalize_model_grads_func = finalize_model_grads
        megatron_config.no_sync_func = [chunk.no_sync for chunk in self.model]
        if config.model.num_experts is not None:
            moe_metrics.reset()
        if config.model.mtp_num_layers:
            mtp_metrics.reset()
        if len(self.model) == 1:
            megatron_config.no_sync_func = megatron_config.no_sync_func[0]
        if config.parallel.align_param_gather:  # the interleaved schedule starts them
            megatron_config.param_sync_func = [chunk.start_param_sync for chunk in self.model]
        self.optimizer = build_optimizer(config, self.model)
        megatron_config.grad_scale_func = self.optimizer.scale_loss
        self.scheduler = build_scheduler(config, self.optimizer)
        self.state = self.checkpoints.restore(self.model, self.optimizer, self.scheduler)
        best.adopt(self.state, config.checkpoint, log=self.writer_print_early)
        if streaming:
            self.train_iterator = self.build_stream_iterator()
        else:
            self.train_iterator = self.build_iterator(self.train_ds,
                                                      self.state.consumed_train_samples)
        self.valid_iterator = self.build_iterator(self.valid_ds,
                                                  self.state.consumed_valid_samples)
        self.writer = self.build_writer()
        if config.logging.log_sample_ids:
            from .sample_audit import SampleAudit

            self.sample_audit = SampleAudit(config.logging.output_dir)
        self.writer.start(self.state.iteration,
                          load_plan.folder if load_plan and load_plan.kind == "resume" else None)
        self.nonfinite_guard = NonFiniteGuard.for_config(config, log=self.writer.print)
        self.flops_per_token = flops_per_token(config)  # the model's: TrainState's count
        self.peak = self.device_peak()
        self.log_window = LogWindow(executed_flops_per_token(config), config.world.world_size,
                                    peak_tflops=self.peak.tflops if self.peak else None,
                                    memory_gb=partial(peak_memory_gb, config.cuda))
        self.install_signal_handlers()
        self.started_at = self.state.iteration
        self.log_start(load_plan.folder if load_plan and load_plan.kind == "resume" else None)
        self.log_tuner()
        from ..runtime.watchdog import Watchdog

        self.watchdog = Watchdog(distributed.timeout_of(config).total_seconds(),
                                 distributed.rank())
        from .profiler import StepProfiler

        self.profiler = StepProfiler.for_config(config, distributed.rank(),
                                                log=lambda line: print(line, flush=True))

    def device_peak(self):
        """The TFLOP/s MFU is reported against (training/peak.py), on the writing rank (the
        only one that reports); None elsewhere."""
        if not self.writer.active:
            return None
        return device_peak(self.config.logging.peak_tflops, self.config.cuda)

    def fingerprint_data(self) -> str:
        """The identity of the training data (content, blend, split, tokenizer, sft flags),
        from the files alone: known before any dataset or cache is built."""
        if self.config.COMMAND == "sft":
            from ..data.sft_datasets import sft_fingerprint

            return sft_fingerprint(self.config, self.tokenizer)
        if self.config.data.streaming:
            from ..data.text_stream import text_stream_fingerprint

            return text_stream_fingerprint(self.config, self.tokenizer)
        from ..data.gpt_datasets import dataset_fingerprint

        return dataset_fingerprint(self.config, self.tokenizer)

    def build_datasets(self):
        """(train, valid, test): megatron's GPT datasets for pt (a text stream with
        --streaming), conversation rows for sft."""
        if self.config.COMMAND == "sft" and self.config.model.vision_config:
            from ..data.image_sft import build_image_sft_datasets

            return build_image_sft_datasets(self.config, self.tokenizer,
                                            log=self.writer_print_early)
        if self.config.COMMAND == "sft":
            from ..data.sft_datasets import build_sft_datasets

            return build_sft_datasets(self.config, self.tokenizer, log=self.writer_print_early)
        if self.config.data.streaming:  # pt on raw text read lazily: no validation split
            from ..data.text_stream import build_text_stream

            return build_text_stream(self.config, self.tokenizer,
                                     log=self.writer_print_early), None, None
        from ..data.gpt_datasets import build_datasets

        return build_datasets(self.config, self.tokenizer)

    def build_model(self) -> list:
        """This rank's model chunks: --model's weights loaded, then --tuner_type lora's
        adapters (the base frozen), before DDP buckets the parameters that train."""
        from ..models import lora
        from ..models.gpt import build_model

        chunks = build_model(self.config)
        self.load_pretrained_weights(chunks)
        chunks = lora.apply(self.config, chunks)
        if self.config.model.vision_config and self.config.tuner.tuner_type == "full":
            from ..models.vision import freeze

            freeze(chunks, self.config.tuner)  # --freeze_vit, --freeze_aligner, --freeze_llm
        return chunks

    def load_pretrained_weights(self, chunks) -> None:
        """--model: the Hugging Face weights, after the model is built and before the optimizer
        takes its copy of the parameters (a resumed checkpoint then replaces them)."""
        if self.config.model.model:
            from ..models.hf_load import load_hf_weights

            load_hf_weights(self.config, chunks, log=self.writer_print_early)

    def build_iterator(self, dataset, consumed_samples: int) -> Optional[Iterator]:
        from megatron.core import parallel_state
        from ..data import build_data_iterator

        return build_data_iterator(
            dataset, consumed_samples, self.config,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size())

    def build_stream_iterator(self):
        """--streaming: the stream continued from the checkpoint's position
        (TrainState.data_stream; data/streaming.py), which it keeps current."""
        from megatron.core import parallel_state
        from ..data.streaming import build_stream_iterator

        return build_stream_iterator(
            self.train_ds, self.state.consumed_train_samples, self.state.data_stream,
            self.config, dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size())

    def build_writer(self) -> MetricWriter:
        lg = self.config.logging
        return MetricWriter(lg.output_dir, self.config.training.train_iters, self.state.iteration,
                            active=distributed.is_last_rank(), trackers=self.trackers,
                            progress_bar=lg.progress_bar)

    def start_trackers(self, load_plan) -> list:
        """Collective: the --report_to trackers, started on the last rank (the writing
        one). One that cannot start raises ArgumentError on every rank; a resumed run
        continues the tracked runs of its output_dir."""
        from ..errors import ArgumentError
        from ..runtime import collectives
        from . import trackers

        lg, started, error = self.config.logging, [], None
        if distributed.is_last_rank() and lg.report_to:
            try:
                with rng_untouched():
                    started = trackers.start(
                        lg.report_to, lg.output_dir, self.config.to_dict(), lg.run_name,
                        resumed=load_plan is not None and load_plan.kind == "resume")
            except ArgumentError as err:
                error = str(err)
        errors = [e for e in collectives.all_gather(error) if e]
        if errors:
            raise ArgumentError(errors[0])
        return started

    def check_validation_data(self) -> None:
        """--metric_for_best and early stopping judge evaluations: the data must hold some."""
        from ..errors import ArgumentError

        c = self.config.checkpoint
        if c.metric_for_best and (self.valid_ds is None or len(self.valid_ds) == 0):
            raise ArgumentError(
                f"--metric_for_best {c.metric_for_best} needs validation data, but the data "
                f"gives no validation samples (raise the validation share of --split, or "
                f"give sft --val_dataset / --split_dataset_ratio)")

    # ---- one iteration ------------------------------------------------------------------
    def train_step(self) -> Dict[str, float]:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.sample_audit is not None:
            self.sample_audit.reset()
        losses = self.forward_backward(self.train_iterator, forward_only=False)
        loss_sum, targets, tokens = self.reduce_losses(losses)
        loss = loss_sum / max(targets, 1.0) if targets is not None else None
        lr = self.optimizer.param_groups[0]["lr"]  # this iteration's, before the scheduler's step
        update_successful, grad_norm = self.optimizer_step(loss)
        if update_successful:
            self.scheduler.step(increment=1)
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped": 0.0 if update_successful else 1.0,
            "tokens": tokens,
            **moe_metrics.collect(self.config),  # the router's losses, apart from the LM loss
            **mtp_metrics.collect(self.config),  # multi-token prediction's, apart as well
        }

    def optimizer_step(self, loss: Optional[float]) -> tuple:
        """(update applied, gradient norm): megatron's optimizer step, unless the loss or the
        gradient norm is nan/inf on any rank (training/nonfinite.py, --nonfinite_policy)."""
        from ..errors import NonFiniteError

        try:
            return self.nonfinite_guard.step(self.optimizer, loss, self.state.iteration + 1)
        except NonFiniteError:
            self.writer.close(failed=True)  # what was logged so far stays; unsaved
            raise

    def forward_backward(self, data_iterator, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        config = self.config
        forward_step = cpu.wrap_forward_step(self.forward_step, config)
        if config.args.virtual_stages():  # the interleaved schedule: one feed per model chunk
            from .chunk_feed import ChunkFeed

            data_iterator = ChunkFeed.for_chunks(data_iterator, len(self.model))
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data_iterator,
            model=self.model,
            num_microbatches=config.world.num_microbatches,
            seq_length=config.model.seq_length,
            micro_batch_size=self.rows_per_micro_batch(),
            decoder_seq_length=config.model.seq_length,
            forward_only=forward_only,
        )

    def rows_per_micro_batch(self) -> int:
        """The batch size of the activations pipeline stages exchange (a subclass whose
        sample is several rows says so)."""
        return self.config.training.micro_batch_size

    def forward_step(self, data_iterator, model):
        """One micro-batch through one model chunk: returns (output, loss function)."""
        batch = (data_iterator.next_batch(self.get_batch) if hasattr(data_iterator, "next_batch")
                 else self.get_batch(data_iterator))
        # multi-token prediction weighs its targets by the mask the LM loss uses (megatron
        # shifts it with the labels); without MTP the model does not read it
        mtp = {"loss_mask": batch["loss_mask"]} if self.config.model.mtp_num_layers else {}
        # a vision-language model's images and videos (data/multimodal.py)
        images = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                                        "video_grid_thw", "second_per_grid_ts") if k in batch}
        # under context parallelism its rows whole: the model splits them after the tower
        tokens = batch.get("whole_tokens", batch["tokens"])
        positions = batch.get("whole_position_ids", batch["position_ids"])
        output = model(input_ids=tokens, position_ids=positions,
                       attention_mask=batch.get("attention_mask"), labels=batch["labels"],
                       packed_seq_params=batch.get("packed_seq_params"), **mtp, **images,
                       **routing_padding(self.config, model, batch))
        return output, partial(self.compute_loss, batch)

    def get_batch(self, data_iterator) -> Dict[str, torch.Tensor]:
        """The next micro-batch on this rank's device. Packed rows (sft --packing) get the
        mask that keeps their conversations apart, as ``config.packed_rows`` decided: a
        block-diagonal causal mask, or variable-length parameters for Transformer Engine."""
        batch = next(data_iterator)
        if self.sample_audit is not None and model_is_training(self.model):
            self.sample_audit.add(batch["sample_ids"])
        device = self.device()
        packed = None
        if "segment_ids" in batch and self.config.packed_rows == "thd":
            from ..data.packing import packed_seq_params

            # From the loader's CPU copy: the segment lengths never wait for the GPU.
            packed = packed_seq_params(batch["segment_ids"], device=device)
        if device.type != "cpu":
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        if packed is not None:
            batch["packed_seq_params"] = packed
        elif "segment_ids" in batch:
            from ..data.packing import block_causal_mask

            # KTO's KL rows are packed apart from its rows: each set of rows gets its mask
            # here, whole, before the context-parallel split cuts its query rows
            for prefix in SEQUENCE_PREFIXES:
                if prefix + "segment_ids" in batch:
                    batch[prefix + "attention_mask"] = block_causal_mask(
                        batch[prefix + "segment_ids"])
        if self.config.world.context_parallel > 1:
            whole = {}
            if self.config.model.vision_config:  # the tower sees every image of the row
                whole = {"whole_tokens": batch["tokens"],
                         "whole_position_ids": batch["position_ids"]}
            batch = {**on_this_cp_rank(batch, self.config.world.context_parallel), **whole}
        return batch

    def device(self) -> torch.device:
        """Where this rank's model runs: its GPU (set by runtime.distributed), or the CPU."""
        if self.config.cuda:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def compute_loss(self, batch, output_tensor):
        """Per-token losses -> (loss sum, target count, report); megatron divides the
        gradients by the target count of the whole global batch (all micro-batches and
        data-parallel ranks), so the loss is a mean over real target tokens."""
        loss_mask = batch["loss_mask"].float()
        loss_sum = (output_tensor.float() * loss_mask).sum()
        num_targets = loss_mask.sum().to(torch.int)
        tokens = batch.get("num_tokens", batch["tokens"].numel())  # padding left out
        report = torch.stack([loss_sum.detach(), num_targets.detach().float(),
                              torch.as_tensor(tokens, dtype=torch.float,
                                              device=loss_sum.device)])
        return loss_sum, num_targets, {"lm loss": report}

    def reduce_losses(self, losses) -> tuple:
        """(loss sum, target tokens, input tokens) over micro-batches and data-parallel
        ranks; Nones off the last pipeline stage."""
        from megatron.core import parallel_state

        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return None, None, None
        total = torch.stack([entry["lm loss"] for entry in losses]).sum(0)
        # the context-parallel ranks of a replica hold the parts of the same sequences
        total = collectives.all_reduce(total, group=parallel_state.get_data_parallel_group(
            with_context_parallel=True))
        total = total.tolist()  # one host sync for the three numbers
        # A custom compute_loss may report (loss sum, targets) only: tokens then unknown.
        tokens = float(total[2]) if len(total) > 2 else None
        return float(total[0]), float(total[1]), tokens

    def advance(self, step: Dict[str, float]) -> None:
        state, gbs = self.state, self.config.training.global_batch_size
        state.iteration += 1
        state.consumed_train_samples += gbs
        # --streaming: the stream's position after the batch just trained, saved with it
        state.data_stream = getattr(self.train_iterator, "position", state.data_stream)
        if step.get("skipped"):
            state.skipped_train_samples += gbs
        # Real tokens where this rank knows them (the last pipeline stage), else a full batch.
        tokens = step.get("tokens")
        if tokens is None:
            tokens = gbs * self.config.model.seq_length
        state.floating_point_operations_so_far += tokens * self.flops_per_token
        if self.sample_audit is not None:
            self.sample_audit.write(state.iteration, self.writer.active)

    # ---- validation ---------------------------------------------------------------------
    def evaluate(self) -> Optional[Dict[str, float]]:
        if self.valid_iterator is None:
            return None
        for chunk in self.model:
            chunk.eval()
        loss_sum = tokens = 0.0
        with torch.no_grad():
            for _ in range(self.config.logging.eval_iters):
                s, n, _ = self.reduce_losses(
                    self.forward_backward(self.valid_iterator, True))
                if s is not None:
                    loss_sum, tokens = loss_sum + s, tokens + n
                self.state.consumed_valid_samples += self.config.training.global_batch_size
        for chunk in self.model:
            chunk.train()
        if not self.writer.active:
            return None
        val_loss = loss_sum / max(tokens, 1.0)
        metrics = {"val_loss": val_loss, "val_ppl": float(torch.tensor(val_loss).exp())}
        self.writer.record(self.state.iteration, metrics, prefix="valid")
        self.writer.print(format_log_line(self.state.iteration,
                                          self.config.training.train_iters, metrics))
        return metrics

    def judge_best(self, metrics: Optional[Dict[str, float]]) -> bool:
        """Collective, after an evaluation: --metric_for_best's value (from the writing
        rank) against the best so far, in the TrainState of every rank. True: this
        evaluation is the new best (its checkpoint is saved now)."""
        c = self.config.checkpoint
        if not c.metric_for_best:
            return False
        from ..runtime import collectives

        metrics = collectives.broadcast(metrics, src=collectives.world_size() - 1)
        previous = (self.state.best_value, self.state.best_iteration)
        improved = best.judge(self.state, metrics, c)
        line = run_log.best_line(c, self.state, (metrics or {}).get(c.metric_for_best),
                                 improved, previous)
        if line:
            self.writer.print(line)
        return improved

    # ---- reporting ----------------------------------------------------------------------
    def report(self, step: Dict[str, float]) -> None:
        """Progress bar every iteration; a log line with the window's averages every
        --log_interval iterations and at the last one."""
        it, total = self.state.iteration, self.config.training.train_iters
        self.writer.step(it, step.get("loss"))
        self.log_window.add(step)
        if it % self.config.logging.log_interval == 0 or it == total:
            metrics = self.log_window.flush()
            self.writer.record(it, metrics)
            self.writer.print(format_log_line(it, total, metrics))

    def log_start(self, resumed_from: Optional[str] = None) -> None:
        from ..runtime import elastic

        self.attempt = elastic.of_group(elastic.current())
        if self.attempt is not None:  # under torchrun: which attempt, and where it resumed
            self.writer.print(elastic.start_line(self.attempt, self.state.iteration,
                                                 resumed_from))
        self.writer.print(run_log.start_line(self.config, self.num_parameters, self.peak,
                                             self.state))

    def log_tuner(self) -> None:
        """--tuner_type lora: how many parameters train out of how many, and where."""
        from ..models import lora

        if not lora.enabled(self.config):
            return
        trainable, total = lora.parameter_counts(self.model)
        trainable = self.count_all_parameters(trainable, trainable_only=True)
        total = self.count_all_parameters(total)
        self.writer.print(run_log.tuner_line(self.config, trainable, total))

    def count_all_parameters(self, local: int, trainable_only: bool = False) -> int:
        """Parameters of the whole model: summed over TP and PP ranks of one replica, and
        the routed experts over the expert-parallel ranks (each holds its own)."""
        from megatron.core import parallel_state

        total = collectives.all_reduce(torch.tensor([local], dtype=torch.int64),
                                       group=parallel_state.get_model_parallel_group())
        if self.config.world.expert_parallel > 1:
            experts = sum(p.numel() for chunk in self.model
                          for name, p in chunk.named_parameters() if ".local_experts." in name
                          and (p.requires_grad or not trainable_only))
            others = collectives.all_reduce(torch.tensor([experts], dtype=torch.int64),
                                            group=parallel_state.get_expert_model_parallel_group())
            total += others - experts
        return int(total.item())

    # ---- stopping and saving ------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        def handler(signum, frame):
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._stop_signal = signum

        self._saved_handlers = {signum: signal.getsignal(signum)
                                for signum in (signal.SIGTERM, signal.SIGINT)}
        for signum in self._saved_handlers:
            signal.signal(signum, handler)

    def restore_signal_handlers(self) -> None:
        """The handlers the process had before training: a Python caller (a notebook, a test,
        a sweep of runs in one process) keeps its own, and processes it forks later (a
        tokenizing pool) do not inherit a finished run's."""
        for signum, previous in (self._saved_handlers or {}).items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._saved_handlers = None

    def exit_reason(self) -> Optional[str]:
        """Why to stop after this iteration, agreed by all ranks (a signal may reach one)."""
        c = self.config.checkpoint
        code = 0
        early_stop = best.should_stop(self.state, c)  # the same TrainState on every rank
        if early_stop:
            code = 4
        elif self._stop_signal is not None:
            code = 3
        elif c.exit_interval and self.state.iteration % c.exit_interval == 0:
            code = 2
        elif c.exit_duration_in_mins and (
                time.time() - self.start_time) / 60 >= c.exit_duration_in_mins:
            code = 1
        flag = collectives.all_reduce(torch.tensor([code], dtype=torch.int),
                                      op=dist.ReduceOp.MAX)
        return {0: None, 1: "--exit_duration_in_mins reached", 2: "--exit_interval reached",
                3: "stop signal received", 4: early_stop}[int(flag.item())]

    def note_failure(self, err: Exception) -> None:
        """Under torchrun: record the failure (runtime/elastic.py); one that repeats the
        previous attempt's exactly ends the job instead of restarting it."""
        from ..runtime import elastic

        attempt = self.attempt or elastic.current()  # (a failure before the group's is known)
        if attempt is not None:
            elastic.report_failure(self.config.logging.output_dir, attempt, distributed.rank(),
                                   self.started_at, self.state.iteration + 1, err)

    def due(self, every: Optional[int]) -> bool:
        return bool(every) and self.state.iteration % every == 0

    def save_checkpoint(self) -> Optional[str]:
        """Saves the current iteration unless --no_save, or it was saved already; with
        --save_safetensors also its Hugging Face folder."""
        if self.config.checkpoint.no_save or self.checkpoints.saved_at(self.state.iteration):
            return None
        from ..runtime.ddp import sync_weights

        sync_weights(self.config, self.model)  # --overlap_param_gather: the whole weights
        path = self.checkpoints.save(self.state, self.model, self.optimizer, self.scheduler,
                                     self.data_fingerprint)
        self.writer.print(run_log.saved_line(path, self.state,
                                             background=self.config.checkpoint.async_save))
        if self.config.checkpoint.save_safetensors:
            self.checkpoints.finish_saves(blocking=True)  # the conversion reads it
            if self._stop_signal is not None:  # a grace period is too short for it
                self.writer.print(run_log.not_converted_line(path))
            else:
                self.save_hf_folder()
        return path

    def save_hf_folder(self) -> Optional[str]:
        """--save_safetensors: the checkpoint just saved as a Hugging Face folder next to it
        (iter_NNNNNNN-hf), converted by `swift-mcore export --to_hf` in a child process and
        committed as checkpoints are (checkpointing/manager.py). A failed conversion is a
        warning: the checkpoint itself is saved and training goes on."""
        from ..errors import CheckpointError
        from ..runtime.export_child import export_in_subprocess

        # The child converts on the CPU (launch.py), where it would build float32: the folder
        # keeps the training precision unless --model's config.json names a dtype.
        dtype = None if self.config.model.model else {
            "bf16": "bfloat16", "fp16": "float16"}.get(self.config.precision)
        try:
            line = self.checkpoints.save_hf_folder(
                self.state, lambda checkpoint, out: export_in_subprocess(
                    checkpoint, out, dtype=dtype,
                    group_timeout=distributed.timeout_of(self.config).total_seconds()))
        except CheckpointError as err:
            self.writer.print(run_log.conversion_failed_line(self.state.iteration, str(err)))
            return None
        self.writer.print(f"--save_safetensors: {line}")
        return line

    def writer_print_early(self, text: str) -> None:
        if distributed.is_last_rank():
            print(text, flush=True)

    def finish(self, exit_reason: Optional[str]) -> None:
        self.checkpoints.finish_saves(blocking=True)  # a background save is committed first
        if self.profiler:
            self.profiler.close(self.state.iteration)  # training ended inside its window
        self.watchdog.disarm()  # the closing outputs are not an iteration
        lg = self.config.logging
        lines = run_log.finish_lines(self.config, self.state, exit_reason,
                                     self.writer.failed_trackers)
        self.writer.close()
        if self.writer.active and lg.plot:
            plot = self.write_plot()
            if plot:
                lines.append(run_log.plot_line(plot))
        if self.writer.active:
            print("\n".join(lines), flush=True)
        distributed.barrier()  # every rank is done with output_dir
        run_lock.release(lg.output_dir)

    def write_plot(self) -> Optional[str]:
        """output_dir/loss.png (training/plot.py); a failure is a warning, never the run's."""
        from .plot import write_plot

        try:
            return write_plot(self.config.logging.output_dir)
        except Exception as err:
            print(f"WARNING: --plot: loss.png not written ({type(err).__name__}: {err})",
                  flush=True)
            return None

    def close_outputs(self, failed: bool) -> None:
        """The writer and the trackers (also those started before the writer existed)."""
        from .trackers import close_quietly

        if self.writer is not None:
            self.writer.close(failed=failed)
        else:
            for tracker in self.trackers:
                close_quietly(tracker, failed=failed)
        self.trackers = []


# What a micro-batch holds along the sequence (dim 1; the attention mask's query rows,
# dim 2): what megatron's context-parallel split cuts. Packed rows' segment ids are cut with
# them: rlhf sums each sequence's values by segment, on each rank over its own positions.
SEQUENCE_FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask",
                   "segment_ids", "padding_mask")


# rlhf rows beside them: KTO's KL rows (the same fields, prefixed) and ORPO's mask of every
# position of a row (cut like loss_mask)
SEQUENCE_PREFIXES = ("", "kl_")
ROW_MASKS = ("sequence_mask",)


def on_this_cp_rank(batch: Dict[str, torch.Tensor], cp: int) -> Dict[str, torch.Tensor]:
    """This context-parallel rank's two of the 2 x CP sequence chunks, by megatron's own
    split (``get_batch_on_this_cp_rank``: chunks r and 2CP-1-r; the attention mask keeps
    every key column). The input-token count is the whole micro-batch's share per rank, so
    that the sum over the group is the micro-batch's."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    full = batch.get("num_tokens", batch["tokens"].numel())
    split = {}
    for prefix in SEQUENCE_PREFIXES:
        # megatron's split reads the field's name for its sequence axis: unprefixed here
        fields = {k: batch[prefix + k] for k in SEQUENCE_FIELDS if prefix + k in batch}
        if fields:
            split.update({prefix + k: v for k, v in get_batch_on_this_cp_rank(fields).items()})
    for name in ROW_MASKS:
        if name in batch:
            split[name] = get_batch_on_this_cp_rank({"loss_mask": batch[name]})["loss_mask"]
    return {**batch, **split, "num_tokens": torch.as_tensor(full, dtype=torch.float) / cp}


def model_is_training(model_chunks) -> bool:
    return model_chunks[0].training
