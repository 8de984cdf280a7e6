"""A graded run's backend: the virtual cluster's rendezvous, with every collective carried out by a witness.

In a graded run the student's code shares its process with the ledger that records its collectives, so
that ledger is evidence only of what the process says. `WitnessedBackend` sends each collective through a
link (a socket the grading process handed the child) to a witness outside the student's process
(`autograder.witness`): every rank's arrival and, for an `async_op` collective, the moment it waits, and,
the stage's schedule marks (`zero_core.schedule`), and, once all the ranks of the collective have arrived,
their inputs, which the witness combines (the same
`reduce_in_rank_order`, concatenation or exchange as `VirtualBackend`, so the run stays bit for bit the
same) and sends back. What the witness records (the op, dtype, elements and group of each rank's
collectives, in order, and when each started and was waited on, on its own clock) is what the judge reads;
the collectives' data came from the witness, so a collective that did not go through it did not happen.

The wire: each message is a frame, `u32` length of a JSON header, the header, `u32` number of tensors, and
per tensor `u32` length of its JSON description (dtype, shape), the description, `u64` length of its bytes,
the bytes. Tensors travel as their raw little-endian bytes (bf16 included), so nothing is rounded.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from typing import Any

import torch

from zero_core.backends.base import CollectiveCall, Finish, ReduceOp
from zero_core.backends.virtual import Rendezvous, VirtualBackend

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16,
                                                      torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool)}


class WitnessError(RuntimeError):
    """The witness refused a message, or the link to it broke: the graded run cannot go on."""


def tensor_bytes(tensor: torch.Tensor) -> tuple[dict, bytes]:
    """(description, raw bytes) of a tensor, exact for every dtype."""
    flat = tensor.detach().contiguous().reshape(-1)
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}, (
        flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    )


def tensor_from(description: dict, data: bytes) -> torch.Tensor:
    """The tensor `tensor_bytes` described; `ValueError` for anything else."""
    dtype = DTYPES.get(description.get("dtype")) if isinstance(description, dict) else None
    shape = description.get("shape") if isinstance(description, dict) else None
    if dtype is None or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"not a tensor description: {description!r:.200}")
    numel = 1
    for size in shape:
        numel *= size
    if len(data) != numel * dtype.itemsize:
        raise ValueError(f"{len(data)} bytes for a {description['dtype']} tensor of shape {shape}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def write_frame(sock: socket.socket, header: dict, tensors: list[torch.Tensor] = ()) -> None:
    parts = [_prefixed(json.dumps(header).encode(), "<I"), struct.pack("<I", len(tensors))]
    for tensor in tensors:
        description, data = tensor_bytes(tensor)
        parts += [_prefixed(json.dumps(description).encode(), "<I"), _prefixed(data, "<Q")]
    sock.sendall(b"".join(parts))


def _prefixed(data: bytes, fmt: str) -> bytes:
    return struct.pack(fmt, len(data)) + data


def read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the link closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, max_header: int, max_bytes: int) -> tuple[dict, list[tuple[dict, bytes]]]:
    """(header, [(tensor description, bytes)]) of the next frame; `ValueError` past the caps."""
    (length,) = struct.unpack("<I", read_exactly(sock, 4))
    if length > max_header:
        raise ValueError(f"a header of {length:,} bytes (at most {max_header:,})")
    header = json.loads(read_exactly(sock, length))
    (count,) = struct.unpack("<I", read_exactly(sock, 4))
    if count > 4096:
        raise ValueError(f"{count} tensors in one message")
    tensors, total = [], 0
    for _ in range(count):
        (length,) = struct.unpack("<I", read_exactly(sock, 4))
        if length > max_header:
            raise ValueError("a tensor description too long")
        description = json.loads(read_exactly(sock, length))
        (size,) = struct.unpack("<Q", read_exactly(sock, 8))
        total += size
        if total > max_bytes:
            raise ValueError(f"more than {max_bytes:,} bytes of tensors in one message")
        tensors.append((description, read_exactly(sock, size)))
    if not isinstance(header, dict):
        raise ValueError("a header that is not a JSON object")
    return header, tensors


class WitnessLink:
    """The child's end of the link: one socket shared by the rank threads, one message at a time."""

    MAX_REPLY_BYTES = 1 << 30

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()
        self._arrivals: dict[int, int] = {}
        self.runs_begun = 0

    def send(self, header: dict, tensors: list[torch.Tensor] = ()) -> None:
        with self._lock:
            write_frame(self.sock, header, tensors)

    def begin_run(self, world_size: int, collectives: bool = True) -> None:
        """A graded run starts: the witness files what follows under a new run (numbered from 0). A run
        whose `collectives` do not go through the witness (the sized run whose memory the grader measures)
        only marks when it began."""
        self._arrivals = {rank: 0 for rank in range(world_size)}
        self.send({"kind": "run", "world_size": world_size, "collectives": collectives})
        self.runs_begun += 1

    def arrive(self, rank: int, call: CollectiveCall, numel: int) -> int:
        """Tell the witness `rank` entered `call`, of `numel` elements as the ledger counts them (an
        all-gather's output, every other collective's input); returns the rank's index of this collective."""
        index = self._arrivals[rank]
        self._arrivals[rank] = index + 1
        self.send({"kind": "arrive", "rank": rank, "op": call.op, "dtype": call.dtype, "numel": numel,
                   "group": list(call.group), "blocking": call.blocking})
        return index

    def wait(self, rank: int, index: int) -> None:
        self.send({"kind": "wait", "rank": rank, "index": index})

    def mark(self, rank: int, event: str, layer: str) -> None:
        """A schedule mark (`zero_core.schedule`), in the same stream as the rank's collectives: the witness
        times both on one clock, in the order the rank made them."""
        self.send({"kind": "mark", "rank": rank, "event": event, "layer": layer})

    def carry(self, call: CollectiveCall, how: dict, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The witness's combination of the group's `inputs` (group order): one or more tensors."""
        with self._lock:
            header = {"kind": "carry", "op": call.op, "group": list(call.group), **how}
            write_frame(self.sock, header, inputs)
            try:
                reply, tensors = read_frame(self.sock, 1 << 16, self.MAX_REPLY_BYTES)
            except (EOFError, ValueError, OSError) as error:
                raise WitnessError(f"the grading witness did not answer {call.describe()}: {error}") from None
        if reply.get("error"):
            raise WitnessError(f"the grading witness refused {call.describe()}: {reply['error']}")
        return [tensor_from(description, data) for description, data in tensors]


class WitnessedBackend(VirtualBackend):
    """`VirtualBackend`, with the witness told of every arrival and wait, and carrying out every combination."""

    name = "witnessed"

    def __init__(self, cluster: Rendezvous, rank: int, link: WitnessLink) -> None:
        super().__init__(cluster, rank)
        self.link = link

    def mark(self, event: str, layer: str) -> None:
        self.link.mark(self.rank, event, layer)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, call: CollectiveCall) -> Finish:
        return self._witnessed(call, tensor, {"reduce": op.value}, lambda out: out[0], tensor.copy_, tensor.numel())

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, call: CollectiveCall) -> Finish:
        index = call.group.index(self.rank) if call.group else self.rank

        def chunks(out: list[torch.Tensor]) -> list[torch.Tensor]:
            return list(out[0].view(-1, *call.output_shape).unbind(0))

        return self._witnessed(
            call, input, {"reduce": op.value}, chunks, lambda c: output.copy_(c[index]), input.numel()
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, call: CollectiveCall) -> Finish:
        return self._witnessed(
            call, input, {"shape": list(call.output_shape)}, lambda out: out[0], output.copy_, output.numel()
        )

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, call: CollectiveCall) -> Finish:
        index = call.group.index(self.rank) if call.group else self.rank
        return self._witnessed(
            call, input, {"shape": list(call.output_shape)}, lambda out: out, lambda c: output.copy_(c[index]),
            input.numel(),
        )

    def broadcast(self, tensor: torch.Tensor, src: int, call: CollectiveCall) -> Finish:
        return self._witnessed(call, tensor, {"src": src}, lambda out: out[0], tensor.copy_, tensor.numel())

    def barrier(self, call: CollectiveCall) -> Finish:
        return self._witnessed(call, None, {}, lambda out: None, lambda _: None, 0)

    def _witnessed(self, call: CollectiveCall, payload: Any, how: dict, shape: Any, take: Any, numel: int) -> Finish:
        """Tell the witness of the arrival, meet the other ranks; the last to arrive has the witness combine
        the inputs (`shape` cuts its answer as this backend's parent would); waiting is told too."""
        index = self.link.arrive(self.rank, call, numel)
        link = self.link

        def combine(inputs: list[Any]) -> Any:
            tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
            return shape(link.carry(call, how, tensors))

        if call.blocking:
            result = self.cluster.exchange(self.rank, call, payload, combine)
            take(result)
            return _done
        meeting = self.cluster.arrive(self.rank, call, payload, combine)

        def finish() -> None:
            link.wait(self.rank, index)
            take(self.cluster.result(self.rank, meeting))

        return finish


def _done() -> None:
    """The `Finish` of a blocking collective, already complete."""


def connect(fd: int) -> WitnessLink:
    """The link over the socket inherited as `fd`."""
    return WitnessLink(socket.socket(fileno=fd))


def now() -> float:
    """The witness's clock, and the child's marks' clock: `time.perf_counter()` (CLOCK_MONOTONIC, one per
    machine, so the two processes' readings compare)."""
    return time.perf_counter()
