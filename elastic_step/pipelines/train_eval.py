"""The train→evaluate pipeline: prep → elastic train → evaluate → publish if the gate passed.

Parameters are strings and numbers only, so the KFP UI can start it.
"""

from kfp import dsl

from elastic_step.components import data_prep_op, elastic_train_op, evaluate_op, publish_model_op

PIPELINE_NAME = "elastic-step-train-eval"


def build(gate_with_condition: bool = True):
    """The pipeline function.

    On a cluster the publish step sits under `dsl.If(passed)`. kfp.local 2.17 cannot resolve a
    task output inside a condition (it skips the branch), so local runs pass `passed` into the
    publish step instead, which then publishes only when it is true: the same gate, one level down.
    """

    @dsl.pipeline(name=PIPELINE_NAME, description="Elastic TensorFlow training, evaluation and a gated publish.")
    def train_eval(source_uri: str, model_def: str, label: str = "label", epochs: int = 10,
                   minibatch_size: int = 64, records_per_task: int = 512, min_workers: int = 1,
                   max_workers: int = 2, num_ps: int = 1, strategy: str = "ps", backend: str = "local",
                   threshold: float = 0.9, metric: str = "accuracy", publish_uri: str = "",
                   eval_fraction: float = 0.2, seed: int = 0):
        prep = data_prep_op(source_uri=source_uri, label=label, eval_fraction=eval_fraction, seed=seed)
        train = elastic_train_op(train_data=prep.outputs["train_data"], eval_data=prep.outputs["eval_data"],
                                 model_def=model_def, epochs=epochs, minibatch_size=minibatch_size,
                                 records_per_task=records_per_task, min_workers=min_workers,
                                 max_workers=max_workers, num_ps=num_ps, strategy=strategy, backend=backend,
                                 seed=seed)
        evaluation = evaluate_op(model=train.outputs["model"], eval_data=prep.outputs["eval_data"],
                                 model_def=model_def, threshold=threshold, metric=metric)
        if gate_with_condition:
            with dsl.If(evaluation.outputs["passed"] == True, name="gate-passed"):  # noqa: E712 - a KFP condition
                publish_model_op(model=train.outputs["model"], publish_uri=publish_uri)
        else:
            publish_model_op(model=train.outputs["model"], publish_uri=publish_uri,
                             passed=evaluation.outputs["passed"])

    return train_eval


train_eval = build()
