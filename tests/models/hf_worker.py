"""One rank of a TP or PP run (started by torchrun): load an HF folder into the sharded
model, write the full logits of fixed tokens, and save a weights-only checkpoint."""

import argparse
import os

import torch


def forward_logits(model_chunks, ids, packed=None):
    """Logits [batch, seq, padded vocab] through megatron's pipeline schedule, gathered over
    tensor-parallel ranks; None off the last pipeline stage. ``packed`` (the document of each
    position and its position in it, [batch, seq] each) packs documents into the rows under
    their block-causal mask, as sft --packing does."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, length = ids.shape
    position_ids = torch.arange(length).unsqueeze(0).expand(batch, length)
    mask = None
    if packed is not None:
        from swift_mcore.data.packing import block_causal_mask

        segments, position_ids = packed
        mask = block_causal_mask(segments)

    def step(data_iterator, model):
        output = model(input_ids=next(data_iterator), position_ids=position_ids,
                       attention_mask=mask)
        return output, None  # no loss function: megatron keeps the output

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([ids]), model=model_chunks,
            num_microbatches=1, seq_length=length, micro_batch_size=batch,
            decoder_seq_length=length, forward_only=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return gather_from_tensor_model_parallel_region(outputs[0])


def main():
    from swift_mcore.arguments import RunArguments
    from swift_mcore.checkpointing import TrainState, save_checkpoint
    from swift_mcore.data import build_tokenizer
    from swift_mcore.models.gpt import build_model
    from swift_mcore.models.hf_load import load_hf_weights
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import distributed, seed

    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--out")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--tokens")
    parser.add_argument("--packed")  # packed rows: saved (segment ids, position ids)
    parser.add_argument("--sequence_parallel", action="store_true")
    parser.add_argument("--etp", type=int, default=None)  # --expert_tensor_parallel_size
    parser.add_argument("--mtp_num_layers", type=int, default=None)
    parser.add_argument("--first_stage_layers", type=int, default=None)  # uneven stages
    cli = parser.parse_args()
    ids = torch.load(cli.tokens)
    args = RunArguments.from_flags(
        model=cli.model, tensor_model_parallel_size=cli.tp, pipeline_model_parallel_size=cli.pp,
        seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
        global_batch_size=ids.shape[0] * int(os.environ["WORLD_SIZE"]) // (cli.tp * cli.pp),
        output_dir=cli.out, no_save_optim=True, sequence_parallel=cli.sequence_parallel,
        expert_tensor_parallel_size=cli.etp, mtp_num_layers=cli.mtp_num_layers,
        decoder_first_pipeline_num_layers=cli.first_stage_layers)
    config = resolve(args)  # the world size from torchrun's WORLD_SIZE
    distributed.initialize(config)
    seed.set_seed(config.training.seed)
    # The padded vocabulary follows the model's (config.json's vocab_size) and the TP size.
    config = config.complete(build_tokenizer(config).vocab_size, None)
    chunks = build_model(config)
    load_hf_weights(config, chunks, log=lambda line: None)
    logits = forward_logits(chunks, ids, torch.load(cli.packed) if cli.packed else None)
    last = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    if logits is not None and last:
        torch.save(logits[..., : config.model.vocab_size].contiguous(),
                   os.path.join(cli.out, "logits.pt"))
    save_checkpoint(config, TrainState(), chunks, None, None, None)
    distributed.shutdown()


if __name__ == "__main__":
    main()
    os._exit(0)  # gloo's threads may abort during interpreter teardown (DESIGN.md)
