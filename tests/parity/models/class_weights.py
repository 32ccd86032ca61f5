"""Habit: `fit(class_weight={class: weight})`, given as the module's optional class_weight().

Two classes weigh 0.05 in training, so the model hardly learns them, and evaluation (which, as
Keras's `evaluate`, takes no class weights) counts every record. Measured with fit over seeds 0-2:
accuracy 0.769-0.772, loss 0.63-0.65; with the class weights ignored, 0.958 and 0.20. Digits.
"""

import keras
import numpy as np

PIXELS = [f"pixel_{i}" for i in range(64)]


def model():
    return keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


loss = keras.losses.SparseCategoricalCrossentropy()


def optimizer():
    return keras.optimizers.Adam(learning_rate=2e-3)


def class_weight():
    return {3: 0.05, 8: 0.05}


def feed(batch):
    pixels = np.stack([batch[c] for c in PIXELS], axis=1).astype("float32") / 16.0
    return pixels, batch["label"].astype("int64")


def eval_metrics():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}
