"""The model contract: a user module with model(), loss(), optimizer(), feed() and, optionally,
eval_metrics(), class_weight() and loss_weights. The same module trains with plain Keras and elastically, unchanged.

`spec` is an importable module path (`samples.digits.model`) or a path/URI to a `.py` file
(any fsspec URI), so trying a model needs no image rebuild.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import shutil
import sys
import tempfile
import traceback
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from elastic_step.errors import ModelDefError

REQUIRED = ("model", "loss", "optimizer", "feed")
OPTIONAL = ("eval_metrics", "class_weight", "loss_weights")

# Methods of keras.Model a model may not override, since elastic-step runs the step itself: what each is for
# here instead. compute_loss is honoured (training and evaluation compute the loss through it).
NOT_OVERRIDABLE = {
    "train_step": "the training step is elastic-step's own; override compute_loss() to change what it minimises",
    "make_train_function": "the training step is elastic-step's own; override compute_loss() to change the loss",
    "test_step": "evaluation computes the loss through compute_loss() and the metrics of eval_metrics(); "
    "override compute_loss(), or add metrics to eval_metrics()",
    "make_test_function": "evaluation computes the loss through compute_loss() and the metrics of eval_metrics()",
    "compute_metrics": "the metrics are eval_metrics()'s, per output if the model has several "
    "({output: {name: metric}}); put yours there",
}


@dataclasses.dataclass(frozen=True)
class ModelDef:
    spec: str
    module: types.ModuleType
    # () -> the training data's column statistics (elastic_step.data.statistics of its manifest), which a
    # model(statistics) receives; None: no training data at hand.
    read_statistics: Callable[[], dict] | None = None

    @functools.cached_property
    def takes_statistics(self) -> bool:
        return _required_args(self.module.model) == 1

    @functools.cached_property
    def statistics(self) -> dict:
        if self.read_statistics is None:
            raise ModelDefError(
                f"model() in {self.spec!r} takes the data's statistics, and no training data was given to read them "
                "from: pass the prepared training data (--train-data or --prepared)."
            )
        return self.read_statistics()

    def _call(self, name: str, *args) -> Any:
        try:
            return getattr(self.module, name)(*args)
        except Exception as e:  # the user's code raised: say where, keep the cause
            raise self.user_error(e, f"calling {name}()", name) from e

    def user_error(
        self, error: BaseException, doing: str, function: str | None = None, where: str = ""
    ) -> ModelDefError:
        """The user's error as theirs, whole: its own words first (TensorFlow's, for an error raised while
        a compiled step ran, not its "Graph execution error" framing), the contract function it came from
        (the outermost of the user's frames, else `function`), those frames, innermost last, and the fix.
        The frames are the Python traceback's, or, for an op that failed inside a compiled step, the ones
        TensorFlow recorded where the op was defined. `where`: the records it failed on, when known."""
        if isinstance(error, ModelDefError):
            return error
        cause, defined_at = _cause(error)
        frames = self._user_frames(error) or [f for f in defined_at if self._is_user_file(f.filename)]
        function = frames[0].name if frames else function
        what = (
            f"{function}() in the model definition {self.spec!r}" if function else f"The model definition {self.spec!r}"
        )
        on = f" on {where}" if where else ""
        if _raised_by_an_op(error):
            # The op ran on real values: these records, as feed() gave them, are what to look at; fit fails
            # the same way on them.
            fix = f"Check those records and what feed() returns for them{f', and {function}()' if function else ''}"
        elif function:
            fix = f"Fix {function}() in that module"
        else:
            fix = "Check that feed() returns what model() and loss() expect"
        first, *rest = cause or ["(no message)"]
        first += "" if first.endswith((".", "!", "?")) else "."
        text = f"{what} raised {type(error).__name__} while {doing}{on}: {first} {fix}; it must run with plain Keras"
        text += " too."
        text += "".join(f"\n{line}" for line in rest)  # the rest of the error's own words
        if frames:
            text += "\nYour code, innermost last:\n" + "".join(traceback.format_list(frames)).rstrip()
        return ModelDefError(text)

    def raised_in_user_code(self, error: BaseException) -> bool:
        return bool(self._user_frames(error))

    def _is_user_file(self, filename: str) -> bool:
        path = getattr(self.module, "__file__", "") or ""
        return bool(path) and os.path.realpath(filename) == os.path.realpath(path)

    def _user_frames(self, error: BaseException) -> list[traceback.FrameSummary]:
        return [f for f in traceback.extract_tb(error.__traceback__) if self._is_user_file(f.filename)]

    def model(self):
        import keras

        m = self._call("model", self.statistics) if self.takes_statistics else self._call("model")
        if not isinstance(m, keras.Model):
            raise ModelDefError(f"model() in {self.spec!r} returned {type(m).__name__}, not a keras.Model.")
        for method, instead in NOT_OVERRIDABLE.items():
            if getattr(type(m), method) is not getattr(keras.Model, method):
                owner = next(c for c in type(m).__mro__ if method in vars(c))
                raise ModelDefError(
                    f"The model of {self.spec!r} overrides {method}() ({owner.__qualname__}.{method}), which "
                    f"elastic-step would not run: {instead}."
                )
        return m

    def _user_optimizer(self):
        import keras

        o = self._call("optimizer")
        if not isinstance(o, keras.optimizers.Optimizer):
            raise ModelDefError(
                f"optimizer() in {self.spec!r} returned {type(o).__name__}, not a keras.optimizers.Optimizer."
            )
        return o

    def optimizer(self):
        """The optimizer that applies the gradients: optimizer()'s, or the one its LossScaleOptimizer wraps (the
        workers scale the loss themselves: `loss_scaling`)."""
        import keras

        o = self._user_optimizer()
        return o.inner_optimizer if isinstance(o, keras.optimizers.LossScaleOptimizer) else o

    def loss_scaling(self, model) -> tuple[float, int] | None:
        """(initial scale, growth steps) of the dynamic loss scaling `fit` trains `model` with: that of the
        LossScaleOptimizer optimizer() returns, or of the one compile() wraps around it for a mixed_float16 model
        (Keras's defaults); None: no loss scaling."""
        import keras

        o = self._user_optimizer()
        if not isinstance(o, keras.optimizers.LossScaleOptimizer):
            if model.dtype_policy.name != "mixed_float16":
                return None
            o = keras.optimizers.LossScaleOptimizer(o)
        return float(o.initial_scale), int(o.dynamic_growth_steps)

    def eval_metrics(self) -> dict:
        if not hasattr(self.module, "eval_metrics"):
            return {}
        metrics = self._call("eval_metrics")
        if not isinstance(metrics, dict):
            raise ModelDefError(
                f"eval_metrics() in {self.spec!r} must return a dict of name -> "
                f"keras.metrics.Metric, got {type(metrics).__name__}."
            )
        # A model of several outputs may name its metrics per output, {output: {name: metric}}: each is then
        # reported as "<output>_<name>", as `evaluate` names compile(metrics={output: [...]})'s.
        flat = {}
        for name, metric in metrics.items():
            if isinstance(metric, dict):
                flat.update({f"{name}_{inner}": OutputMetric(name, m) for inner, m in metric.items()})
            else:
                flat[name] = metric
        return flat

    def feed(self, batch):
        return self._call("feed", batch)

    def unpack(self, fed) -> tuple[Any, Any, Any]:
        """feed()'s result as (features, labels, sample weights or None): `(x, y)` or `(x, y, sample_weight)`,
        a tuple or a list, as `fit` takes a dataset's elements."""
        if isinstance(fed, (tuple, list)) and len(fed) in (2, 3):
            x, y, *weights = fed
            if y is not None:
                return x, y, (weights[0] if weights else None)
        what = f"a {type(fed).__name__} of {len(fed)}" if isinstance(fed, (tuple, list)) else type(fed).__name__
        raise ModelDefError(
            f"feed() in the model definition {self.spec!r} returned {what}. It must return (features, labels) or "
            "(features, labels, sample_weight), as `fit` takes them from a dataset."
        )

    def examples(self, batch: dict, weight_column: str | None = None, training: bool = True) -> tuple[Any, Any, Any]:
        """Records -> (features, labels, sample weights or None), weighted as `fit` (`training`) or
        `evaluate` weighs them: feed()'s own sample weights, else the data's weight column (named at prep),
        each record's; in training, class_weight()'s weight of each record's class, as
        `fit(class_weight=...)`. Weights from two of these at once are refused, as `fit` refuses both."""
        x, y, weights = self.unpack(self.feed(batch))
        if weight_column is not None:
            if weights is not None:
                raise ModelDefError(
                    f"feed() in the model definition {self.spec!r} returns sample weights, and the data has the "
                    f"weight column {weight_column!r} (named at prep). Use one: return (features, labels), or "
                    "prepare the data without --weight-column."
                )
            weights = np.asarray(batch[weight_column], dtype=np.float32)
        if training and self.class_weights is not None:
            if weights is not None:
                raise ModelDefError(
                    f"The model definition {self.spec!r} has class_weight(), and its records have sample weights "
                    f"({'the column ' + repr(weight_column) if weight_column else 'from feed()'}): `fit` takes "
                    "one or the other. Fold the class weights into the sample weights, or drop class_weight()."
                )
            weights = self._class_weights_of(y)
        return x, y, weights

    @functools.cached_property
    def class_weights(self) -> dict[int, float] | None:
        """class_weight()'s {class index: weight}, checked once; None without the function."""
        if getattr(self.module, "class_weight", None) is None:
            return None
        weights = self._call("class_weight")
        try:
            if not isinstance(weights, dict):
                raise TypeError
            return {int(k): float(v) for k, v in weights.items()}
        except (TypeError, ValueError):
            raise ModelDefError(
                f"class_weight() in {self.spec!r} must return a dict of class index -> weight, as "
                f"`fit(class_weight=...)` takes it, e.g. {{0: 1.0, 1: 5.0}}; got {weights!r:.200}."
            ) from None

    def _class_weights_of(self, labels) -> np.ndarray:
        """Each record's class weight, as Keras's fit derives it: the class is the label rounded (the
        argmax of a one-hot row); a class not in the dict weighs 1."""
        import tensorflow as tf

        if len(tf.nest.flatten(labels)) != 1:
            raise ModelDefError(
                f"class_weight() in {self.spec!r} needs one label per record, as `fit` does: feed() returns "
                "labels for several outputs. Give sample weights per output instead."
            )
        y = np.asarray(tf.nest.flatten(labels)[0])
        if y.ndim > 1:
            y = np.squeeze(y, axis=-1) if y.shape[-1] == 1 else np.argmax(y, axis=-1)
        classes, at = np.unique(np.round(y).astype(np.int64), return_inverse=True)
        table = np.array([self.class_weights.get(int(c), 1.0) for c in classes], dtype=np.float32)
        return table[at.reshape(-1)]

    @property
    def loss_weights(self):
        """The module's optional `loss_weights`, as compile(loss_weights=...) takes it (None: every loss 1)."""
        return getattr(self.module, "loss_weights", None)

    def compiled_loss(self, model):
        """The model's loss as compile(loss=loss, loss_weights=loss_weights) gives it to compute_loss() (a loss
        per output for a model of several, each output's reported by `evaluate` as "<output>_loss"), set once
        on the model, without compile()'s optimizer or compiled state, which saving would record."""
        if model._compile_loss is None:
            # Keras does not export CompileLoss: compile() is the only public way in, and it sets an optimizer.
            from keras.src.trainers.compile_utils import CompileLoss

            model._compile_loss = CompileLoss(
                self.module.loss, self.loss_weights, output_names=getattr(model, "output_names", None)
            )
        return model._compile_loss

    def compute_loss(self, model, features, labels, predictions, sample_weight=None, training=True):
        """The model's compute_loss() (an override of it included, as `fit` and `evaluate` call it) on a call's
        predictions: loss(), weighted per output, plus the model's own losses (regularization)."""
        self._build_loss(model, labels, predictions)
        # _compute_loss: what Keras's own steps call, taking overrides written before compute_loss took `training`.
        return model._compute_loss(features, labels, predictions, sample_weight, training=training)

    def _build_loss(self, model, labels, predictions) -> None:
        compile_loss = self.compiled_loss(model)
        if not compile_loss.built:  # its per-output trackers are made here, outside any stateless scope
            compile_loss.build(labels, predictions)

    def output_losses(self, model) -> dict[str, float]:
        """Each output's loss since the trackers were reset ("<output>_loss"), for a model of several outputs."""
        return {m.name: float(m.result()) for m in self.compiled_loss(model).metrics}

    @functools.cached_property
    def loss_fn(self) -> Callable:
        """loss() reduced exactly as Keras's compile/fit reduce it: a `keras.losses.Loss` is used as
        it is (its own reduction); a function returning a scalar or per-example losses is wrapped
        as compile() wraps it (labels and predictions brought to one rank, then the mean over every
        element)."""
        import keras

        # The very wrapper compile() puts around a loss function (keras/src/trainers/compile_utils.py,
        # get_loss); Keras does not export it. The parity tests hold us to fit's results.
        from keras.src.losses.losses import LossFunctionWrapper

        loss = self.module.loss
        if isinstance(loss, keras.losses.Loss):
            return loss
        return LossFunctionWrapper(loss, name=getattr(loss, "__name__", "loss"))

    def training_loss(self, model, features, labels, sample_weight=None, trainable_values=None, state_values=None):
        """What a training step minimises: the model's compute_loss() (loss() per output, weighted, plus the
        model's own regularization losses, as Keras's fit computes it; a compute_loss() of the model's own
        instead). Traced inside the workers' compiled steps (both strategies). `sample_weight` (None: none)
        weighs each record's loss as `fit` does: through loss()'s own reduction.

        With `trainable_values` (tensors, in the order of model.trainable_variables) the model runs on
        them instead of its variables (Keras's stateless_call and stateless_compute_loss); its non-trainable
        state (e.g. batch norm statistics) is still updated. With `state_values` too ({position in
        model.non_trainable_variables: tensor}), those parts of the state are taken from it and their
        new values returned, not assigned: the result is then (loss, {position: new value})."""
        if trainable_values is None:
            predictions = model(features, training=True)
            return self.compute_loss(model, features, labels, predictions, sample_weight)
        given = state_values or {}
        state = model.non_trainable_variables
        predictions, new_state, losses = model.stateless_call(
            trainable_values,
            [given[i] if i in given else v.value for i, v in enumerate(state)],
            features,
            training=True,
            return_losses=True,
        )
        self._build_loss(model, labels, predictions)
        # This call's own losses, for compute_loss() to add, as Keras's stateless (JAX) trainer hands them over.
        model._losses_override.clear()
        model._losses_override.extend(losses)
        try:
            loss, (_, new_state, _) = model.stateless_compute_loss(
                trainable_values,
                new_state,
                [v.value for v in model.metrics_variables],  # its loss trackers: moved, then dropped
                x=features,
                y=labels,
                y_pred=predictions,
                sample_weight=sample_weight,
                training=True,
            )
        finally:
            model._losses_override.clear()
        for i, (var, value) in enumerate(zip(state, new_state)):
            if i not in given:
                var.assign(value)
        if state_values is None:
            return loss
        return loss, {i: new_state[i] for i in state_values}


class OutputMetric:
    """A metric of one output of a model of several: given every output's labels and predictions (by output
    name), it scores that output's."""

    def __init__(self, output: str, metric):
        self.output, self.metric = output, metric

    def update_state(self, labels, predictions):
        self.metric.update_state(labels[self.output], predictions[self.output])

    def reset_state(self):
        self.metric.reset_state()

    def result(self):
        return self.metric.result()


# A line of an error's message longer than this is cut (a label error lists every label of the batch).
LINE_CHARS = 500
_DEFINED_AT = re.compile(r"^Detected at node .* defined at \(most recent call last\):$")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+?)\s*$')
# TensorFlow's framing around an op's message: the function it ran in, the node, the op's name.
_NOISE = re.compile(
    r"^\{\{function_node [^}]*\}\}\s*|\s*\[\[\{\{node [^}]*\}\}\]\]|\s*\[Op:[^\]]*\]( name:\s*\S*)?\s*$"
)


def _raised_by_an_op(error: BaseException) -> bool:
    """A TensorFlow op failed on the values it was given (not while the step was traced)."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(error, tf.errors.OpError)


def _cause(error: BaseException) -> tuple[list[str], list[traceback.FrameSummary]]:
    """(the error's own words, line by line, without TensorFlow's framing; the frames TensorFlow recorded
    where the failing op was defined, outermost first). A compiled step's error reads "Graph execution
    error:", then "Detected at node ... defined at", those frames, and only then the op's message; an
    error raised while tracing reads "in user code:", the frames, then the error itself."""
    text = getattr(error, "message", None) if _raised_by_an_op(error) else None
    lines = [line.rstrip() for line in str(text if isinstance(text, str) else error).splitlines()]
    frames: list[traceback.FrameSummary] = []
    words: list[str] = []
    in_frames = False
    for line in lines:
        if line.strip() in ("Graph execution error:", "in user code:"):
            in_frames = line.strip() == "in user code:"
            continue
        if _DEFINED_AT.match(line.strip()):
            in_frames = True
            continue
        if in_frames and (m := _FRAME.match(line)):
            frames.append(traceback.FrameSummary(m["file"], int(m["line"]), m["name"]))
            continue
        if in_frames and (not line.strip() or line.startswith("        ")):  # a frame's source line
            continue
        in_frames = False
        line = _NOISE.sub("", line).strip()
        if line:
            line = line.removeprefix(f"{type(error).__name__}: ")
            words.append(line if len(line) <= LINE_CHARS else line[:LINE_CHARS] + " ...")
    return words, frames


def _import_file(spec: str) -> types.ModuleType:
    if "://" in spec and not spec.startswith("file://"):
        import fsspec

        try:
            with fsspec.open(spec, "rb") as f:
                source = f.read()
        except (OSError, ValueError) as e:
            raise ModelDefError(
                f"Cannot read the model definition {spec!r}: {e}. Check the URI and the credentials of the step."
            ) from None
        folder = tempfile.mkdtemp(prefix="elastic-step-model-")
        # Kept while the process runs (a traceback through the user's code reads its lines from this file), then
        # removed: every process of a job, and every relaunch, makes its own copy.
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        path = os.path.join(folder, os.path.basename(spec))
        with open(path, "wb") as f:
            f.write(source)
    else:
        path = spec[len("file://") :] if spec.startswith("file://") else spec
        if not os.path.isfile(path):
            raise ModelDefError(
                f"The model definition file {spec!r} does not exist. Pass an importable "
                "module (pkg.module) or the path/URI of a .py file."
            )
    name = "elastic_step_user_model_" + hashlib.sha1(spec.encode()).hexdigest()[:10]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # keras serialisation looks classes up by module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ModelDefError(f"Importing the model definition {spec!r} raised {type(e).__name__}: {e}.") from e
    return module


def _required_args(fn) -> int | None:
    """How many positional arguments `fn` requires (None: its signature cannot be read)."""
    try:
        return sum(
            1
            for p in inspect.signature(fn).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        )
    except (TypeError, ValueError):
        return None


def _check_losses(spec: str, losses) -> None:
    """A loss per output, as compile(loss={...}) or compile(loss=[...]) takes it: each a function or a
    keras.losses.Loss (None: that output has none)."""
    items = losses.items() if isinstance(losses, dict) else enumerate(losses)
    for key, fn in items:
        if fn is not None and not callable(fn):
            raise ModelDefError(
                f"loss[{key!r}] in the model definition {spec!r} is a {type(fn).__name__}: each output's loss "
                "must be a function (labels, predictions) or a keras.losses.Loss, as compile(loss=...) takes it."
            )


def load_model_def(spec: str, read_statistics: Callable[[], dict] | None = None) -> ModelDef:
    if not spec:
        raise ModelDefError("No model definition given: pass --model-def pkg.module or a .py path/URI.")
    if spec.endswith(".py") or "/" in spec or "://" in spec:
        module = _import_file(spec)
    else:
        try:
            module = importlib.import_module(spec)
        except ModuleNotFoundError as e:
            raise ModelDefError(
                f"Cannot import the model definition module {spec!r} ({e}). Pass an "
                "importable module path or the path/URI of a .py file."
            ) from None
        except Exception as e:
            raise ModelDefError(f"Importing the model definition {spec!r} raised {type(e).__name__}: {e}.") from e
    for name in REQUIRED:
        fn = getattr(module, name, None)
        if fn is None:
            raise ModelDefError(
                f"The model definition {spec!r} has no function {name}(). It must define "
                "model(), loss(labels, predictions), optimizer() and feed(batch)."
            )
        if name == "loss" and isinstance(fn, (dict, list, tuple)):
            _check_losses(spec, fn)
        elif not callable(fn):
            raise ModelDefError(f"{name} in the model definition {spec!r} is a {type(fn).__name__}, not a function.")
    arity = {"model": (0, 1), "optimizer": (0,), "loss": (2,), "feed": (1,)}  # model(statistics) may take one
    for name, allowed in arity.items():
        if not callable(getattr(module, name)):  # a loss per output, checked above
            continue
        n = _required_args(getattr(module, name))
        if n is not None and n not in allowed:
            raise ModelDefError(
                f"{name}() in the model definition {spec!r} takes {n} required "
                f"argument(s); the contract is {name}({', '.join(['...'] * allowed[-1])}) with {allowed[-1]}"
                + (" (or model() with none)." if name == "model" else ".")
            )
    ev = getattr(module, "eval_metrics", None)
    if ev is not None and not callable(ev):
        raise ModelDefError(f"eval_metrics in {spec!r} must be a function returning a dict of metrics.")
    return ModelDef(spec=spec, module=module, read_statistics=read_statistics)
