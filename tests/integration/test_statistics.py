"""model(statistics): a module whose model() takes the data's statistics trains elastically, its preprocessing
layers built from the training data's manifest in the master, the workers and the PS alike."""

from __future__ import annotations

import os

import numpy as np
import pytest

import elastic_step.data
from tests.integration.harness import ROOT, train

ADAPTED = os.path.join(ROOT, "samples", "ctr", "adapted.py")


@pytest.mark.parametrize("strategy", ["ps", "allreduce"])
def test_a_model_built_from_the_datas_statistics_trains_in_both_strategies(tmp_path, ctr_data, strategy):
    import keras

    proc, summary = train(
        ctr_data, tmp_path / "out", model=ADAPTED, strategy=strategy, max_workers=2, epochs=1, checkpoint_every=0
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    stats = elastic_step.data.statistics(ctr_data["train"])
    net = keras.models.load_model(str(tmp_path / "out" / "model.keras"), compile=False)
    norm = net.get_layer("bid_norm")
    assert float(np.ravel(norm.mean)[0]) == pytest.approx(stats["bid"]["mean"], rel=1e-6)
    assert net.get_layer("user_id_lookup").get_vocabulary()[1:] == stats["user_id"]["vocabulary"]
    assert summary["eval"]["auc"] > 0.6, summary["eval"]
