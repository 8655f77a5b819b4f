"""The Detokenizer process: token ids → text deltas.

It runs ``radixrt.output.Detokenizer`` (incremental decode, stop strings cut
from the text; see there) on every ``BatchTokenOut`` and sends the
``BatchTextOut``, then a ``RidError(code=INTERNAL)`` for each request whose
delta raised (the TokenizerManager answers the client and aborts it in the
scheduler). Messages that are not token batches pass through unchanged; a
``RidError`` also drops the request's state, and a ``ReplicaDown`` (from the
launcher) drops the state of every request that replica was producing.
"""

from __future__ import annotations

import zmq

from radixrt.output import Detokenizer
from radixrt.protocol import BatchTokenOut, ReplicaDown, RidError, decode, encode
from radixrt.server import faults
from radixrt.server.common import POLL_MS, exit_if_orphaned, pull, push, report_ready, run_child
from radixrt.server.spawn_args import DetokenizerArgs


def run_detokenizer(args: DetokenizerArgs) -> None:
    def main(ctx: zmq.Context, ready: zmq.Socket) -> None:
        from transformers import AutoTokenizer

        detok = Detokenizer(AutoTokenizer.from_pretrained(args.model_path))
        armed = faults.parse(args.server.debug_faults)
        if armed is not None:
            faults.install_in_detokenizer(detok, armed)
        recv = pull(ctx, args.addrs.detokenizer)
        send = push(ctx, args.addrs.front)
        report_ready(ready, "detokenizer")
        owners: dict[str, int] = {}  # rid -> replica, while its text is being decoded
        while True:
            exit_if_orphaned(args.parent_pid)
            if not recv.poll(POLL_MS):
                continue
            data = recv.recv()
            msg = decode(data)
            if isinstance(msg, BatchTokenOut):
                track_owners(owners, msg)
                out = detok.process(msg)
                if out.items:
                    send.send(encode(out))
                for err in detok.errors:
                    send.send(encode(err))
            else:
                if isinstance(msg, RidError):
                    detok.forget(msg.rid)
                    owners.pop(msg.rid, None)
                elif isinstance(msg, ReplicaDown):
                    for rid in [r for r, i in owners.items() if i == msg.replica]:
                        detok.forget(rid)
                        del owners[rid]
                send.send(data)  # control replies and errors pass through

    run_child("detokenizer", args, main)


def track_owners(owners: dict[str, int], batch: BatchTokenOut) -> None:
    for item in batch.items:
        if item.finish_reason is None:
            owners[item.rid] = batch.replica
        else:
            owners.pop(item.rid, None)
