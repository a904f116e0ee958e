"""Weights in a shared cache: verify what is there, fetch what is missing.

Layout under ``cache_dir``::

    models/{key}/                 complete copies only (they appear by rename)
    models/{key}/.llmgw-manifest.json   sizes and sha256 of every file, written last
    locks/{key}.lock              one writer per model at a time
    tmp/{key}.{host}.{pid}.{rand}/  a fetch in progress
    traces/{key}.traceparent      the trace of the model job that fetched it (a
                                  replica start that uses the copy links to it)

``key`` is the model name plus a digest of the source (revision included),
so a catalog change of source never reuses a stale copy.

Two jobs fetching the same model, on one node or many, take the lock in turn:
the second finds the first's complete copy and only verifies it. The lock is
a POSIX record lock (:func:`llmgw_slurm.base.fsutil.locked`), which NFS and Lustre
carry to the file server where ``flock`` may stay local to a node. POSIX locks
belong to the process, so two threads of one process do not exclude each other:
the agent fetches once per process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from llmgw_slurm.agent.errors import WeightsError
from llmgw_slurm.base.fsutil import LockTimeout, atomic_write, locked
from llmgw_slurm.catalog import WeightsSpec
from llmgw_slurm.config import AgentWeightsConfig

__all__ = [
    "MANIFEST",
    "FetchResult",
    "cache_key",
    "effective_method",
    "ensure_weights",
    "trace_marker_path",
    "verify_manifest",
]

log = logging.getLogger(__name__)

MANIFEST = ".llmgw-manifest.json"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FetchResult:
    """``model_path`` is what the engine is given: a folder, or an ``ORG/NAME``
    repository id when method none leaves an hf: source to the engine."""

    model_path: str
    fetched: bool  # False: an existing copy was verified (or used in place)
    method: str
    bytes: int


def cache_key(model: str, weights: WeightsSpec) -> str:
    # The source (revision included), not the method: a copy and an hf fetch
    # of different sources must never share a folder.
    return f"{model}-{hashlib.sha256(weights.source.encode()).hexdigest()[:12]}"


def trace_marker_path(cache_dir: Path, model: str, weights: WeightsSpec | None) -> Path | None:
    """Where a model job leaves its trace context for the weights it fetched."""
    if weights is None:
        return None
    return cache_dir / "traces" / f"{cache_key(model, weights)}.traceparent"


def effective_method(weights: WeightsSpec, site_method: str) -> str:
    """The model's method, or the site's forced one where the source allows it."""
    if site_method == "auto" or site_method == weights.method:
        return weights.method
    is_hf = weights.hf_repo is not None
    if site_method == "none" or (site_method == "hf") == is_hf:
        return site_method
    log.info(
        "weights: site method %s does not fit %s; using %s",
        site_method,
        weights.source,
        weights.method,
    )
    return weights.method


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.name == MANIFEST and p.parent == root:
                continue
            yield p


def write_manifest(root: Path, source: str) -> int:
    """Hash every file under ``root`` and write the manifest; returns total bytes."""
    files: dict[str, dict[str, object]] = {}
    total = 0
    for p in _files(root):
        size = p.stat().st_size
        total += size
        files[p.relative_to(root).as_posix()] = {"size": size, "sha256": _sha256(p)}
    doc = {"version": 1, "source": source, "written_at": time.time(), "files": files}
    atomic_write(root / MANIFEST, json.dumps(doc, indent=1, sort_keys=True))
    return total


def verify_manifest(root: Path, mode: str = "size") -> str | None:
    """None when ``root`` matches its manifest, else what is wrong."""
    mpath = root / MANIFEST
    try:
        doc = json.loads(mpath.read_text())
        files = doc["files"]
        if not isinstance(files, dict):
            return f"{mpath}: unreadable manifest"
    except FileNotFoundError:
        return f"{mpath}: no manifest (an incomplete copy)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{mpath}: unreadable manifest ({err})"
    for rel, meta in files.items():
        p = root / rel
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            return f"{p}: missing"
        if size != meta.get("size"):
            return f"{p}: {size} bytes, manifest says {meta.get('size')}"
        if mode == "sha256" and _sha256(p) != meta.get("sha256"):
            return f"{p}: sha256 differs from the manifest"
    return None


@contextmanager
def _locked(lock_path: Path, timeout_s: float) -> Iterator[None]:
    def waiting() -> None:
        log.info("weights: another job holds %s, waiting", lock_path)

    try:
        with locked(lock_path, timeout_s=timeout_s, on_wait=waiting):
            yield
    except LockTimeout as err:
        raise WeightsError(
            f"weights: waited {timeout_s:.0f}s for {lock_path}, held by another "
            "fetch of the same model; is it stuck?"
        ) from err


def _fetch_copy(source: Path, dest: Path) -> None:
    if not source.exists():
        raise WeightsError(f"weights: copy source {source} does not exist")
    if source.is_dir():
        shutil.copytree(source, dest, symlinks=False)
    else:
        dest.mkdir(parents=True)
        shutil.copy2(source, dest / source.name)


def _hf_command(settings: AgentWeightsConfig) -> list[str]:
    cmd = list(settings.hf_command)
    if cmd == ["hf"] and shutil.which("hf") is None and shutil.which("huggingface-cli"):
        # Older huggingface_hub releases ship only the long name.
        cmd = ["huggingface-cli"]
    if shutil.which(cmd[0]) is None:
        raise WeightsError(
            f"weights: {cmd[0]} not found on PATH; install huggingface_hub in the agent's "
            "environment or name it in agent.yaml (weights.hf_command)"
        )
    return cmd


def _fetch_hf(weights: WeightsSpec, dest: Path, settings: AgentWeightsConfig) -> None:
    repo = weights.hf_repo
    assert repo is not None  # method hf only for hf: sources (catalog.WeightsSpec)
    argv = [*_hf_command(settings), "download", repo, "--local-dir", str(dest)]
    if weights.hf_revision:
        argv += ["--revision", weights.hf_revision]
    env = dict(os.environ, HF_HUB_DISABLE_TELEMETRY="1")
    log.info("weights: running %s", argv)
    dest.mkdir(parents=True)
    proc = subprocess.run(argv, env=env, check=False, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise WeightsError(
            f"weights: {argv[0]} download {repo} failed (exit {proc.returncode}); "
            "its output is above in the job log"
        )


def ensure_weights(
    model: str, weights: WeightsSpec | None, settings: AgentWeightsConfig
) -> FetchResult:
    """Return a verified local path for the model's weights, fetching if allowed.

    Blocking (hashing and copying): call it from a thread in async code.
    """
    if weights is None:
        # A command engine that brings its own model.
        return FetchResult("", fetched=False, method="none", bytes=0)
    method = effective_method(weights, settings.method)
    if method == "none":
        if weights.hf_repo is not None:
            # Left to the engine, which resolves the repository itself.
            return FetchResult(weights.hf_repo, fetched=False, method="none", bytes=0)
        src = Path(weights.source)
        if not src.exists():
            raise WeightsError(
                f"weights for {model}: {src} does not exist (method none uses the weights "
                "in place; check the catalog's weights.source and that the filesystem is "
                "mounted on this node)"
            )
        if (src / MANIFEST).exists():
            problem = verify_manifest(src, settings.verify)
            if problem:
                raise WeightsError(f"weights for {model}: {problem}")
        return FetchResult(str(src), fetched=False, method="none", bytes=0)

    key = cache_key(model, weights)
    cache = settings.cache_dir
    final = cache / "models" / key

    problem = verify_manifest(final, settings.verify) if final.exists() else "absent"
    if problem is None:
        return FetchResult(str(final), fetched=False, method=method, bytes=0)
    if not settings.fetch:
        raise WeightsError(
            f"weights for {model} are not in the cache ({final}: {problem}) and fetching "
            "is off on this site; run the model's fetch job first (llmgw-agent fetch), or "
            "turn fetching on in agent.yaml"
        )
    if method == "hf" and not settings.allow_download:
        raise WeightsError(
            f"weights for {model} are not in the cache ({final}: {problem}) and hub "
            "downloads are not allowed from this node; fetch them with a model job where "
            "they are, or allow hf in agent.yaml"
        )

    with _locked(cache / "locks" / f"{key}.lock", settings.lock_timeout):
        # Someone may have finished while we waited for the lock.
        problem = verify_manifest(final, settings.verify) if final.exists() else "absent"
        if problem is None:
            log.info("weights: %s completed by another job while waiting", final)
            return FetchResult(str(final), fetched=False, method=method, bytes=0)
        tmp_root = cache / "tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        # We hold the lock: any leftover temp dir of this key is from a fetch
        # that died, and is ours to remove.
        for stale in tmp_root.glob(f"{key}.*"):
            shutil.rmtree(stale, ignore_errors=True)
        suffix = f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
        tmp = tmp_root / f"{key}.{suffix}"
        try:
            if method == "copy":
                _fetch_copy(Path(weights.source), tmp)
            else:
                _fetch_hf(weights, tmp, settings)
            total = write_manifest(tmp, f"{method}:{weights.source}")
            if final.exists():
                log.warning("weights: replacing bad copy %s (%s)", final, problem)
                trash = tmp_root / f"{key}.old.{suffix}"
                final.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return FetchResult(str(final), fetched=True, method=method, bytes=total)
