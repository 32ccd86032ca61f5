"""Client side of the parameter servers: fan a pull or a push out to every shard at once."""
from __future__ import annotations

import concurrent.futures

import numpy as np

from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc, tensors
from elastic_step.ps.api import Placement


class PSClient:
    def __init__(self, addresses: list[str], token: str, placement: Placement, timeout: float = 60.0):
        if len(addresses) != placement.num_ps:
            raise ValueError(f"{len(addresses)} PS addresses for {placement.num_ps} shards")
        self.token = token
        self.placement = placement
        self.timeout = timeout
        self._channels = [rpc.channel(a) for a in addresses]
        # Blocking calls on long-lived threads: gRPC's own futures start a thread per call when
        # calls do not overlap, which costs more than a small model's whole training step.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 * len(addresses),
                                                           thread_name_prefix="ps-call")
        self.stubs = [pb_grpc.ParameterServerStub(c) for c in self._channels]

    def pull_dense(self) -> list[np.ndarray]:
        """Each shard's flat dense buffer, in shard order."""
        futures = [s.PullDense.future(pb.PullDenseRequest(token=self.token), timeout=self.timeout)
                   for s in self.stubs]
        return [tensors.decode(f.result().dense_flat) for f in futures]

    def pull_dense_named(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for shard, flat in enumerate(self.pull_dense()):
            out.update(self.placement.unflatten(shard, flat))
        return out

    def pull_rows(self, lookups: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """name -> rows for `ids` (any order, duplicates allowed), gathered from their owners."""
        requests = [pb.PullEmbeddingRequest(token=self.token) for _ in self.stubs]
        parts = {}
        for name, ids in lookups.items():
            parts[name] = self.placement.split_ids(ids)
            for shard, pos in enumerate(parts[name]):
                if len(pos):
                    tensors.encode(ids[pos], requests[shard].lookups.add(name=name).ids)
        futures = [s.PullEmbedding.future(r, timeout=self.timeout) if r.lookups else None
                   for s, r in zip(self.stubs, requests)]
        out = {name: np.empty((len(ids), self.placement.embeddings[name][1]), np.float32)
               for name, ids in lookups.items()}
        for shard, f in enumerate(futures):
            if f is None:
                continue
            for rows in f.result().rows:
                out[rows.name][parts[rows.name][shard]] = tensors.decode(rows.values)
        return out

    def push(self, task_id: int, seq: int, flat_grads: list[np.ndarray],
             emb_grads: dict[str, tuple[np.ndarray, np.ndarray]], want_dense: bool = True
             ) -> tuple[bool, list[tuple[int, np.ndarray]]]:
        """One minibatch's push to every shard at once: per shard a flat dense gradient, plus
        embedding rows to their owners. Returns (applied by any shard, each shard's (version,
        fresh flat dense values))."""
        requests = [pb.PushRequest(token=self.token, task_id=task_id, seq=seq, want_dense=want_dense)
                    for _ in self.stubs]
        for shard, flat in enumerate(flat_grads):
            tensors.encode(flat, requests[shard].dense_grads_flat)
        for name, (ids, values) in emb_grads.items():
            for shard, pos in enumerate(self.placement.split_ids(ids)):
                if len(pos):
                    e = requests[shard].embedding_grads.add(name=name)
                    tensors.encode(ids[pos], e.ids)
                    tensors.encode(values[pos], e.values)
        # Every shard gets the key, even with nothing to apply, so all shards agree on it.
        if len(self.stubs) == 1:
            replies = [self.stubs[0].PushGradients(requests[0], timeout=self.timeout)]
        else:
            futures = [self._pool.submit(s.PushGradients, r, timeout=self.timeout)
                       for s, r in zip(self.stubs, requests)]
            replies = [f.result() for f in futures]
        return any(r.applied for r in replies), [(r.version, tensors.decode(r.dense_flat)) for r in replies]

    def all_rows(self) -> dict[str, np.ndarray]:
        """Every embedding table, whole (for export at the end of training)."""
        return {name: self.pull_rows({name: np.arange(rows, dtype=np.int64)})[name]
                for name, (rows, _dim) in self.placement.embeddings.items()}

    def stats(self) -> list[pb.PsStats]:
        return [s.Stats(pb.StatsRequest(token=self.token), timeout=self.timeout) for s in self.stubs]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for c in self._channels:
            c.close()
