"""One micro-batch on one stage, on the daemon's worker thread: compute it, pass it on.

Every entry's sequence is looked up again here: one that failed or closed since its layout, or
that a new session took over (``Resume``), is computed as a dead row (no cache read or written),
so its blocks, freed on this same thread, are never touched after they are given back; so is an
entry whose earlier positions this stage never computed. A dead row always travels with a failure
naming its sequence: the stages after this one do not write their caches from it, and the
coordinator does not sample it. A compute error fails the micro-batch's
sequences, and zeros of the right shape go on in its place, so the stages after it and the
coordinator still see the micro-batch complete, with the failures named.
"""

from __future__ import annotations

import logging

import torch

from hpipe.core.errors import HpipeError
from hpipe.model.compute.graphs import DecodeGraphs
from hpipe.model.kv.pool import Entry as KVEntry
from runtime.daemon.device_io import DeviceIO
from runtime.daemon.layout import LaidOutBatch, Layouts
from runtime.daemon.outbox import Outbox
from runtime.daemon.sequences import SequenceTable
from runtime.daemon.session_stats import SessionStats
from runtime.wire.logits import pack, top_rows
from runtime.wire.messages import pb

log = logging.getLogger(__name__)

#: what the model computes for an entry (a LAST_TOP entry: its last position's logits, of which
#: only the largest are sent on)
LOGITS = {pb.NO_LOGITS: "none", pb.LAST_LOGITS: "last", pb.ALL_LOGITS: "all", pb.LAST_TOP: "last", pb.ALL_TOP: "all"}


class MicroBatches:
    """Computes micro-batches on the worker thread; what it reads and where results go are its
    collaborators: the daemon's sequences, device I/O, outbox, statistics and layouts."""

    def __init__(self, sequences: SequenceTable, io: DeviceIO, outbox: Outbox, stats: SessionStats,
                 layouts: Layouts):
        self.sequences, self.io, self.outbox, self.stats, self.layouts = sequences, io, outbox, stats, layouts

    def __call__(self, stage, layout: LaidOutBatch, x, failed: list, received: float) -> None:
        failures = {f.sequence_id: f for f in failed}
        for seq_id, f in layout.failures.items():
            failures.setdefault(seq_id, f)
        entries, live_seqs = [], []
        for e in layout.entries:
            seq = self.sequences.find(e.sequence_id)
            if seq is not None and seq.session != layout.session:
                seq = None  # taken over by a recovering coordinator's new session
            if seq is None and e.sequence_id not in failures:
                # closed (or taken over) since its layout: its row is computed dead, and says so, so no
                # stage after this one writes its cache from the row and nobody samples its logits
                failures[e.sequence_id] = pb.Failure(sequence_id=e.sequence_id, code="NOT_FOUND", message=(
                    f"stage {stage.index}: sequence {e.sequence_id} was closed before this micro-batch was computed"))
            if seq is not None and seq.error:
                failures.setdefault(e.sequence_id, pb.Failure(sequence_id=e.sequence_id, code=seq.code or "ABORTED",
                                                              message=seq.error))
            live = seq is not None and e.sequence_id not in failures
            if live and e.start > seq.computed.get(stage.index, 0):
                # its earlier positions were never computed here (data of a session this stage joined
                # late, or after a failed entry): attention would read slots nobody wrote
                failures[e.sequence_id] = pb.Failure(sequence_id=e.sequence_id, code="ABORTED", message=(
                    f"stage {stage.index}: positions {seq.computed.get(stage.index, 0)}-{e.start} of sequence "
                    f"{e.sequence_id} were never computed here"))
                live = False
            if live:
                live_seqs.append((seq, e.start + e.length))
            entries.append(KVEntry(e.start, e.length, seq.kv.get(stage.index) if live else None, LOGITS[e.logits],
                                   e.prefill_end))
        model = stage.model
        out = None
        timer = self.io.timer()
        timer.start()
        if x is not None:
            try:
                out = _forward(stage, x.on_device(), entries)
                for seq, end in live_seqs:
                    seq.computed[stage.index] = end
            except HpipeError as err:
                self._fail_all(layout, failures, "INVALID_ARGUMENT", f"stage {stage.index}: {err}")
            except Exception as err:  # noqa: BLE001 - a bug must fail the micro-batch's sequences, not the worker
                log.exception("stage %d: computing micro-batch %d failed", stage.index, layout.id)
                self._fail_all(layout, failures, "INTERNAL", f"stage {stage.index}: internal error: {err!r}")
        timer.stop()
        if model.units.has_head:
            top = top_rows(layout.entries)
            if out is None or out.shape[0] != len(top):
                out = torch.zeros(len(top), model.cfg.vocab_size, device=model.device)
            out = pack(out.float(), top)
        elif out is None:
            out = torch.zeros(layout.tokens, model.cfg.hidden_size, dtype=model.dtype, device=model.device)
        act = pb.Activation(session=layout.session, micro_batch=layout.id, stage=stage.index + 1,
                            session_key=layout.key, failed=list(failures.values()))
        self.outbox.send(stage, act, self.io.download(out), layout)
        self.stats.add_span(layout.session, stage.index, layout.id, layout.tokens, received, timer)
        self.layouts.done(layout, stage.index)

    def _fail_all(self, layout: LaidOutBatch, failures: dict, code: str, message: str) -> None:
        for e in layout.entries:
            failures.setdefault(e.sequence_id, pb.Failure(sequence_id=e.sequence_id, code=code, message=message))
            seq = self.sequences.find(e.sequence_id)
            if seq is not None:
                seq.fail(code, message)


def _forward(stage, x: torch.Tensor, entries: list[KVEntry]) -> torch.Tensor | None:
    """The stage's output for the micro-batch: all-decode ones as a static step where the stage has
    one (a CUDA graph per batch bucket); if capturing or running it fails, the stage stops using
    static steps and the micro-batch runs the general path."""
    if stage.graphs is not None and DecodeGraphs.fits(entries):
        try:
            return stage.graphs(x, entries)
        except RuntimeError as err:  # CUDA's errors included
            log.warning("stage %d: static decode step failed (%s); running eagerly from now on", stage.index, err)
            stage.graphs = None
    return stage.model.forward_batch(x, entries, stage.pool)


def queued_shape(item: tuple) -> tuple[int, frozenset]:
    """A queued micro-batch's tokens and sequences (the worker runs small ones first)."""
    layout = item[1]
    return layout.tokens, frozenset(e.sequence_id for e in layout.entries)
