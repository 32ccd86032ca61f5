"""elastic-step: elastic TensorFlow 2 training as a pipeline step."""

__version__ = "0.1.0"
