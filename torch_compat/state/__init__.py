"""torch state_dict <-> jaxguard container, and the first-update audit with real torch.

A checkpoint ("CKPT") is a dict with the model ``state_dict`` under ``"model"`` and an
Adam/AdamW optimizer ``state_dict`` under ``"optimizer"``.  Its param groups carry
``param_names`` when the optimizer was built from ``model.named_parameters()``; one
built from ``model.parameters()`` is mapped to the model's tensors only where the map is
provable (every moment's shape names one tensor), or in an order the user asserts
(`infer_param_names`).  Every other key passes through exactly (tensors as raw arrays,
numbers/strings/lists/dicts as JSON; nothing is pickled).

What each moment pair was certified for (the param group's next-step lr, betas, eps,
weight decay, the state's step, the op model, the parameter) is recorded in its entry;
`load` compares the optimizer about to step with it (`check_next_update`).


The package by job, each module importing only those above it: ``tensors`` <- ``skeleton``
<- ``param_names`` <- ``coverage`` <- ``records`` <- ``first_update`` <- ``checkpoint`` <- ``audit``.
"""
from __future__ import annotations

__all__ = ['EXACT_REASON', 'tensor_to_numpy', 'to_skeleton', 'scalar_value', 'check_param_group',
           'check_optimizer_state', 'implementation_of', 'infer_param_names', 'with_param_names', 'param_index',
           'op_model_of', 'next_update', 'guard_config', 'step_count', 'MappedSource', 'state_records', 'torch_update_request',
           'writer_config', 'encoder_view', 'jax_platform_of', 'HostTensor', 'compress_checkpoint',
           'compress_checkpoint_to', 'restore_tree', 'save', 'snapshot', 'save_snapshot', 'load',
           'check_next_update', 'certified_by_group', 'warn_other_kernel', 'torch_step', 'audit', 'save_torch']

from torch_compat.state.tensors import (writer, torch, is_tensor, dtype_name, torch_version, tensor_to_numpy,
                                        numpy_to_tensor, scalar_value, jax_platform_of, HostTensor)  # noqa: F401
from torch_compat.state.skeleton import to_skeleton, from_skeleton  # noqa: F401
from torch_compat.state.param_names import (NO_NAMES, BY_ORDER_FIX, PARAM_MAPS, infer_param_names,
                                            with_param_names, param_map_of, param_index,
                                            param_digest)  # noqa: F401
from torch_compat.state.coverage import (UNSUPPORTED_FLAGS, EXACT_REASON, Uncovered, implementation_of,
                                         op_model_of, group_uncovered, check_param_group,
                                         param_uncovered, check_optimizer_state)  # noqa: F401
from torch_compat.state.records import (next_update, guard_config, step_count, MappedSource, state_records,
                                        torch_update_request,
                                        UNNAMED_WHY, writer_config, encoder_view)  # noqa: F401
from torch_compat.state.first_update import (HYPERPARAMETERS, check_next_update,
                                             watch_first_step, certified_by_group, warn_other_kernel,
                                             check_certified_weights, check_layout)  # noqa: F401
from torch_compat.state.checkpoint import (compress_checkpoint, compress_checkpoint_to, restore_tree, save,
                                           snapshot, save_snapshot, load)  # noqa: F401
from torch_compat.state.audit import torch_step, audit, save_torch  # noqa: F401
