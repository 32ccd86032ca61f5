"""Client side of the parameter servers: fan a pull or a push out to every shard at once."""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import ipaddress
import logging
import queue
import threading
from typing import NamedTuple

import grpc
import numpy as np

from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc, tensors
from elastic_step.ps.api import FINAL_DENSE, FINAL_TABLE, Placement, PushKey, load_named
from elastic_step.ps.doorbell import REFUSED, Bell, Dropped, PushFailed
from elastic_step.ps.push_slots import PushSlots, SharedMemoryUnavailable

log = logging.getLogger("elastic_step.ps")


class ShardsMoved(Exception):
    """A push cannot be applied any more: a shard is unreachable (lost), does not answer within the call's
    deadline (frozen: the master finds it by its own probe, and handles it as lost), or it was restored to a
    checkpoint and refuses pushes computed before that. The worker drops what it holds and registers
    again for the shards' new addresses and generation."""


@contextlib.contextmanager
def moved_shards_named():
    """Calls to the shards raise ShardsMoved when that is what went wrong."""
    try:
        yield
    except ShardsMoved:
        raise
    except Exception as e:
        if shards_moved(e):
            raise ShardsMoved(str(e)) from e
        raise


def shards_moved(error: BaseException) -> bool:
    if isinstance(error, grpc.RpcError):
        # CANCELLED: the shard's server went away with the call in flight (its pod deleted, its process stopping).
        return error.code() in (
            grpc.StatusCode.ABORTED,
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.CANCELLED,
        )
    if isinstance(error, PushFailed):
        return str(error).startswith(REFUSED)
    return isinstance(error, (ConnectionError, BrokenPipeError, TimeoutError))  # TimeoutError: a silent doorbell


class SharedPath(NamedTuple):
    """How pushes reach a shard on this host: its segment of slots, and a bell per slot (None when
    the shard has no doorbell: the key then goes in a gRPC call)."""

    slots: PushSlots
    segment: int
    bells: list[Bell] | None


def on_this_host(address: str) -> bool:
    """A loopback address (127.0.0.0/8, ::1, localhost): the shard shares this host."""
    host = rpc.host_of(address)
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_shards(client: PSClient, model, final_averages: bool = False) -> None:
    """The shards' current weights into `model` (built from the model definition, with the client's placement);
    `final_averages`: the optimizer's moving averages instead, as a finished training leaves them (use_ema)."""
    if final_averages:
        values = client.final_named()
    else:
        values = client.pull_dense_named()
        values.update(client.all_rows())
    load_named(model, values)


class KeptClient:
    """One PSClient for a caller's repeated calls (a checkpoint's cuts, the eval curve's pulls): a new one's
    channels cost more than a small model's pull, and a checkpoint's held workers wait for them. Made anew when a
    shard's address changes (a lost shard relaunched answers at another) and after a failed call (its channels
    may be what failed)."""

    def __init__(self, addresses, token: str, placement: Placement | None = None):
        """`addresses()`: the shards' current addresses."""
        self.addresses, self.token, self.placement = addresses, token, placement
        self._client: PSClient | None = None

    @contextlib.contextmanager
    def use(self):
        addresses = list(self.addresses())
        if self._client is not None and self._client.addresses != addresses:
            self.close()
        if self._client is None:
            self._client = PSClient(addresses, self.token, self.placement)
        try:
            yield self._client
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


class PSClient:
    """`pushes_in_flight` pushes may run at once (from as many threads). With `shared_memory`, a
    push to a shard on this host carries its dense buffers through shared-memory slots instead of
    the message. The calls that split or gather parameters (pulls, pushes) need the `placement`;
    the whole-shard ones (stats, save, restore) do not."""

    def __init__(
        self,
        addresses: list[str],
        token: str,
        placement: Placement | None = None,
        timeout: float = 60.0,
        pushes_in_flight: int = 2,
        shared_memory: bool = True,
        pusher: tuple[int, int] = (-1, 0),
    ):
        """`pusher`: the worker's (index, launch) that every push carries (see PushRequest.worker)."""
        if placement is not None and len(addresses) != placement.num_ps:
            raise ValueError(f"{len(addresses)} PS addresses for {placement.num_ps} shards")
        self.token = token
        self.placement = placement
        self.pusher = pusher
        self.timeout = timeout
        self.addresses = list(addresses)
        self._channels = [rpc.channel(a) for a in addresses]
        # Blocking calls on long-lived threads: gRPC's own futures start a thread per call when
        # calls do not overlap, which costs more than a small model's whole training step.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 * len(addresses), thread_name_prefix="ps-call")
        self.stubs = [pb_grpc.ParameterServerStub(c) for c in self._channels]
        self._minibatches = 1  # gradients a shared slot holds (reserve)
        self._state_words: list[int] | None = None  # room for a copy's state per shard's slot (reserve)
        self.reserve(pushes_in_flight)
        # Per shard: its SharedPath once attached, None when bytes go in the message.
        self._shared: dict[int, SharedPath | None] = {} if shared_memory else dict.fromkeys(range(len(addresses)))
        self._attach_lock = threading.Lock()

    def reserve(self, slots: int, minibatches: int = 1, state_words: list[int] | None = None) -> None:
        """Room for `slots` pushes at once, each of up to `minibatches` minibatches (push_many) and, with
        `state_words` (per shard), a copy's state (ParameterShard.words). Before the first push: a shard's
        shared slots are sized when the first push attaches them."""
        self._slots, self._minibatches, self._state_words = slots, minibatches, state_words
        self._free_slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(slots):
            self._free_slots.put(i)

    def pull_dense(self) -> list[np.ndarray]:
        """Each shard's flat dense buffer, in shard order."""
        return [flat for _, flat in self.pull_dense_at()]

    def pull_dense_at(self) -> list[tuple[int, np.ndarray]]:
        """Each shard's (version, flat dense buffer at that version), in shard order."""
        with moved_shards_named():
            futures = [
                s.PullDense.future(pb.PullDenseRequest(token=self.token), timeout=self.timeout) for s in self.stubs
            ]
            return [(r.version, tensors.decode(r.dense_flat)) for r in (f.result() for f in futures)]

    def pull_with_optimizer(self) -> list[tuple[int, np.ndarray, list[np.ndarray]]]:
        """Each shard's (version, flat dense values, its optimizer's variables) at one moment, in shard order:
        for a worker that applies the shards' updates to a copy of its own (worker/ps/trainer.py)."""
        with moved_shards_named():
            futures = [
                s.PullDense.future(pb.PullDenseRequest(token=self.token, optimizer=True), timeout=self.timeout)
                for s in self.stubs
            ]
            return [
                (r.version, tensors.decode(r.dense_flat), [tensors.decode(t) for t in r.optimizer])
                for r in (f.result() for f in futures)
            ]

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
        futures = [
            s.PullEmbedding.future(r, timeout=self.timeout) if r.lookups else None for s, r in zip(self.stubs, requests)
        ]
        out = {
            name: np.empty((len(ids), self.placement.embeddings[name][1]), np.float32) for name, ids in lookups.items()
        }
        for shard, f in enumerate(futures):
            if f is None:
                continue
            with moved_shards_named():
                reply = f.result()
            for rows in reply.rows:
                out[rows.name][parts[rows.name][shard]] = tensors.decode(rows.values)
        return out

    def push(
        self,
        key: PushKey,
        flat_grads: list[np.ndarray],
        emb_grads: dict[str, tuple[np.ndarray, np.ndarray]],
        want_dense: bool = True,
    ) -> tuple[bool, list[tuple[int, np.ndarray]]]:
        """One minibatch's push to every shard at once: per shard a flat dense gradient, plus
        embedding rows to their owners. Returns (applied by any shard, each shard's (version,
        fresh flat dense values))."""
        applied, replies = self._push(key, flat_grads, emb_grads, want_dense)
        return applied, [(version, values) for version, values, _each in replies]

    def push_many(
        self,
        key: PushKey,
        bounds: tuple[int, ...],
        flat_grads: list[np.ndarray],
        states: list[tuple[np.ndarray, int] | None] | None = None,
    ) -> tuple[list[bool], list[tuple[int, np.ndarray, list[bool]]]]:
        """The pushes of several minibatches of one lease, computed one after another, to every shard at once
        (PushRequest.bounds): per shard their flat dense gradients, [minibatches, its floats] (anything numpy
        reads as such: a tensor is read only if it is sent), and with `states` a copy's state after them and
        the shard's version it was computed from (PushRequest.state_base), which travel only through shared
        slots. A shard sent the state first gets the gradients only if it declines the state. Returns (whether
        each minibatch was applied by any shard, each shard's (version, fresh flat dense values, whether it
        applied each minibatch))."""
        _, replies = self._push(key, flat_grads, {}, True, bounds, states)
        return [any(each) for each in zip(*(each for _v, _f, each in replies))], replies

    def carries_state(self) -> bool:
        """Whether pushes may carry a copy's state to every shard: each is on this host and shared memory is
        not off (a shard may still refuse the slots; its pushes then carry gradients alone)."""
        return all(self._shared.get(s, True) is not None and on_this_host(a) for s, a in enumerate(self.addresses))

    def _push(self, key, flat_grads, emb_grads, want_dense, bounds=(), states=None):
        requests = [
            pb.PushRequest(
                token=self.token,
                task_id=key.task_id,
                seq=key.seq,
                end=key.end,
                epoch=key.epoch,
                data_shard=key.data_shard,
                generation=key.generation,
                worker=self.pusher[0],
                launch=self.pusher[1],
                scale_skipped=key.scale_skipped,
                want_dense=want_dense,
                bounds=bounds,
            )
            for _ in self.stubs
        ]
        for name, (ids, values) in emb_grads.items():
            for shard, pos in enumerate(self.placement.split_ids(ids)):
                if len(pos):
                    e = requests[shard].embedding_grads.add(name=name)
                    tensors.encode(ids[pos], e.ids)
                    tensors.encode(values[pos], e.values)
        states = states or [None] * len(self.stubs)
        slot = self._free_slots.get()  # one per push in flight: never two pushes in one slot
        try:
            # Every shard gets the key, even with nothing to apply, so all shards agree on it.
            with moved_shards_named():
                if len(self.stubs) == 1:
                    replies = [self._push_shard(0, requests[0], flat_grads[0], slot, states[0])]
                else:
                    futures = [
                        self._pool.submit(self._push_shard, shard, r, flat, slot, state)
                        for shard, (r, flat, state) in enumerate(zip(requests, flat_grads, states))
                    ]
                    replies = [f.result() for f in futures]
        finally:
            self._free_slots.put(slot)
        return any(applied for applied, _ in replies), [fresh for _, fresh in replies]

    def _push_shard(
        self,
        shard: int,
        request: pb.PushRequest,
        flat: np.ndarray,
        slot: int,
        state: tuple[np.ndarray, int] | None = None,
    ) -> tuple[bool, tuple[int, np.ndarray | None, list[bool]]]:
        """`flat`: the shard's flat gradient, or, for a push of several minibatches, [minibatches, floats];
        `state`: (a copy's state, the version it was computed from), for a shared slot with room for it."""
        shared = self._shared_slots(shard, flat.shape[-1])
        if shared is not None:
            try:
                if state is not None and state[0].size == shared.slots.state_words:
                    # The state alone first: the shard of a lone worker takes it, and the gradients (the call's
                    # minibatches times the model) are neither read out of TensorFlow nor copied.
                    np.copyto(shared.slots.state(slot), state[0])
                    request.state_base = state[1]
                    applied, version, each = self._ring(shard, shared, slot, request)
                    if any(each):
                        return applied, (version, self._fresh(shared, slot, request), each)
                    request.ClearField("state_base")  # declined (another push came first): the gradients go
                flat = np.asarray(flat)
                np.copyto(shared.slots.gradient(slot)[: flat.size], flat.ravel())
                applied, version, each = self._ring(shard, shared, slot, request)
            except (Dropped, grpc.RpcError) as e:
                if isinstance(e, grpc.RpcError) and e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                # The shard dropped our segment (it keeps the most recently used ones): nothing
                # was applied, so the same key goes again with its bytes in the message.
                log.warning("PS shard %d dropped this worker's shared push slots: sending bytes", shard)
                # (Not closed here: another push may still be using them. They go with the last
                # reference; the shard has hung up its end already.)
                self._shared[shard] = None
                request.ClearField("shared")
                request.ClearField("state_base")
                return self._push_shard(shard, request, flat, slot)
            return applied, (version, self._fresh(shared, slot, request), each)
        flat = np.asarray(flat)
        tensors.encode(flat.ravel() if request.bounds else flat, request.dense_grads_flat)
        r = self.stubs[shard].PushGradients(request, timeout=self.timeout)
        values = tensors.decode(r.dense_flat) if request.want_dense else None
        return r.applied, (r.version, values, list(r.applied_each) or [r.applied])

    def _ring(self, shard: int, shared: SharedPath, slot: int, request: pb.PushRequest) -> tuple[bool, int, list[bool]]:
        """A push through a shared slot, its bytes in the slot: (applied, version, whether each minibatch was)."""
        if shared.bells is not None and not request.embedding_grads:
            base = request.state_base if request.HasField("state_base") else None
            return shared.bells[slot].ring(PushKey.of(request), request.want_dense, tuple(request.bounds), base)
        request.shared.segment, request.shared.slot = shared.segment, slot
        r = self.stubs[shard].PushGradients(request, timeout=self.timeout)
        return r.applied, r.version, list(r.applied_each) or [r.applied]

    @staticmethod
    def _fresh(shared: SharedPath, slot: int, request: pb.PushRequest) -> np.ndarray | None:
        # A copy: the slot is reused by the next push, and TensorFlow may alias a numpy buffer.
        return np.array(shared.slots.values(slot)) if request.want_dense else None

    def _shared_slots(self, shard: int, floats: int) -> SharedPath | None:
        """This shard's attached slots, attaching on first use when the shard is on this host."""
        if shard in self._shared:
            return self._shared[shard]
        with self._attach_lock:
            if shard not in self._shared:
                self._shared[shard] = self._attach(shard, floats)
        return self._shared[shard]

    def _attach(self, shard: int, floats: int) -> SharedPath | None:
        address = self.addresses[shard]
        if not on_this_host(address) or floats == 0:
            return None
        try:
            state_words = self._state_words[shard] if self._state_words else 0
            slots = PushSlots(
                floats, self._slots, tag=f"ps{shard}", minibatches=self._minibatches, state_words=state_words
            )
        except SharedMemoryUnavailable as e:
            log.info("PS shard %d: pushes carry their bytes (%s)", shard, e)
            return None
        try:
            reply = self.stubs[shard].AttachShared(
                pb.AttachSharedRequest(
                    token=self.token,
                    path=slots.path,
                    nonce=slots.nonce,
                    floats=floats,
                    slots=self._slots,
                    minibatches=self._minibatches,
                    state_words=state_words,
                ),
                timeout=self.timeout,
            )
        finally:
            slots.unlink()  # both ends have it mapped (or never will): no name left to leak
        if not reply.segment:
            log.info(
                "PS shard %d at %s refused shared push slots (%s): pushes carry their bytes",
                shard,
                address,
                reply.refused,
            )
            slots.close()
            return None
        bells = None
        if reply.doorbell:
            bells = []
            try:
                for i in range(self._slots):
                    bells.append(Bell(reply.doorbell, reply.segment, i, slots.nonce, self.timeout))
            except OSError as e:  # pushes still use the slots; their keys go in gRPC calls
                log.info("PS shard %d: cannot ring its doorbell (%s): push keys go in gRPC calls", shard, e)
                for bell in bells:
                    bell.close()
                bells = None
        log.info(
            "PS shard %d at %s: pushes go through shared memory (%d slots of %d x %d floats), %s",
            shard,
            address,
            self._slots,
            self._minibatches + 1,
            floats,
            "rung through its doorbell" if bells else "keys in gRPC calls",
        )
        return SharedPath(slots, reply.segment, bells)

    def all_rows(self) -> dict[str, np.ndarray]:
        """Every embedding table, whole (for export at the end of training)."""
        return {
            name: self.pull_rows({name: np.arange(rows, dtype=np.int64)})[name]
            for name, (rows, _dim) in self.placement.embeddings.items()
        }

    def final_named(self) -> dict[str, np.ndarray]:
        """Every variable as a finished training leaves it, when the optimizer keeps moving averages
        (use_ema): the averages, as `fit` leaves them (finalize_variable_values). From the shards' saved
        state, which holds them (ParameterShard.save)."""
        out: dict[str, np.ndarray] = {}
        tables = {name: np.empty(shape, np.float32) for name, shape in self.placement.embeddings.items()}
        for shard, npz in enumerate(self.save()):
            saved = np.load(io.BytesIO(npz), allow_pickle=False)
            out.update(self.placement.unflatten(shard, saved[FINAL_DENSE]))
            for name, table in tables.items():
                table[shard :: len(self.stubs)] = saved[FINAL_TABLE + name]
        out.update(tables)
        return out

    def stats(self) -> list[pb.PsStats]:
        return [s.Stats(pb.StatsRequest(token=self.token), timeout=self.timeout) for s in self.stubs]

    def save(self, timeout: float = 300.0) -> list[bytes]:
        """Every shard's whole state (ParameterShard.save), asked of all at once, in shard order."""
        return [r.npz for r in self._save(pb.SaveRequest.WHOLE, 0, timeout)]

    def take(self, cut: int, timeout: float = 300.0) -> list[int]:
        """Every shard keeps a copy of its state as checkpoint `cut`'s (ParameterShard.take): their versions."""
        return [r.version for r in self._save(pb.SaveRequest.TAKE, cut, timeout)]

    def send(self, cut: int, timeout: float = 300.0) -> list[bytes]:
        """The states `take` kept for checkpoint `cut`, in shard order."""
        return [r.npz for r in self._save(pb.SaveRequest.SEND, cut, timeout)]

    def _save(self, stage: int, cut: int, timeout: float) -> list:
        """Asked of all shards at once."""
        request = pb.SaveRequest(token=self.token, stage=stage, cut=cut)
        futures = [s.Save.future(request, timeout=timeout) for s in self.stubs]
        return [f.result() for f in futures]

    def restore(self, states: list[bytes], generation: int, timeout: float = 300.0) -> None:
        """Every shard back to a saved state, as `generation`, all at once."""
        futures = [
            s.Restore.future(pb.RestoreRequest(token=self.token, npz=npz, generation=generation), timeout=timeout)
            for s, npz in zip(self.stubs, states)
        ]
        for f in futures:
            f.result()

    def fence(self, worker: int, launch: int, timeout: float) -> list[str]:
        """Every shard refuses worker `worker`'s pushes of launches up to `launch` from now on. Returns, per
        shard that could not be told within `timeout`, why (a shard that does not answer is a frozen PS's
        business: the master's PS watch)."""
        request = pb.FenceRequest(token=self.token, instance=pb.Instance(role="worker", index=worker, launch=launch))
        calls = [s.Fence.future(request, timeout=timeout) for s in self.stubs]
        failed = []
        for shard, call in enumerate(calls):
            try:
                call.result()
            except grpc.RpcError as e:
                failed.append(f"shard {shard}: {e.code().name} {e.details()}")
        return failed

    def close(self) -> None:
        for shard, shared in self._shared.items():
            if shared is not None:
                for bell in shared.bells or []:
                    bell.close()
                try:
                    self.stubs[shard].DetachShared(
                        pb.DetachSharedRequest(token=self.token, segment=shared.segment), timeout=5
                    )
                except grpc.RpcError:
                    pass  # the shard is gone already, and its mapping with it
                shared.slots.close()
        self._shared = dict.fromkeys(range(len(self.stubs)))  # closed: nothing left to detach
        self._pool.shutdown(wait=True)
        for c in self._channels:
            c.close()
