"""Runtime: process groups, seeds, and the CPU adaptation of megatron-core."""
