"""The last stage's logits on their way to the coordinator: whole rows, or only a row's top ones.

A sampled row is ``vocab`` float32 logits: 196 KB for SmolLM2, 1 MB for Gemma 3, per sequence
and token, which on a Wi-Fi-class link to the coordinator is most of a decode step (20 Mbit/s:
a micro-batch of 8 SmolLM2 rows, 0.6 s). A request that greedy decoding or a top-k cut of at
most :data:`TOP_LOGITS` samples (no penalties, no log-probabilities) needs only its row's
:data:`TOP_LOGITS` largest logits: its entry asks for ``LAST_TOP`` and the last stage sends their
values and token ids (512 bytes). The coordinator puts them back in a row of ``-inf``, from which
argmax and the top-k draw pick what they pick from the whole row (unless more than
:data:`TOP_LOGITS` logits tie at the cut).

The payload of a micro-batch: the whole rows in order, then the top rows' values, then their
token ids (int32, carried in float32 slots bit for bit); which rows are which the entries say.
"""

from __future__ import annotations

import torch

from runtime.wire.messages import pb

#: the logits a ``LAST_TOP`` row carries (of the vocabulary's, if it is smaller)
TOP_LOGITS = 64


def top_rows(entries) -> list[bool]:
    """The rows of a micro-batch's result, in order, for its layout's ``entries`` (``pb.Entry``):
    each sent as its top logits (a ``LAST_TOP`` or ``ALL_TOP`` entry's) or whole."""
    return [e.logits in (pb.LAST_TOP, pb.ALL_TOP) for e in entries if e.logits != pb.NO_LOGITS
            for _ in range(e.length if e.logits in (pb.ALL_LOGITS, pb.ALL_TOP) else 1)]


def pack(out: torch.Tensor, top: list[bool]) -> torch.Tensor:
    """The payload for float32 logits ``out [rows, vocab]``, row ``i`` sent whole or as its top
    ones (``top[i]``): one float32 tensor, on ``out``'s device."""
    if not any(top):
        return out
    k = min(TOP_LOGITS, out.shape[1])
    flags = torch.tensor(top, device=out.device)
    values, ids = torch.topk(out[flags], k, dim=-1)
    return torch.cat([out[~flags].reshape(-1), values.reshape(-1), ids.to(torch.int32).view(torch.float32).reshape(-1)])


def payload_floats(top: list[bool], vocab: int) -> int:
    """How many float32 values the payload of rows ``top`` holds."""
    n = sum(top)
    return (len(top) - n) * vocab + 2 * n * min(TOP_LOGITS, vocab)


def unpack(buf: torch.Tensor, top: list[bool], vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` float32 logits from a payload of float32 ``buf`` (see :func:`pack`): a top
    row's logits where it sent them, ``-inf`` elsewhere."""
    if not any(top):
        return buf.view(len(top), vocab)
    if buf.numel() != payload_floats(top, vocab):
        raise ValueError(f"a payload of {buf.numel()} floats for {len(top)} rows ({sum(top)} of them top rows)")
    k, n = min(TOP_LOGITS, vocab), sum(top)
    whole = (len(top) - n) * vocab
    values = buf[whole:whole + n * k].view(n, k)
    ids = buf[whole + n * k:].view(torch.int32).view(n, k).long()
    out = torch.full((len(top), vocab), float("-inf"))
    flags = torch.tensor(top)
    out[~flags] = buf[:whole].view(-1, vocab)
    out[flags] = out[flags].scatter(1, ids, values)
    return out
