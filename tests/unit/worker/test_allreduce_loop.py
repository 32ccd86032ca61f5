"""A step's contributions ride in the allreduced buffer: summing the members' slots hands every member
all of them, exactly, for record indices far beyond float32's 2**24. A member's gradients weigh its
records as fit does."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_step.worker.allreduce_loop import contribution_slots, contributions


def test_the_sum_of_the_members_slots_is_every_contribution_exactly():
    world = 3
    mine = [(7, 2, 50_000_000_000, 50_000_000_064), None, (0, 0, 0, 16)]  # rank 1 had no data this step
    total = sum(contribution_slots(c, rank, world) for rank, c in enumerate(mine))
    assert total.dtype == np.float32
    assert contributions(total) == [mine[0], mine[2]]


def test_a_member_without_data_contributes_nothing():
    assert contributions(contribution_slots(None, 0, 2)) == []


def test_the_allreduce_step_weighs_records_as_fit_and_takes_mixed_inputs(tmp_path):
    """A feed of (x, y, sample_weight) whose features mix a numpy array and a string tensor: the
    member's loss is fit's weighted loss, its record count the batch's."""
    import textwrap

    tf = pytest.importorskip("tensorflow")
    from elastic_step.model_def import load_model_def
    from elastic_step.worker.allreduce_loop import AllReduceTrainer

    (tmp_path / "m.py").write_text(
        textwrap.dedent("""
        import keras, numpy as np, tensorflow as tf

        def model():
            x = keras.Input(shape=(2,), name="x")
            word = keras.Input(shape=(1,), dtype="string", name="word")
            hashed = keras.layers.Hashing(num_bins=4, output_mode="one_hot")(word)
            return keras.Model({"x": x, "word": word}, keras.layers.Dense(1)(keras.layers.Concatenate()([x, hashed])))

        def loss(labels, predictions):
            return keras.ops.square(labels - predictions)

        def optimizer():
            return keras.optimizers.SGD(0.1)

        def feed(batch):
            x = np.stack([batch["a"], batch["b"]], 1).astype("float32")
            y = batch["y"].astype("float32")[:, None]
            return {"x": x, "word": tf.constant(batch["word"][:, None])}, y, batch["w"]
    """)
    )
    md = load_model_def(str(tmp_path / "m.py"))
    rng = np.random.default_rng(0)
    rows = {
        "a": rng.normal(size=12),
        "b": rng.normal(size=12),
        "y": rng.normal(size=12),
        "w": rng.uniform(0, 2, 12),
        "word": rng.choice(["x", "y", "z"], 12),
    }
    trainer = AllReduceTrainer(md, md.model())
    loss, flat, n = trainer.gradients(rows)
    p = trainer.model(
        {"x": tf.constant(np.stack([rows["a"], rows["b"]], 1), tf.float32), "word": tf.constant(rows["word"][:, None])}
    ).numpy()[:, 0]
    assert n == 12 and flat.size == trainer.size
    assert loss == pytest.approx(float(np.sum(rows["w"] * (rows["y"] - p) ** 2) / 12), rel=1e-5)
