"""Push keys for the PS tests: a minibatch of `records` records from `seq`, epoch 0, data shard 0."""

from elastic_step.ps.api import PushKey


def key(task_id: int, seq: int, records: int = 64, epoch: int = 0, data_shard: int = 0) -> PushKey:
    return PushKey(task_id, seq, seq + records, epoch, data_shard)
