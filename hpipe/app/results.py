"""A job's results file: JSONL, one complete line per finished document, safe to resume from.

Each line is written with one ``write`` on a file opened for appending, and flushed to the disk
at once, so a line is either whole or (after a crash mid-write) a torn tail without its newline.
Opening the file again cuts such a tail off, with a warning, so the next line never glues onto it.

Resuming is keyed on what determines an answer, not on the document's path: the prompt's token
ids (the document's text, the instruction, the prompt format and any truncation, as the model
sees them), the model and the generation settings (:func:`answer_key`). A document whose key is
already in the file with an answer is skipped; one recorded with an error, or with another key
(the instruction changed, say), runs again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def answer_key(prompt: list[int], **settings) -> str:
    """A digest of a prompt's token ids and every other setting that shapes its answer."""
    h = hashlib.sha256(json.dumps(prompt).encode())
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


class ResultsFile:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._repair()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _repair(self) -> None:
        """Cut a torn last line (no newline: a write that did not finish) off the file."""
        if not self.path.exists():
            return
        with open(self.path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            f.seek(0)
            data = f.read()
            keep = data.rfind(b"\n") + 1
            log.warning("%s ends in a torn line (%d bytes); cutting it off", self.path, size - keep)
            f.truncate(keep)

    def answered(self) -> set[str]:
        """The keys of documents answered already."""
        keys = set()
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "answer" in row and "error" not in row and "key" in row:
                keys.add(row["key"])
        return keys

    def append(self, row: dict) -> None:
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        written = os.write(self._fd, data)
        if written != len(data):  # a full disk, say: never leave a torn line behind silently
            raise OSError(f"wrote {written} of {len(data)} bytes of a result to {self.path}")
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ResultsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
