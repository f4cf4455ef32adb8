"""The Trainer: builds every part in DESIGN.md's order, then runs the training loop."""

from __future__ import annotations

import logging
import os
import signal
import time
from functools import partial
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from ..errors import ArgumentError
from ..arguments import PretrainArguments, padded_vocab_size
from ..checkpointing.state import TrainState
from ..runtime import distributed, run_lock, seed
from .metrics import LogWindow, flops_per_token
from .writers import MetricWriter, format_log_line

logger = logging.getLogger("swift_mcore")


class Trainer:
    """``Trainer(args).train()``. Subclasses override ``forward_step`` or ``compute_loss``."""

    def __init__(self, args: PretrainArguments):
        if args.derived is None:
            args.validate()
        self.args = args
        self.start_time = time.time()
        self.state = TrainState()
        self._stop_signal: Optional[int] = None
        self._sample_ids: List[torch.Tensor] = []

    # ---- the loop -----------------------------------------------------------------------
    def train(self) -> TrainState:
        self.setup()
        args, state = self.args, self.state
        total = args.training.train_iters
        exit_reason = None
        while state.iteration < total:
            step = self.train_step()
            self.advance(step)
            self.report(step)
            if self.due(args.logging.eval_steps):
                self.evaluate()
            exit_reason = self.exit_reason()
            if exit_reason or self.due(args.checkpoint.save_steps):
                self.save_checkpoint()
            if exit_reason:
                break
        if not exit_reason and state.iteration == total and not self.saved_at_current():
            self.save_checkpoint()
        if not exit_reason and args.checkpoint.save_safetensors:
            self.save_hf_folder()
        self.finish(exit_reason)
        return state

    # ---- setup (DESIGN.md: model, ddp, optimizer, checkpoint, then the data iterators) ----
    def setup(self) -> None:
        from .. import data
        from ..models.gpt import build_model, count_parameters
        from ..runtime.ddp import wrap_model
        from .optimizer import build_optimizer, build_scheduler

        args = self.args
        distributed.initialize(args)
        # Before any work: one run per --output_dir (runtime/run_lock.py).
        run_lock.acquire_for_run(args.logging.output_dir, f"swift-mcore {args.COMMAND}")
        self.tokenizer = data.build_tokenizer(args)
        self.padded_vocab_size = self.resolve_vocab(self.tokenizer)
        seed.set_seed(args.training.seed)
        # The datasets (not their iterators) come first: bad data stops the run before the
        # model is built, and --num_train_epochs needs the training set's size.
        self.train_ds, self.valid_ds, self.test_ds = self.build_datasets()
        self.data_fingerprint = data.dataset_fingerprint(self.train_ds)
        args.resolve_train_iters(len(self.train_ds))
        self.model = wrap_model(args, build_model(args, self.padded_vocab_size))
        self.load_pretrained_weights()
        self.num_parameters = self.count_all_parameters(count_parameters(self.model))
        config = self.model[0].config
        from megatron.core.distributed import finalize_model_grads

        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = [chunk.no_sync for chunk in self.model]
        if len(self.model) == 1:
            config.no_sync_func = config.no_sync_func[0]
        self.optimizer = build_optimizer(args, self.model)
        config.grad_scale_func = self.optimizer.scale_loss
        self.scheduler = build_scheduler(args, self.optimizer)
        self.state = self.load_checkpoint()
        self.train_iterator = self.build_iterator(self.train_ds,
                                                  self.state.consumed_train_samples)
        self.valid_iterator = self.build_iterator(self.valid_ds,
                                                  self.state.consumed_valid_samples)
        self.writer = self.build_writer()
        self.flops_per_token = flops_per_token(args, self.padded_vocab_size)
        self.log_window = LogWindow(self.flops_per_token, args.derived.world_size)
        self.install_signal_handlers()
        self.log_start()

    def build_datasets(self):
        """(train, valid, test): megatron's GPT datasets for pt, conversation rows for sft."""
        from .. import data

        if self.args.COMMAND == "sft":
            from ..data.sft_datasets import build_sft_datasets

            return build_sft_datasets(self.args, self.tokenizer, log=self.writer_print_early)
        return data.build_datasets(self.args, self.tokenizer)

    def load_pretrained_weights(self) -> None:
        """--model: the Hugging Face weights, after the model is built and before the optimizer
        takes its copy of the parameters (a resumed checkpoint then replaces them)."""
        if self.args.model.model:
            from ..models.hf_load import load_hf_weights

            load_hf_weights(self.args, self.model, self.padded_vocab_size,
                            log=self.writer_print_early)

    def resolve_vocab(self, tokenizer) -> int:
        m, tp = self.args.model, self.args.parallel.tensor_model_parallel_size
        if m.vocab_size is not None and tokenizer.vocab_size > m.vocab_size:
            raise ArgumentError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but --vocab_size is "
                f"{m.vocab_size}; raise --vocab_size or leave it unset")
        return padded_vocab_size(m.vocab_size or tokenizer.vocab_size,
                                 m.make_vocab_size_divisible_by, tp)

    def build_iterator(self, dataset, consumed_samples: int) -> Optional[Iterator]:
        from megatron.core import parallel_state
        from ..data import build_data_iterator

        return build_data_iterator(
            dataset, consumed_samples, self.args,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size())

    def build_writer(self) -> MetricWriter:
        lg = self.args.logging
        return MetricWriter(lg.output_dir, self.args.training.train_iters, self.state.iteration,
                            active=distributed.is_last_rank(), tensorboard=lg.tensorboard,
                            progress_bar=lg.progress_bar)

    # ---- one iteration ------------------------------------------------------------------
    def train_step(self) -> Dict[str, float]:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._sample_ids = []
        losses = self.forward_backward(self.train_iterator, forward_only=False)
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(increment=1)
        loss_sum, targets, tokens = self.reduce_losses(losses)
        return {
            "loss": loss_sum / max(targets, 1.0) if targets is not None else None,
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm,
            "skipped": 0.0 if update_successful else 1.0,
            "tokens": tokens,
        }

    def forward_backward(self, data_iterator, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        args = self.args
        return get_forward_backward_func()(
            forward_step_func=self.forward_step,
            data_iterator=data_iterator,
            model=self.model,
            num_microbatches=args.derived.num_microbatches,
            seq_length=args.model.seq_length,
            micro_batch_size=args.training.micro_batch_size,
            decoder_seq_length=args.model.seq_length,
            forward_only=forward_only,
        )

    def forward_step(self, data_iterator, model):
        """One micro-batch through one model chunk: returns (output, loss function)."""
        batch = self.get_batch(data_iterator)
        output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                       attention_mask=batch.get("attention_mask"), labels=batch["labels"],
                       packed_seq_params=batch.get("packed_seq_params"))
        return output, partial(self.compute_loss, batch)

    def get_batch(self, data_iterator) -> Dict[str, torch.Tensor]:
        """The next micro-batch on this rank's device. Packed rows (sft --packing) get the
        mask that keeps their conversations apart: a block-diagonal causal mask for
        megatron's local attention, variable-length parameters for Transformer Engine's."""
        batch = next(data_iterator)
        if model_is_training(self.model):
            self._sample_ids.append(batch["sample_ids"])
        if torch.cuda.is_available():
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        if "segment_ids" in batch:
            from ..data.packing import block_causal_mask, packed_seq_params
            from ..models.gpt import has_transformer_engine

            if has_transformer_engine():
                batch["packed_seq_params"] = packed_seq_params(batch["segment_ids"])
            else:
                batch["attention_mask"] = block_causal_mask(batch["segment_ids"])
        return batch

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
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        # A custom compute_loss may report (loss sum, targets) only: tokens then unknown.
        tokens = float(total[2]) if total.numel() > 2 else None
        return float(total[0]), float(total[1]), tokens

    def advance(self, step: Dict[str, float]) -> None:
        state, gbs = self.state, self.args.training.global_batch_size
        state.iteration += 1
        state.consumed_train_samples += gbs
        if step.get("skipped"):
            state.skipped_train_samples += gbs
        # Real tokens where this rank knows them (the last pipeline stage), else a full batch.
        tokens = step.get("tokens")
        if tokens is None:
            tokens = gbs * self.args.model.seq_length
        state.floating_point_operations_so_far += tokens * self.flops_per_token
        if self.args.logging.log_sample_ids:
            self.write_sample_ids()

    # ---- validation ---------------------------------------------------------------------
    def evaluate(self) -> Optional[Dict[str, float]]:
        if self.valid_iterator is None:
            return None
        for chunk in self.model:
            chunk.eval()
        loss_sum = tokens = 0.0
        with torch.no_grad():
            for _ in range(self.args.logging.eval_iters):
                s, n, _ = self.reduce_losses(
                    self.forward_backward(self.valid_iterator, True))
                if s is not None:
                    loss_sum, tokens = loss_sum + s, tokens + n
                self.state.consumed_valid_samples += self.args.training.global_batch_size
        for chunk in self.model:
            chunk.train()
        if not self.writer.active:
            return None
        val_loss = loss_sum / max(tokens, 1.0)
        metrics = {"val_loss": val_loss, "val_ppl": float(torch.tensor(val_loss).exp())}
        self.writer.record(self.state.iteration, metrics, prefix="valid")
        self.writer.print(format_log_line(self.state.iteration,
                                          self.args.training.train_iters, metrics))
        return metrics

    # ---- reporting ----------------------------------------------------------------------
    def report(self, step: Dict[str, float]) -> None:
        """Progress bar every iteration; a log line with the window's averages every
        --log_interval iterations and at the last one."""
        it, total = self.state.iteration, self.args.training.train_iters
        self.writer.step(it, step.get("loss"))
        self.log_window.add(step)
        if it % self.args.logging.log_interval == 0 or it == total:
            metrics = self.log_window.flush()
            self.writer.record(it, metrics)
            self.writer.print(format_log_line(it, total, metrics))

    def write_sample_ids(self) -> None:
        """Audit log: the global sample positions this iteration really fed the model."""
        from megatron.core import parallel_state

        mine = torch.cat(self._sample_ids) if self._sample_ids else torch.zeros(0)
        group = parallel_state.get_data_parallel_group()
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine.tolist(), group=group)
        if self.writer.active:
            ids = sorted(i for part in gathered for i in part)
            path = os.path.join(self.args.logging.output_dir, "sample_ids.jsonl")
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(f'{{"iteration": {self.state.iteration}, "sample_ids": {ids}}}\n')

    def log_start(self) -> None:
        a, d = self.args, self.args.derived
        self.writer.print(
            f"swift-mcore: {self.num_parameters / 1e6:.2f}M parameters, "
            f"vocab {self.tokenizer.vocab_size} (padded {self.padded_vocab_size}), "
            f"world {d.world_size} = TP {a.parallel.tensor_model_parallel_size} x "
            f"PP {a.parallel.pipeline_model_parallel_size} x DP {d.data_parallel_size}, "
            f"global batch {a.training.global_batch_size} = micro {a.training.micro_batch_size}"
            f" x {d.num_microbatches} micro-batches x DP {d.data_parallel_size}, "
            f"seq {a.model.seq_length}, starting at iteration {self.state.iteration} "
            f"({self.state.consumed_train_samples} samples consumed)")

    def count_all_parameters(self, local: int) -> int:
        """Parameters of the whole model: summed over TP and PP ranks of one replica."""
        from megatron.core import parallel_state

        total = torch.tensor([float(local)])
        dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
        return int(total.item())

    # ---- stopping and saving ------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        def handler(signum, frame):
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._stop_signal = signum

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, handler)

    def exit_reason(self) -> Optional[str]:
        """Why to stop after this iteration, agreed by all ranks (a signal may reach one)."""
        c = self.args.checkpoint
        code = 0
        if self._stop_signal is not None:
            code = 3
        elif c.exit_interval and self.state.iteration % c.exit_interval == 0:
            code = 2
        elif c.exit_duration_in_mins and (
                time.time() - self.start_time) / 60 >= c.exit_duration_in_mins:
            code = 1
        flag = torch.tensor([code], dtype=torch.int)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return {0: None, 1: "--exit_duration_in_mins reached", 2: "--exit_interval reached",
                3: "stop signal received"}[int(flag.item())]

    def due(self, every: Optional[int]) -> bool:
        return bool(every) and self.state.iteration % every == 0

    def saved_at_current(self) -> bool:
        return getattr(self, "_last_saved_iteration", None) == self.state.iteration

    def save_checkpoint(self) -> Optional[str]:
        if self.args.checkpoint.no_save or self.saved_at_current():
            return None
        from ..checkpointing import save_checkpoint

        path = save_checkpoint(self.args, self.state, self.model, self.optimizer,
                               self.scheduler, self.data_fingerprint)
        self._last_saved_iteration = self.state.iteration
        self.writer.print(f"saved checkpoint {path} (iteration {self.state.iteration}, "
                          f"{self.state.consumed_train_samples} samples consumed)")
        return path

    def save_hf_folder(self) -> str:
        """--save_safetensors: the final checkpoint as a Hugging Face folder next to it
        (iter_NNNNNNN-hf), converted by `swift-mcore export --to_hf` in a child process."""
        import shutil

        from ..checkpointing import checkpoint_root, comm, iter_dir_name
        from ..export import export_in_subprocess

        checkpoint = os.path.join(checkpoint_root(self.args), iter_dir_name(self.state.iteration))
        out = f"{checkpoint}-hf"

        def export() -> str:
            shutil.rmtree(out, ignore_errors=True)  # an earlier export of this iteration
            return export_in_subprocess(checkpoint, out)

        line = comm.decide(export)
        self.writer.print(f"--save_safetensors: {line}")
        return out

    def load_checkpoint(self) -> TrainState:
        from ..checkpointing import load_checkpoint

        return load_checkpoint(self.args, self.model, self.optimizer, self.scheduler,
                               self.data_fingerprint, log=self.writer_print_early)

    def writer_print_early(self, text: str) -> None:
        if distributed.is_last_rank():
            print(text, flush=True)

    def finish(self, exit_reason: Optional[str]) -> None:
        lg = self.args.logging
        out = os.path.abspath(lg.output_dir)
        lines = [f"finished at iteration {self.state.iteration}"
                 + (f" ({exit_reason})" if exit_reason else "")]
        if not self.args.checkpoint.no_save:
            lines.append(f"  checkpoints:  {os.path.join(out, 'checkpoint')}")
        lines.append(f"  metrics:      {os.path.join(out, 'metrics.jsonl')}")
        if lg.tensorboard:
            lines.append(f"  tensorboard:  tensorboard --logdir {os.path.join(out, 'runs')}")
        if lg.log_sample_ids:
            lines.append(f"  sample ids:   {os.path.join(out, 'sample_ids.jsonl')}")
        self.writer.close()
        if self.writer.active:
            print("\n".join(lines), flush=True)
        distributed.barrier()  # every rank is done with output_dir
        run_lock.release(lg.output_dir)


def model_is_training(model_chunks) -> bool:
    return model_chunks[0].training
