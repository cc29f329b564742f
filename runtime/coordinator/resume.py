"""Where a sequence resumes after a stage was lost, and the replays that rebuild what was lost.

Design note. After a daemon dies and comes back empty (or a redeployment drops a survivor's
cache), the coordinator's new session adopts every sequence the surviving daemons hold, and each
daemon reports, per held stage, how many positions are in the sequence's KV cache (``computed``)
and how many of the stage's outputs are in its replay log (``logged``; :mod:`runtime.daemon.replay_log`).
From these the coordinator picks the largest position ``P`` it can resume every stage at:

- a stage that holds at least ``P`` positions keeps them (positions past ``P`` were computed by
  micro-batches cut short by the failure; the next entry, starting at ``P``, rewinds them);
- a run of consecutive stages that hold fewer (the restarted daemon's) is rebuilt by *replays*:
  the stage before the run sends its logged outputs for the missing positions, or the
  coordinator sends the token ids when the run starts at stage 0; the run's stages compute them
  into their caches. A replay goes only as far as the last stage of the run that lacks its
  positions (a restarted stage lacks all of them; the stage after it may lack only the last
  few, which micro-batches in flight at the failure never brought it) and passes nothing on.

So no position already forwarded past the lost stages is sent or computed again, and the stages
before them do no work at all. ``P`` is 0 when no stage's log reaches far enough (budget
exceeded, or the daemon before the lost one was itself reloaded): the sequence is then prefilled
again from its token ids under a new id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from runtime.coordinator.request import Request
from runtime.wire.messages import pb

log = logging.getLogger(__name__)

#: the most tokens one replay micro-batch carries
REPLAY_TOKENS = 2048


@dataclass(frozen=True)
class Piece:
    """Positions ``[start, end)`` of a sequence, replayed through stages ``first..last``."""
    first: int
    last: int
    start: int
    end: int


def resume_point(progress: dict[int, tuple[int, int]], stages: int, limit: int) -> tuple[int, list[list[Piece]]]:
    """The position a sequence resumes at, and for each run of stages to rebuild, its pieces in
    position order.

    ``progress``: stage -> (computed, logged) for each stage whose daemon still holds the sequence;
    ``limit``: the most positions it may keep (one fewer than it has tokens, so that one is
    computed again and gives the next token's logits). (0, []) when it must start afresh."""
    for p in sorted({min(c, limit) for c, _ in progress.values()}, reverse=True):
        if p <= 0:
            break
        runs = _runs(progress, stages, p)
        if runs is not None:
            return p, runs
    return 0, []


def _runs(progress: dict[int, tuple[int, int]], stages: int, p: int) -> list[list[Piece]] | None:
    computed = [progress.get(j, (0, 0))[0] for j in range(stages)]
    runs, j = [], 0
    while j < stages:
        if computed[j] >= p:
            j += 1
            continue
        first = j
        while j < stages and computed[j] < p:
            j += 1
        if first > 0 and progress[first - 1][1] < p:
            return None  # the stage before the run has not logged far enough
        runs.append(_pieces(first, computed[first:j], p))
    return runs


def _pieces(first: int, computed: list[int], p: int) -> list[Piece]:
    """A run's positions cut where a stage of it already holds them: each piece goes only as far
    as the last stage that lacks its positions, so no stage after that one computes them again
    (a stage of the run before that one computes them again if it held them: it passes them on)."""
    cuts = sorted(set(computed) | {p})
    pieces: list[Piece] = []
    for a, b in zip(cuts, cuts[1:]):
        last = first + max(i for i, c in enumerate(computed) if c <= a)
        if pieces and pieces[-1].last == last:
            pieces[-1] = Piece(first, last, pieces[-1].start, b)
        else:
            pieces.append(Piece(first, last, a, b))
    return pieces


@dataclass
class Replay:
    """One replay micro-batch: stages ``first..last``, entries (sequence id, start, length)."""
    first: int
    last: int
    entries: list[tuple[int, int, int]]

    @property
    def tokens(self) -> int:
        return sum(n for _, _, n in self.entries)

    def micro_batch(self, request: Callable[[int], Request]) -> tuple[list[pb.Entry], torch.Tensor, pb.Replay]:
        """Its entries, token ids and stages as a session submits them (``request``: a sequence's)."""
        entries = [pb.Entry(sequence_id=i, start=a, length=n, logits=pb.NO_LOGITS,
                            max_len=request(i).max_len if a == 0 else 0, prefill_end=len(request(i).prompt))
                   for i, a, n in self.entries]
        tokens = torch.tensor([t for i, a, n in self.entries for t in request(i).prefix[a:a + n]], dtype=torch.long)
        return entries, tokens, pb.Replay(first=self.first, last=self.last)


def resume_requests(running: list[Request], resumed: dict[int, dict[int, tuple[int, int]]],
                    stages: int) -> tuple[dict[int, list[list[Piece]]], list[Request], int]:
    """Where each running request goes on after a recovery, from what the stages kept of its
    sequence (``resumed``: sequence -> stage -> (computed, logged)): (the runs to replay by
    sequence, the requests that start again in a new sequence, the positions kept)."""
    wanted, restarted, kept = {}, [], 0
    for r in sorted(running, key=lambda r: r.admitted):
        r.in_flight = 0
        prefix = r.prompt + r.tokens
        where = resumed.get(r.seq_id, {})
        p, runs = resume_point(where, stages, len(prefix) - 1)
        r.restart(prefix)
        r.resumed_at.append(p)
        if p:
            r.laid_out = p  # the next entry starts here, rewinding any stage that went further
            wanted[r.seq_id] = runs
            kept += p
        else:
            log.info("request %d starts again: its stages hold (computed, logged) %s", r.id, where)
            r.new_sequence()
            restarted.append(r)
    return wanted, restarted, kept


def replays(wanted: dict[int, list[list[Piece]]], max_tokens: int = REPLAY_TOKENS) -> list[Replay]:
    """Replay micro-batches for ``wanted`` (sequence id -> its runs' pieces), in order: in rounds,
    the k-th piece of every run, grouped by their stages and cut into micro-batches of at most
    ``max_tokens`` (a sequence at most once in each), so each sequence's pieces on a run come in
    position order."""
    out: list[Replay] = []
    rounds = max((len(run) for runs in wanted.values() for run in runs), default=0)
    for k in range(rounds):
        groups: dict[tuple[int, int], list[list[int]]] = {}
        for seq_id, runs in wanted.items():
            for run in runs:
                if k < len(run):
                    piece = run[k]
                    groups.setdefault((piece.first, piece.last), []).append([seq_id, piece.start, piece.end])
        for (first, last), pending in groups.items():
            while pending:
                batch = Replay(first, last, [])
                for item in pending:
                    room = max_tokens - batch.tokens
                    if room <= 0:
                        break
                    n = min(room, item[2] - item[1])
                    batch.entries.append((item[0], item[1], n))
                    item[1] += n
                pending = [t for t in pending if t[1] < t[2]]
                out.append(batch)
    return out
