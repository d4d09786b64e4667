"""Named model specs, so the parameter server and every worker agree on parameter names and shapes.

A spec is built in (``digits-cnn``, ``cifar-cnn``) or brought by a job: a layer list
(:func:`layer_list_spec`) or the user's own Python function (:func:`entry_point_spec`), checked when
it is made and then registered (:func:`register_spec`). Costs are derived from the modules
(:func:`derive_costs`), never kept by hand; ``costs`` holds them for hosts without torch.

Modules: ``lean`` (Standardize, LeanReLU, LeanMaxPool2d), ``specs`` (ModelSpec, the registry, the
built-ins, build_model), ``layer_list``, ``entry_point``, ``probe`` (a zero sample through a model,
on the meta device when it can), ``derived_costs`` (from the module, mesh_stages), ``masks`` (the dropout masks a
model-parallel cluster shares) and ``training`` (parameters
in and out, a gradient step, evaluation). The model state (every parameter and persistent buffer) crosses
process boundaries as ``dict[str, np.ndarray]`` (float32) keyed by ``state_dict`` names.
"""

from __future__ import annotations

from edgemesh.common.models.derived_costs import (
    CHANNELWISE,
    DROPOUTS,
    NORMS,
    REPLICATED,
    Stage,
    derive_costs,
    measure_cost,
    measure_layers,
    mesh_stages,
    register_costs,
)
from edgemesh.common.models.entry_point import entry_point_spec
from edgemesh.common.models.layer_list import KINDS, layer_list_spec
from edgemesh.common.models.lean import LeanMaxPool2d, LeanReLU, Standardize
from edgemesh.common.models.specs import (
    CIFAR_MEAN_STD,
    DIGITS_MEAN_STD,
    MODEL_SPECS,
    ModelSpec,
    build_model,
    get_spec,
    register_spec,
)
from edgemesh.common.models.training import (
    ParamLayout,
    Update,
    buffer_kinds,
    buffer_momenta,
    compute_gradients,
    compute_update,
    evaluate,
    get_params,
    gradient_layout,
    mixture_variance_change,
    param_layout,
    running_pairs,
    set_params,
)

__all__ = [
    "CHANNELWISE",
    "CIFAR_MEAN_STD",
    "DIGITS_MEAN_STD",
    "DROPOUTS",
    "KINDS",
    "MODEL_SPECS",
    "NORMS",
    "REPLICATED",
    "LeanMaxPool2d",
    "LeanReLU",
    "ModelSpec",
    "ParamLayout",
    "Stage",
    "Standardize",
    "Update",
    "buffer_kinds",
    "buffer_momenta",
    "build_model",
    "compute_gradients",
    "compute_update",
    "derive_costs",
    "entry_point_spec",
    "evaluate",
    "get_params",
    "gradient_layout",
    "get_spec",
    "layer_list_spec",
    "measure_cost",
    "measure_layers",
    "mesh_stages",
    "mixture_variance_change",
    "param_layout",
    "register_costs",
    "register_spec",
    "running_pairs",
    "set_params",
]
