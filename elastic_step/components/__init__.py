"""Pipeline components: `from elastic_step.components import data_prep_op, elastic_train_op, evaluate_op`."""
from elastic_step.components.ops import (BASE_IMAGE, data_prep_op, elastic_train_op, elastic_train_uri_op,
                                         evaluate_op, evaluate_uri_op, publish_model_op)

__all__ = ["BASE_IMAGE", "data_prep_op", "elastic_train_op", "elastic_train_uri_op", "evaluate_op",
           "evaluate_uri_op", "publish_model_op"]
