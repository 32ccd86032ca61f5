"""Pipeline components: `from elastic_step.components import data_prep_op, elastic_train_op, evaluate_op`.

The components are defined in `ops` and imported lazily: a component's body runs in the step with
KFP's runtime-only `kfp.dsl` (`_KFP_RUNTIME=true`, no `dsl.component`), and imports
`elastic_step.components.outputs` from there, which must not pull the definitions in.
"""

import importlib

__all__ = [
    "BASE_IMAGE",
    "DEFAULT_IMAGE",
    "data_prep_op",
    "elastic_train_op",
    "elastic_train_uri_op",
    "evaluate_op",
    "evaluate_uri_op",
    "publish_model_op",
]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("elastic_step.components.ops"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
