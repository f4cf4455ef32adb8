"""megatron's distributed optimizer (ZeRO-1) on CPU: its parameter sorting, the gather of its
state for a checkpoint, and a load into torch's Adam, where megatron expects CUDA or apex."""

from __future__ import annotations

import contextlib
import functools

import torch


@contextlib.contextmanager
def cpu_parameters_named_as_cuda():
    """While it lasts, ``Parameter.type()`` of a CPU parameter answers with the CUDA name of
    its dtype ('torch.cuda.FloatTensor'). megatron's ``DistributedOptimizer`` sorts the
    parameters it shards by that string and refuses any other (distrib_optimizer.py:361,
    420, 582): a CPU fp32 parameter then takes the path a CUDA fp32 one takes. ``type``
    with arguments (a conversion) is torch's own."""
    saved = torch.nn.Parameter.__dict__.get("type")

    def type_name(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return torch.Tensor.type(self).replace("torch.", "torch.cuda.", 1)
        return torch.Tensor.type(self, dtype, non_blocking, **kwargs)

    torch.nn.Parameter.type = type_name
    try:
        yield
    finally:
        if saved is None:
            del torch.nn.Parameter.type
        else:
            torch.nn.Parameter.type = saved


@contextlib.contextmanager
def cuda_moves_stay_on_cpu():
    """While it lasts, ``Tensor.cuda()`` returns the tensor itself. The gather of the
    optimizer state for a checkpoint moves each rank's shard to the GPU before all-gathering
    it over the data-parallel group (distrib_optimizer.py:1088), which on CPU is a gloo group
    that takes the CPU tensor as it is."""
    saved = torch.Tensor.cuda
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        torch.Tensor.cuda = saved


def allocate_state(optimizer) -> None:
    """Gives a distributed optimizer whose torch Adam has not stepped its state tensors (step
    0, values to be overwritten by a load), through megatron's own ``load_state_dict``.
    megatron reads the step from every parameter's state when it builds the state dict it
    loads into (distrib_optimizer.py:640, torch's optimizer, without apex or Transformer
    Engine, i.e. the CPU), and asserts that there is one: a fresh optimizer has none."""
    inner = optimizer.optimizer
    if len(inner.state):
        return
    groups = [dict(group, step=0) for group in inner.state_dict()["param_groups"]]
    optimizer.load_state_dict({"optimizer": {"param_groups": groups}})


def _allocating_before_load(method):
    @functools.wraps(method)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args,
                           **kwargs):
        if is_loading:
            allocate_state(self)
        return method(self, model_sharded_state_dict or {}, is_loading, *args, **kwargs)

    sharded_state_dict._swift_mcore_original = method
    return sharded_state_dict


def _keeping_step(method):
    """megatron's loader of the reshardable state hands each parameter's moments and fp32
    copy to ``_set_main_param_and_optimizer_states``, which copies every entry of the
    parameter's optimizer state from them: torch's Adam also holds a ``step`` there, which
    the checkpoint keeps in the param groups and ``load_state_dict`` has already set
    (distrib_optimizer.py:937, 2099). That entry is given its own value."""
    @functools.wraps(method)
    def set_states(self, model_param, tensors):
        if "step" not in tensors:
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return method(self, model_param, tensors)

    set_states._swift_mcore_original = method
    return set_states


def _own_steps(method):
    """megatron's ``load_state_dict`` gives every parameter's torch Adam state one and the
    same ``step`` tensor (distrib_optimizer.py:815-820), which torch keeps as it is; torch's
    fused and foreach Adam then add 1 to it once per parameter at each step, and the bias
    correction goes wrong from the first step after a resume. Each parameter gets its copy."""
    @functools.wraps(method)
    def load_state_dict(self, state_dict):
        result = method(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return result

    load_state_dict._swift_mcore_original = method
    return load_state_dict


def _within(context, method):
    @functools.wraps(method)
    def call(*args, **kwargs):
        with context():
            return method(*args, **kwargs)

    call._swift_mcore_original = method
    return call


def install() -> None:
    """megatron's ``DistributedOptimizer`` builds its shards inside
    ``cpu_parameters_named_as_cuda``, gathers its state inside ``cuda_moves_stay_on_cpu``, and
    has its state allocated (``allocate_state``) before it describes a load, whose torch
``step`` it keeps (``_keeping_step``), one per parameter (``_own_steps``) (its CUDA devices
    and synchronizes are cpu_compat's proxy: PATCHED_MODULES)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as cls

    if hasattr(cls.__init__, "_swift_mcore_original"):
        return
    cls.__init__ = _within(cpu_parameters_named_as_cuda, cls.__init__)
    cls.get_parameter_state_dp_zero = _within(cuda_moves_stay_on_cpu,
                                              cls.get_parameter_state_dp_zero)
    cls.sharded_state_dict = _allocating_before_load(cls.sharded_state_dict)
    cls.load_state_dict = _own_steps(cls.load_state_dict)
    cls._set_main_param_and_optimizer_states = _keeping_step(
        cls._set_main_param_and_optimizer_states)
