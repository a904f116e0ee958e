"""Files and batches on disk, in ``batch.directory``.

Layout (the folder is the daemon user's, 0700; batch jobs run as that user)::

    files/FILE_ID.json      the file object        files/FILE_ID.jsonl   its bytes
    batches/BATCH_ID.json   the batch record
    work/BATCH_ID/output.jsonl, errors.jsonl        what the batch's jobs append

Ids are made here (``file-`` or ``batch_`` and 24 hex digits) and checked on
every lookup, so no name a client sends ever becomes a path. Records are
rewritten atomically; they are read once at start and kept in memory. Every
lookup takes the owner: another owner's object is reported as missing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import secrets
import shutil
import time
from pathlib import Path

from llmgw_slurm.auth import private
from llmgw_slurm.base.fsutil import atomic_write
from llmgw_slurm.batch.model import BatchRecord, FileRecord

__all__ = ["BatchStore", "new_batch_id"]

log = logging.getLogger(__name__)

_FILE_ID = re.compile(r"file-[0-9a-f]{24}")
_BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
# A filename is only shown back: no path part, no control characters, bounded.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f/\\]")


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def clean_filename(name: str) -> str:
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    return _UNSAFE.sub("_", base)[:255] or "upload.jsonl"


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("", "files", "batches", "work"):
            private.private_dir(root / sub if sub else root, "batch.directory")
        self._files: dict[str, FileRecord] = {}
        self._batches: dict[str, BatchRecord] = {}
        self._load()

    def _load(self) -> None:
        for path in sorted((self.root / "files").glob("file-*.json")):
            with contextlib.suppress(OSError, ValueError, TypeError):
                rec = FileRecord(**json.loads(path.read_text()))
                self._files[rec.id] = rec
        for path in sorted((self.root / "batches").glob("batch_*.json")):
            try:
                b = BatchRecord.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError, KeyError) as err:
                log.warning("batch record %s unreadable, skipped: %s", path, err)
                continue
            self._batches[b.id] = b

    # ---- where records are kept (files here; llmgw_slurm.db.batches: the database) ----

    def _write_file(self, rec: FileRecord) -> None:
        atomic_write(self.root / "files" / f"{rec.id}.json", json.dumps(rec.__dict__), mode=0o600)

    def _forget_file(self, file_id: str) -> None:
        (self.root / "files" / f"{file_id}.json").unlink(missing_ok=True)

    def _write_batch(self, batch: BatchRecord) -> None:
        path = self.root / "batches" / f"{batch.id}.json"
        atomic_write(path, json.dumps(batch.to_json()), mode=0o600)

    async def synced(self, timeout: float = 5.0) -> bool:
        """Whether every change is where other daemons see it (here: written already)."""
        return True

    # ---- files ----------------------------------------------------------------------

    def new_upload(self) -> Path:
        """A fresh temporary path in files/ to stream an upload to (same filesystem)."""
        return self.root / "files" / f".upload-{secrets.token_hex(8)}.tmp"

    def add_file(self, owner: str, filename: str, purpose: str, source: Path) -> FileRecord:
        """Make ``source`` (in this store's folder) a file object of ``owner``'s."""
        fid = "file-" + secrets.token_hex(12)
        source.rename(self.data_path(fid))
        rec = FileRecord(
            fid,
            owner,
            clean_filename(filename),
            purpose,
            self.data_path(fid).stat().st_size,
            int(time.time()),
        )
        self._write_file(rec)
        self._files[fid] = rec
        return rec

    def data_path(self, file_id: str) -> Path:
        if not _FILE_ID.fullmatch(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / "files" / f"{file_id}.jsonl"

    def file(self, owner: str, file_id: str) -> FileRecord | None:
        rec = self._files.get(file_id)
        return rec if rec is not None and rec.owner == owner else None

    def files(self, owner: str, purpose: str | None = None) -> list[FileRecord]:
        out = [f for f in self._files.values() if f.owner == owner]
        return [f for f in out if purpose is None or f.purpose == purpose]

    def delete_file(self, owner: str, file_id: str) -> bool:
        if self.file(owner, file_id) is None:
            return False
        del self._files[file_id]
        self._forget_file(file_id)
        self.data_path(file_id).unlink(missing_ok=True)
        return True

    # ---- batches --------------------------------------------------------------------

    def save(self, batch: BatchRecord) -> None:
        if not _BATCH_ID.fullmatch(batch.id):
            raise ValueError(f"not a batch id: {batch.id!r}")
        self._write_batch(batch)
        self._batches[batch.id] = batch

    def batch(self, owner: str, batch_id: str) -> BatchRecord | None:
        b = self._batches.get(batch_id)
        return b if b is not None and b.owner == owner else None

    def batches(self, owner: str) -> list[BatchRecord]:
        return sorted(
            (b for b in self._batches.values() if b.owner == owner),
            key=lambda b: (b.created_at, b.id),
            reverse=True,
        )

    def delete_batch(self, owner: str, batch_id: str) -> bool:
        """Forget a finished batch of ``owner``'s: its record, its work folder and the
        files it wrote (its input file is the owner's to keep or delete)."""
        b = self.batch(owner, batch_id)
        if b is None:
            return False
        for fid in (b.output_file_id, b.error_file_id):
            if fid:
                self.delete_file(owner, fid)
        del self._batches[batch_id]
        (self.root / "batches" / f"{batch_id}.json").unlink(missing_ok=True)
        shutil.rmtree(self.root / "work" / batch_id, ignore_errors=True)
        return True

    def get(self, batch_id: str) -> BatchRecord | None:
        """For the daemon's own use (job reports, the poller): no owner check."""
        return self._batches.get(batch_id)

    def all_records(self) -> tuple[list[FileRecord], list[BatchRecord]]:
        """Every file and batch record, whoever owns them (``llmgw-admin db import``)."""
        return list(self._files.values()), list(self._batches.values())

    def unfinished(self) -> list[BatchRecord]:
        return [b for b in self._batches.values() if not b.status.is_final]

    def work_dir(self, batch_id: str) -> Path:
        if not _BATCH_ID.fullmatch(batch_id):
            raise ValueError(f"not a batch id: {batch_id!r}")
        path = self.root / "work" / batch_id
        path.mkdir(mode=0o700, exist_ok=True)
        return path
