"""The `swift-mcore rlhf` Trainer: DPO on preference pairs, the policy against a frozen
reference, on the base Trainer's loop, data order, checkpoints and export.

The reference holds no optimizer state and no gradients: a second, frozen copy of the model
(the starting weights, or --ref_model), or with --tuner_type lora the policy itself with
its adapters switched off (no second copy); --reference_free builds none.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Dict, List, Optional

import torch

from ..runtime import collectives, cpu
from .dpo_loss import METRICS, DpoLoss, reward_metrics
from .moe_padding import routing_padding
from .trainer import Trainer, on_this_cp_rank
from .writers import format_log_line


class DpoTrainer(Trainer):
    """``DpoTrainer(RlhfArguments...).train()``; ``self.reference`` is the frozen reference's
    chunks (None when the LoRA policy serves as its own reference, or --reference_free)."""

    # the metrics the log line, metrics.jsonl and the trackers carry after the usual fields
    METRIC_NAMES = (*METRICS, "nll_loss")

    def __init__(self, args):
        super().__init__(args)
        self.dpo = DpoLoss.from_config(self.config.rlhf)
        self.reference: Optional[List[torch.nn.Module]] = None
        self._losses = None  # the last forward_backward's per-micro-batch reports
        self._window: List[Dict[str, float]] = []  # preference metrics since the last log
        # --precompute_ref_log_probs: [pairs, 2] (chosen, rejected), by pair index
        self.ref_table: Optional[torch.Tensor] = None

    # ---- data -------------------------------------------------------------------------
    def fingerprint_data(self) -> str:
        """The data's fingerprint with the reference's identity after it: a checkpoint
        records both, and a resume against another reference is refused
        (checkpointing/compat.py names --ref_model)."""
        from ..checkpointing.compat import with_reference
        from ..data.preference import preference_fingerprint

        if self.config.rlhf.ref_model:  # before anything is read or built
            check_reference_folder(self.config, self.tokenizer)
        return with_reference(preference_fingerprint(self.config, self.tokenizer),
                              reference_identity(self.config))

    def build_datasets(self):
        from ..data.preference import build_preference_datasets

        return build_preference_datasets(self.config, self.tokenizer,
                                         log=self.writer_print_early)

    # ---- the models -------------------------------------------------------------------
    def build_model(self) -> list:
        from ..models import lora

        chunks = super().build_model()
        r = self.config.rlhf
        if r.packing and self.config.world.pipeline_parallel > 1:
            # a micro-batch packs into as many rows as its pairs need: the stages tell each
            # other each exchange's shape (megatron's variable_seq_lengths) instead of
            # padding every micro-batch to the largest
            for chunk in chunks:
                _stage_model(chunk).config.variable_seq_lengths = True
        if r.reference_free:
            what = "none (--reference_free: reference log-probabilities are 0)"
        elif r.ref_model:
            self.reference = self.build_reference(r.ref_model)
            what = f"--ref_model {r.ref_model}"
        elif lora.enabled(self.config):
            what = "the base model with the LoRA adapters switched off (no second copy)"
        else:
            self.reference = self.build_reference(None, copy_from=chunks)
            what = "a frozen copy of the starting weights"
        self.writer_print_early(f"rlhf {r.rlhf_type}: reference model: {what}; loss "
                                f"{self.describe_loss()}, beta {r.beta}")
        if r.precompute_ref_log_probs:
            self.ref_table = self.precompute_reference(chunks)
        return chunks

    def precompute_reference(self, chunks) -> torch.Tensor:
        """The reference's log-probabilities of every pair: read from the run folder when
        computed there before for the same data and reference, else computed in one pass
        (in the pairs' order, --micro_batch_size at a time) and stored; the reference
        model is freed after."""
        from . import ref_log_probs

        path = ref_log_probs.path_in(self.config.logging.output_dir)
        table = ref_log_probs.read(path, self.data_fingerprint, len(self.train_ds))
        if table is not None:
            self.writer_print_early(f"rlhf: reference log-probabilities of "
                                    f"{len(table)} pairs read from {path}")
        elif self.config.world.pipeline_parallel > 1:
            table = self.reference_in_stages(chunks)
            self.store_reference_table(path, table)
        else:
            device = self.device()

            def forward(batch):
                batch = {k: v.to(device) for k, v in batch.items()}
                mask = None
                if "segment_ids" in batch:  # --packing
                    from ..data.packing import block_causal_mask

                    mask = block_causal_mask(batch["segment_ids"])
                cp = self.config.world.context_parallel
                if cp > 1:  # every CP rank runs the same pairs: its two chunks of each row
                    batch = on_this_cp_rank({**batch, "attention_mask": mask}, cp)
                    mask = batch["attention_mask"]
                # the frozen copy, or the LoRA policy with its adapters off
                frozen = self.reference[0] if self.reference is not None else None
                with torch.no_grad(), (contextlib.nullcontext(frozen) if frozen is not None
                                       else self.reference_of(chunks[0])) as reference:
                    losses = reference(input_ids=batch["tokens"],
                                       position_ids=batch["position_ids"],
                                       attention_mask=mask, labels=batch["labels"])
                return over_cp(sequence_sums(-(losses.float() * batch["loss_mask"]), batch))

            table = ref_log_probs.compute(self.train_ds, self.config.training.micro_batch_size,
                                          forward)
            self.store_reference_table(path, table)
        self.reference = None  # freed: training reads the table
        return table

    def store_reference_table(self, path: str, table: torch.Tensor) -> None:
        import torch.distributed as dist

        from . import ref_log_probs

        if not dist.is_initialized() or dist.get_rank() == 0:
            ref_log_probs.write(path, table, self.data_fingerprint)
        self.writer_print_early(f"rlhf: reference log-probabilities of {len(table)} "
                                f"pairs computed and stored in {path}")

    def reference_in_stages(self, chunks) -> torch.Tensor:
        """The reference's log-probabilities of every pair under pipeline parallelism: one
        forward-only pass of megatron's schedule through the reference's stages (the frozen
        copy, or the LoRA policy with its adapters off), then the last stage's table summed
        over the pipeline group (the other stages hold zeros), so every rank holds it."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from . import ref_log_probs

        device = self.device()
        micro = self.config.training.micro_batch_size
        frozen = self.reference is not None
        cp = self.config.world.context_parallel

        def forward_step(data_iterator, chunk):
            batch = {k: v.to(device) for k, v in self.micro_batch(data_iterator, next).items()}
            if cp > 1:  # every CP rank of a stage runs the same pairs: its chunks of each row
                batch = on_this_cp_rank(batch, cp)
            with (contextlib.nullcontext(chunk) if frozen
                  else self.reference_of(chunk)) as reference:
                losses = reference(input_ids=batch["tokens"],
                                   position_ids=batch["position_ids"], attention_mask=None,
                                   labels=batch["labels"])

            def collect(output, non_loss_data=True):
                return over_cp(sequence_sums(-(output.float() * batch["loss_mask"]), batch))

            return losses, collect

        model = self.reference if frozen else chunks

        def run(batches, count):
            if len(model) > 1:  # the interleaved schedule: one feed per model chunk
                from .chunk_feed import ChunkFeed

                batches = ChunkFeed.for_chunks(batches, len(model))
            with torch.no_grad():
                return get_forward_backward_func()(
                    forward_step_func=cpu.wrap_forward_step(forward_step, self.config),
                    data_iterator=batches, model=model,
                    num_microbatches=count, seq_length=self.config.model.seq_length,
                    micro_batch_size=2 * micro, decoder_seq_length=self.config.model.seq_length,
                    forward_only=True, collect_non_loss_data=True)

        # the interleaved schedule runs the micro-batches in groups of the stage count
        groups = (self.config.world.pipeline_parallel
                  if self.config.args.virtual_stages() else 1)
        table = ref_log_probs.compute_in_stages(self.train_ds, micro, run, groups)
        return collectives.all_reduce(
            table, group=parallel_state.get_pipeline_model_parallel_group()).cpu()

    def describe_loss(self) -> str:
        return describe_loss(self.dpo)

    def build_reference(self, folder: Optional[str], copy_from=None) -> list:
        """Frozen model chunks in eval mode: ``folder``'s Hugging Face weights, or a copy of
        ``copy_from`` (the policy's starting weights, before any adapter or checkpoint)."""
        import copy
        import dataclasses

        from ..models.gpt import build_model
        from ..models.hf_load import load_hf_weights

        chunks = build_model(self.config)
        if folder is not None:
            args = copy.deepcopy(self.config.args)
            object.__setattr__(args.model, "model", folder)
            load_hf_weights(dataclasses.replace(self.config, args=args), chunks,
                            log=self.writer_print_early)
        else:
            for ref, policy in zip(chunks, copy_from):
                ref.load_state_dict(base_state(policy))
        for chunk in chunks:
            chunk.requires_grad_(False)
            chunk.eval()
        return chunks

    @contextlib.contextmanager
    def reference_of(self, model):
        """The reference model for ``model`` (a policy chunk): the frozen copy, or the policy
        with its LoRA adapters switched off for the duration."""
        if self.reference is not None:
            index = next((i for i, chunk in enumerate(self.model) if chunk is model), 0)
            yield self.reference[index]
            return
        from ..models.lora_layer import LoraParallelLinear

        layers = [m for m in model.modules() if isinstance(m, LoraParallelLinear)]
        for layer in layers:
            layer._disable_adapters = True
        try:
            yield model
        finally:
            for layer in layers:
                layer._disable_adapters = False

    # ---- one micro-batch --------------------------------------------------------------
    def micro_batch(self, data_iterator, get_batch=None):
        """The next micro-batch (``get_batch``: the trainer's); under the interleaved
        schedule every model chunk of a rank reads the same ones (chunk_feed.py)."""
        get_batch = get_batch or self.get_batch
        if hasattr(data_iterator, "next_batch"):
            return data_iterator.next_batch(get_batch)
        return get_batch(data_iterator)

    def forward_step(self, data_iterator, model):
        batch = self.micro_batch(data_iterator)
        inputs = dict(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                      attention_mask=batch.get("attention_mask"), labels=batch["labels"])
        # the policy's routers only: the reference runs without autograd, which they skip
        padding = routing_padding(self.config, model, batch)
        if self.ref_table is not None:
            ref = self.ref_table[batch["pair_index"].cpu()]
            batch["ref_logps"] = torch.cat([ref[:, 0], ref[:, 1]]).to(batch["tokens"].device)
        elif not self.config.rlhf.reference_free:
            # Under pipeline parallelism a stage receives the policy's rows, then the
            # reference's, side by side on the batch axis, and passes them on so.
            received = stage_input(model)
            rows = batch["tokens"].shape[0]
            with torch.no_grad(), self.reference_of(model) as reference:
                if received is not None:
                    set_stage_input(reference, received[:, rows:])
                ref_out = reference(**inputs)
            if received is not None:
                set_stage_input(model, received[:, :rows])
            if is_last_stage(model):
                batch["ref_logps"] = over_cp(sequence_sums(
                    -(ref_out.float() * batch["loss_mask"]), batch))
            else:
                return torch.cat([model(**inputs, **padding), ref_out], dim=1), \
                    partial(self.compute_loss, batch)
        output = model(**inputs, **padding)
        return output, partial(self.compute_loss, batch)

    def rows_per_micro_batch(self) -> int:
        """A pair is two rows (chosen, rejected); under pipeline parallelism the reference's
        rows travel beside the policy's."""
        pairs = self.config.training.micro_batch_size
        if self.config.world.pipeline_parallel == 1:
            return pairs  # megatron reads it for the stages' exchanges only
        in_loop = self.config.rlhf.needs_reference() and self.ref_table is None
        return 2 * pairs * (2 if in_loop else 1)

    def compute_loss(self, batch, output_tensor):
        """(sum of the pairs' losses, pair count, report): megatron divides the gradients by
        the global batch's pairs, so the loss is the mean over pairs, as TRL's."""
        mask = batch["loss_mask"].float()
        logps = over_cp(sequence_sums(-(output_tensor.float() * mask), batch))
        pairs = logps.shape[0] // 2
        chosen_tokens = over_cp(mask[:pairs].sum() if "segment_ids" not in batch
                                else sequence_sums(mask, batch)[:pairs].sum())
        ref = batch.get("ref_logps")
        if ref is None:
            ref = torch.zeros_like(logps)
        lengths = batch["completion_lengths"].to(logps.device)
        out = self.dpo(logps[:pairs], logps[pairs:], ref[:pairs], ref[pairs:],
                       lengths[:pairs], lengths[pairs:], chosen_tokens)
        loss_sum = out["loss"].sum()
        tokens = torch.as_tensor(batch.get("num_tokens", batch["tokens"].numel()),
                                 dtype=torch.float, device=logps.device)
        count = torch.tensor(float(pairs), device=logps.device)
        report = {"lm loss": torch.stack([loss_sum.detach(), count, tokens]),
                  "rlhf": torch.cat([reward_metrics(self.dpo.beta, logps[:pairs],
                                                    logps[pairs:], ref[:pairs], ref[pairs:]),
                                     out["nll"].detach().sum().reshape(1)])}
        # every CP rank holds the whole loss (over_cp), each differentiating through its own
        # tokens; megatron sums the gradients and the counts over DP x CP: one rank counts
        # the pairs. The report's sum and count are both CP times theirs: the mean holds.
        counted = pairs if first_cp_rank() else 0
        return loss_sum, torch.tensor(counted, dtype=torch.int, device=logps.device), report

    # ---- metrics ----------------------------------------------------------------------
    def forward_backward(self, data_iterator, forward_only: bool):
        self._losses = super().forward_backward(data_iterator, forward_only)
        return self._losses

    def train_step(self) -> Dict[str, float]:
        step = super().train_step()
        step.update(self.preference_metrics(self._losses))
        return step

    def preference_metrics(self, losses) -> Dict[str, float]:
        """TRL's metrics (means over the global batch's pairs), on the last pipeline stage."""
        from megatron.core import parallel_state

        if not losses or not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return {}
        sums = torch.stack([torch.cat([e["rlhf"], e["lm loss"][1:2]]) for e in losses]).sum(0)
        sums = collectives.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        values = sums.tolist()
        pairs = max(values[-1], 1.0)
        metrics = {name: v / pairs for name, v in zip(METRICS, values)}
        if "sft" in self.dpo.loss_types:
            metrics["nll_loss"] = values[len(METRICS)] / pairs
        return metrics

    def report(self, step: Dict[str, float]) -> None:
        """The base log line with TRL's metric names after it (averaged over the window)."""
        it, total = self.state.iteration, self.config.training.train_iters
        self.writer.step(it, step.get("loss"))
        self.log_window.add(step)
        names = [n for n in self.METRIC_NAMES if step.get(n) is not None]
        self._window.append({n: step[n] for n in names})
        if it % self.config.logging.log_interval == 0 or it == total:
            metrics = self.log_window.flush()
            for name in names:
                values = [s[name] for s in self._window if name in s]
                metrics[name] = sum(values) / len(values)
            self._window = []
            self.writer.record(it, metrics)
            extra = " | ".join(f"{n} {metrics[n]:.4f}" for n in names)
            line = format_log_line(it, total, metrics)
            self.writer.print(f"{line} | {extra}" if extra else line)


def _stage_model(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def stage_input(chunk) -> Optional[torch.Tensor]:
    """The activations a pipeline stage received for this micro-batch ([s, b, h]); None on
    the first stage (and without pipeline parallelism)."""
    model = _stage_model(chunk)
    return None if model.pre_process else model.decoder.input_tensor


def set_stage_input(chunk, tensor: torch.Tensor) -> None:
    _stage_model(chunk).decoder.set_input_tensor(tensor)


def is_last_stage(chunk) -> bool:
    """Whether the chunk ends in the output layer (it returns per-token losses)."""
    return bool(_stage_model(chunk).post_process)


def over_cp(values: torch.Tensor) -> torch.Tensor:
    """A sum over this rank's part of each sequence -> over the whole sequence: summed over
    the context-parallel group (megatron's reduce: all-reduce forward, its gradient passed
    on unchanged, each rank's to its own tokens)."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.get_context_parallel_world_size() == 1:
        return values
    return tensor_parallel.reduce_from_tensor_model_parallel_region(
        values, group=parallel_state.get_context_parallel_group())


def first_cp_rank() -> bool:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_rank() == 0


def sequence_sums(values: torch.Tensor, batch, count: Optional[int] = None,
                  prefix: str = "") -> torch.Tensor:
    """[rows, positions] -> one sum per sequence (pairs: chosen sequences first): a row's
    sum, or with --packing (``segment_ids``: each position's sequence, -1 padding) each
    segment's. ``count``: how many sequences (default: the pairs' 2B); ``prefix``: whose
    segment ids (KTO's KL rows are ``kl_``)."""
    segments = batch.get(prefix + "segment_ids")
    if segments is None:
        return values.sum(1)
    real = segments >= 0
    if count is None:
        count = batch["completion_lengths"].numel()
    return values.new_zeros(count).index_add(0, segments[real], values[real])


def check_reference_folder(config, tokenizer) -> None:
    """--ref_model must be the policy's architecture and vocabulary: every tensor of the
    same name and shape, and its tokenizer (where the folder has one) the policy's
    ``tokenizer`` (else ArgumentError naming the flag and the first difference)."""
    from ..errors import ArgumentError
    from ..models.convert import Layout
    from ..models.hf_load import expected_hf_shapes
    from ..run_config import padded_vocab

    folder, m = config.rlhf.ref_model, config.model
    tokenizer_vocab = tokenizer.vocab_size
    try:
        theirs = expected_hf_shapes(folder)
    except (OSError, ValueError) as err:
        raise ArgumentError(f"--ref_model {folder}: not a Hugging Face model folder "
                            f"({type(err).__name__}: {str(err).splitlines()[0]})") from None
    vocab = m.vocab_size or tokenizer_vocab
    layout = Layout.from_model_args(
        m, padded_vocab(vocab, m.make_vocab_size_divisible_by, config.world.tensor_parallel))
    ours = dict(layout.hf_tensors())
    if layout.vocab is None or ours.get("model.embed_tokens.weight", (None,))[0] is None:
        ours["model.embed_tokens.weight"] = (vocab, m.hidden_size)
    for name in sorted(set(ours) | set(theirs)):
        if ours.get(name) != theirs.get(name):
            what = (f"has no {name}" if name not in theirs else
                    f"has {name} of shape {list(theirs[name])}, the policy "
                    + (f"{list(ours[name])}" if name in ours else "none"))
            raise ArgumentError(f"--ref_model {folder}: not the policy's architecture and "
                                f"vocabulary: it {what}")
    check_reference_config(config)
    check_reference_tokenizer(config, tokenizer)


def check_reference_config(config) -> None:
    """The reference runs in the policy's architecture: a config.json of other values (rope
    base, norm epsilon, activation, ...) or another family would be computed as the
    policy's, not as that model computes itself."""
    from ..errors import ArgumentError
    from ..models.families import TRAINING_KEYS, UnsupportedConfig, for_config
    from ..models.families.base import InvalidConfig
    from ..models.hf_folder import HFFolder

    folder, m = config.rlhf.ref_model, config.model
    ref = HFFolder(folder, flag="--ref_model")
    family = for_config(ref.config, ref.config_path)
    policy = HFFolder(m.model) if m.model else None
    ours = for_config(policy.config, policy.config_path) if policy else None
    if ours is not None and family.name != ours.name:
        raise ArgumentError(f"--ref_model {folder}: a {family.name} model, the policy a "
                            f"{ours.name} one; give a reference of the policy's family")
    try:
        values = {**family.fixed, **family.model_values(ref.config, m)}
    except (InvalidConfig, UnsupportedConfig) as err:
        raise ArgumentError(f"--ref_model {folder}: {ref.config_path} describes a model "
                            f"swift-mcore cannot run as the policy's: {err}") from None
    # the context length and the training-only keys change no log-probability
    skip = {"model_type", "max_position_embeddings", *TRAINING_KEYS}
    differ = [f"{name} {value!r} (the policy {getattr(m, name)!r})"
              for name, value in values.items()
              if name not in skip and hasattr(m, name) and getattr(m, name) != value]
    if differ:
        raise ArgumentError(f"--ref_model {folder}: its config.json is not the policy's "
                            f"architecture: {'; '.join(differ)}; its log-probabilities would "
                            f"be computed as the policy's model, not as its own")


def check_reference_tokenizer(config, tokenizer) -> None:
    """A reference of the policy's shapes but another tokenizer reads the same ids as other
    text: its log-probabilities would be of other answers. A folder without a tokenizer is
    taken to share the policy's."""
    from ..data.tokenizer import has_tokenizer_files, load_tokenizer
    from ..errors import ArgumentError

    folder = config.rlhf.ref_model
    if not has_tokenizer_files(folder):
        return
    theirs = load_tokenizer(folder, flag="--ref_model",
                            trust_remote_code=config.data.trust_remote_code)
    if theirs.fingerprint != tokenizer.fingerprint:
        raise ArgumentError(f"--ref_model {folder}: its tokenizer is not the policy's "
                            f"({tokenizer.source}): the same token ids are other text to it, "
                            f"so its log-probabilities would be of other answers; give a "
                            f"reference trained with the policy's tokenizer")


def reference_identity(config) -> str:
    """What the reference is, by content: sha256 of --ref_model's safetensors files, or of
    the starting weights (--model's files; the random initialization's seed without one)."""
    from ..models import lora

    r = config.rlhf
    if not r.needs_reference():
        return ("none (--reference_free)" if r.reference_free
                else f"none (--rlhf_type {r.rlhf_type})")
    if r.ref_model:
        return "sha256:" + lora.folder_fingerprint(r.ref_model)
    return lora.base_reference(config, config.cuda)


def base_state(chunk) -> dict:
    """A model chunk's state dict (unwrapped from DDP and precision wrappers)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk.state_dict()


def describe_loss(dpo: DpoLoss) -> str:
    if len(dpo.loss_types) == 1:
        return dpo.loss_types[0]
    return " + ".join(f"{w:g}*{t}" for t, w in zip(dpo.loss_types, dpo.loss_weights))
