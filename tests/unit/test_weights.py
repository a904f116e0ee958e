"""The shared weights cache: verify, fetch, lock, and clear refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from llmgw_slurm.agent.errors import WeightsError
from llmgw_slurm.agent.weights import (
    MANIFEST,
    cache_key,
    effective_method,
    ensure_weights,
    verify_manifest,
)
from llmgw_slurm.catalog import WeightsSpec
from llmgw_slurm.config import AgentWeightsConfig


def make_model(root: Path) -> Path:
    src = root / "src" / "tiny"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"hidden_size": 64}')
    (src / "model.safetensors").write_bytes(os.urandom(200_000))
    (src / "sub" / "tokenizer.json").write_text("{}")
    return src


def test_copy_fetches_once_then_verifies(tmp_path: Path) -> None:
    src = make_model(tmp_path)
    settings = AgentWeightsConfig(cache_dir=tmp_path / "cache")
    w = WeightsSpec(str(src), "copy")
    first = ensure_weights("tiny", w, settings)
    assert first.fetched and first.bytes > 200_000
    assert Path(first.model_path) == tmp_path / "cache" / "models" / cache_key("tiny", w)
    copied = (Path(first.model_path) / "model.safetensors").read_bytes()
    assert copied == (src / "model.safetensors").read_bytes()
    manifest = json.loads((Path(first.model_path) / MANIFEST).read_text())
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "sub/tokenizer.json"}
    second = ensure_weights("tiny", w, settings)
    assert not second.fetched and Path(second.model_path) == Path(first.model_path)
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []


def test_damaged_copy_is_fetched_again(tmp_path: Path) -> None:
    src = make_model(tmp_path)
    settings = AgentWeightsConfig(cache_dir=tmp_path / "cache", verify="sha256")
    w = WeightsSpec(str(src), "copy")
    path = Path(ensure_weights("tiny", w, settings).model_path)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[10] ^= 0xFF  # same size: only sha256 sees it
    (path / "model.safetensors").write_bytes(bytes(data))
    assert "sha256" in (verify_manifest(path, "sha256") or "")
    assert verify_manifest(path, "size") is None
    again = ensure_weights("tiny", w, settings)
    assert again.fetched
    assert verify_manifest(path, "sha256") is None


def test_copy_without_manifest_is_incomplete(tmp_path: Path) -> None:
    src = make_model(tmp_path)
    settings = AgentWeightsConfig(cache_dir=tmp_path / "cache", fetch=False)
    w = WeightsSpec(str(src), "copy")
    final = tmp_path / "cache" / "models" / cache_key("tiny", w)
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    with pytest.raises(WeightsError) as info:
        ensure_weights("tiny", w, settings)
    msg = str(info.value)
    assert "not in the cache" in msg and "no manifest" in msg and "fetching is off" in msg


def test_missing_with_fetch_off_says_how_to_fix(tmp_path: Path) -> None:
    settings = AgentWeightsConfig(cache_dir=tmp_path / "cache", fetch=False)
    with pytest.raises(WeightsError, match="llmgw-agent fetch"):
        ensure_weights("tiny", WeightsSpec(str(tmp_path / "src"), "copy"), settings)


def test_hf_not_allowed(tmp_path: Path) -> None:
    settings = AgentWeightsConfig(cache_dir=tmp_path / "cache", allow_download=False)
    with pytest.raises(WeightsError, match="hub downloads are not allowed"):
        ensure_weights("tiny", WeightsSpec("hf:org/tiny", "hf"), settings)


def test_method_none_uses_weights_in_place(tmp_path: Path) -> None:
    src = make_model(tmp_path)
    settings = AgentWeightsConfig(cache_dir=tmp_path / "cache")
    got = ensure_weights("tiny", WeightsSpec(str(src), "none"), settings)
    assert got.model_path == str(src) and not got.fetched
    with pytest.raises(WeightsError, match="does not exist"):
        ensure_weights("tiny", WeightsSpec(str(tmp_path / "nope"), "none"), settings)
    # An hf: source left to the engine: it gets the repository id.
    hf = ensure_weights("tiny", WeightsSpec("hf:org/tiny", "none"), settings)
    assert hf.model_path == "org/tiny"
    assert ensure_weights("tiny", None, settings).model_path == ""


@pytest.mark.parametrize(
    ("source", "model", "site", "expected"),
    [
        ("/m", "none", "auto", "none"),
        ("/m", "none", "copy", "copy"),
        ("/m", "copy", "none", "none"),
        ("/m", "copy", "hf", "copy"),  # hf cannot fetch a local folder
        ("hf:o/n", "hf", "copy", "hf"),  # copy cannot stage a repository
        ("hf:o/n", "hf", "none", "none"),
        ("hf:o/n", "none", "hf", "hf"),
    ],
)
def test_site_method_applies_where_the_source_allows(
    source: str, model: str, site: str, expected: str
) -> None:
    assert effective_method(WeightsSpec(source, model), site) == expected


def test_site_forced_copy_stages_a_local_source(tmp_path: Path) -> None:
    src = make_model(tmp_path)
    settings = AgentWeightsConfig(cache_dir=tmp_path / "cache", method="copy")
    got = ensure_weights("tiny", WeightsSpec(str(src), "none"), settings)
    assert got.fetched and got.model_path.startswith(str(tmp_path / "cache"))


def test_copy_source_missing(tmp_path: Path) -> None:
    settings = AgentWeightsConfig(cache_dir=tmp_path / "cache")
    with pytest.raises(WeightsError, match="does not exist"):
        ensure_weights("tiny", WeightsSpec(str(tmp_path / "nope"), "copy"), settings)
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []


# A stand-in for `hf download REPO --local-dir DIR [--revision R]`: logs its
# argv, says it started, then waits for a "go" file before writing weights.
HF_STUB = textwrap.dedent(
    """\
    #!{python}
    import json, os, sys, time
    d = os.environ["STUB_DIR"]
    with open(os.path.join(d, "calls.jsonl"), "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
    open(os.path.join(d, "started"), "w").close()
    while not os.path.exists(os.path.join(d, "go")):
        time.sleep(0.02)
    out = sys.argv[sys.argv.index("--local-dir") + 1]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "model.bin"), "wb") as f:
        f.write(b"w" * 100000)
    with open(os.path.join(out, "config.json"), "w") as f:
        f.write("{{}}")
    """
)

FETCHER = textwrap.dedent(
    """\
    import json, sys
    from pathlib import Path
    from llmgw_slurm.config import AgentWeightsConfig
    from llmgw_slurm.catalog import WeightsSpec
    from llmgw_slurm.agent.weights import ensure_weights
    s = AgentWeightsConfig(cache_dir=Path(sys.argv[1]), allow_download=True)
    r = ensure_weights("tiny", WeightsSpec("hf:org/tiny@v1", "hf"), s)
    print(json.dumps({"path": r.model_path, "fetched": r.fetched}))
    """
)


def _stub_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "hf"
    stub.write_text(HF_STUB.format(python=sys.executable))
    stub.chmod(0o755)
    root = str(Path(__file__).resolve().parents[2])
    return dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        STUB_DIR=str(tmp_path),
        PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )


def _wait_for(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_two_processes_fetching_one_model_make_one_intact_copy(tmp_path: Path) -> None:
    env = _stub_env(tmp_path)
    cache = tmp_path / "cache"
    argv = [sys.executable, "-c", FETCHER, str(cache)]
    a = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "started")  # a holds the lock and is downloading
    b = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    # b cannot finish while a's download is under way: it waits on the lock.
    assert b.poll() is None
    (tmp_path / "go").touch()
    out_a, _ = a.communicate(timeout=60)
    out_b, _ = b.communicate(timeout=60)
    assert a.returncode == 0 and b.returncode == 0
    ra, rb = json.loads(out_a), json.loads(out_b)
    assert ra["path"] == rb["path"]
    assert sorted([ra["fetched"], rb["fetched"]]) == [False, True]
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 1
    assert calls[0][:2] == ["download", "org/tiny"]
    assert calls[0][calls[0].index("--revision") + 1] == "v1"
    final = Path(ra["path"])
    assert verify_manifest(final, "sha256") is None
    assert (final / "model.bin").read_bytes() == b"w" * 100000
    assert list((cache / "tmp").iterdir()) == []


def test_hf_failure_leaves_no_partial_copy(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "hf").write_text("#!/bin/sh\necho 'repository not found' >&2\nexit 3\n")
    (bin_dir / "hf").chmod(0o755)
    settings = AgentWeightsConfig(
        cache_dir=tmp_path / "cache", allow_download=True, hf_command=(str(bin_dir / "hf"),)
    )
    with pytest.raises(WeightsError, match=r"download org/tiny failed \(exit 3\)"):
        ensure_weights("tiny", WeightsSpec("hf:org/tiny", "hf"), settings)
    assert not (tmp_path / "cache" / "models").exists() or not any(
        (tmp_path / "cache" / "models").iterdir()
    )
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []
