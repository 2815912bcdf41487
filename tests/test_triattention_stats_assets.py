"""TriAttention's published statistics as named assets (kvbench.assets.github): a named entry plans without its file
and keys like a local copy of the same bytes and name; resolution from the cache, a checked download (a wrong sha256
refuses and keeps nothing), the offline refusal in one line, and statistics of another model refused. No network:
the downloader is replaced; nothing here reads the authors' repository."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import triattention_stats
from kvbench.assets import github
from kvbench.budget import Budget
from kvbench.engine import CompressionSession
from kvbench.errors import ConfigError, DataError, NotAvailableError
from kvbench.methods import build_method
from kvbench.models.tiny import build_tiny_llama, resolve_tiny

ROOT = Path(__file__).resolve().parents[1]
SMOL_STATS = ROOT / "tests/fixtures/triattention/smollm2-135m.pt"


def _tiny(layers=3, heads=4, kv_heads=2, head_dim=16):
    arch = resolve_tiny({"layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim})
    return build_tiny_llama(arch, vocab_size=256, context_length=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                            attn_implementation="sdpa").eval()


@pytest.fixture
def catalog(tmp_path, monkeypatch):
    """A test entry ``authors:test/smol`` whose pinned sha256 is the SmolLM2 fixture's, an empty cache, and a
    downloader that copies from a local source (counting its calls)."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    sha = hashlib.sha256(SMOL_STATS.read_bytes()).hexdigest()
    entry = github.GitHubFile("test/smol", "owner/repo", "0" * 40, "calibration/smollm2-135m.pt", sha, "SmolLM2-135M")
    monkeypatch.setitem(github.TRIATTENTION_STATS, "test/smol", entry)
    calls = []

    def download(url, dest):
        calls.append(url)
        shutil.copyfile(SMOL_STATS, dest)

    monkeypatch.setattr(github, "_download", download)
    return entry, calls


def test_the_catalog_pins_the_authors_files():
    assert set(github.TRIATTENTION_STATS) == {f"for_aime2{a}_experiment/{m}" for a in (4, 5)
                                              for m in ("qwen3_8b", "ds_qwen7b", "ds_llama8b")}
    for entry in github.TRIATTENTION_STATS.values():
        assert entry.url == ("https://raw.githubusercontent.com/WeianMao/triattention/"
                             f"c3744ee6a50522a1559a577f85aef2b165a344f2/triattention/calibration/{entry.name}.pt")
        assert len(entry.sha256) == 64 and int(entry.sha256, 16) >= 0
    assert len({e.sha256 for e in github.TRIATTENTION_STATS.values()}) == 6


def test_a_named_entry_plans_without_the_file_and_keys_like_a_local_copy(catalog, tmp_path):
    entry, calls = catalog
    b = Budget.parse(128)
    named = build_method({"name": "triattention", "stats_path": "authors:test/smol"}, b).describe()
    assert calls == [] and not github.cached_path(entry).exists()
    local = build_method({"name": "triattention", "stats_path": str(SMOL_STATS)}, b).describe()
    assert named == local and named["stats_path"] == f"smollm2-135m.pt#sha256:{entry.sha256[:16]}"
    real = build_method({"name": "triattention", "stats_path": "authors:for_aime25_experiment/qwen3_8b"}, b)
    assert real.describe()["stats_path"] == "qwen3_8b.pt#sha256:1d133d9d3f6a4283"


def test_an_unknown_name_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"stats_path='authors:for_aime26_experiment/qwen3_8b' is not a published "
                                          r"statistics file; valid: authors:for_aime24_experiment/qwen3_8b, .*"):
        build_method({"name": "triattention", "stats_path": "authors:for_aime26_experiment/qwen3_8b"},
                     Budget.parse(128))


def test_download_once_then_the_cache(catalog):
    entry, calls = catalog
    method = build_method({"name": "triattention", "stats_path": "authors:test/smol"}, Budget.parse(128))
    method.fetch_assets()
    cached = github.cached_path(entry)
    assert calls == [entry.url] and cached.read_bytes() == SMOL_STATS.read_bytes()
    again = build_method({"name": "triattention", "stats_path": "authors:test/smol"}, Budget.parse(128))
    again.fetch_assets()
    assert calls == [entry.url] and again.stats()[0] == method.stats()[0]


def test_a_bad_sha256_refuses_and_keeps_nothing(catalog, monkeypatch):
    entry, _ = catalog
    monkeypatch.setattr(github, "_download", lambda url, dest: Path(dest).write_bytes(b"not the file"))
    method = build_method({"name": "triattention", "stats_path": "authors:test/smol"}, Budget.parse(128))
    with pytest.raises(DataError, match=rf"asset authors:test/smol downloaded from .* has sha256 "
                                        rf"{hashlib.sha256(b'not the file').hexdigest()}, expected {entry.sha256}; "
                                        r"nothing was kept"):
        method.fetch_assets()
    folder = github.cached_path(entry).parent
    assert not folder.exists() or list(folder.iterdir()) == []


def test_offline_and_not_cached_is_one_line(catalog, monkeypatch):
    entry, _ = catalog

    def offline(url, dest):
        raise OSError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(github, "_download", offline)
    method = build_method({"name": "triattention", "stats_path": "authors:test/smol"}, Budget.parse(128))
    with pytest.raises(NotAvailableError) as exc:
        method.fetch_assets()
    line = str(exc.value)
    assert "\n" not in line and line.startswith("asset authors:test/smol could not be downloaded (OSError")
    assert f"put smollm2-135m.pt (sha256 {entry.sha256}, from {entry.url}) at {github.cached_path(entry)}" in line
    assert line.endswith("or run: python -m kvbench.assets authors:test/smol")
    with pytest.raises(NotAvailableError, match="is not cached and downloads are off"):
        github.fetch_file(entry, download=False)


def test_a_named_file_for_another_model_is_refused(catalog, monkeypatch):
    """A fake file in the authors' format for a 2-layer model, pinned in a test entry, against a 3-layer model."""
    other = Path(triattention_stats(_tiny(layers=2)))
    entry = github.GitHubFile("test/other", "owner/repo", "1" * 40, "calibration/other.pt",
                              hashlib.sha256(other.read_bytes()).hexdigest(), "tiny 2 layers")
    monkeypatch.setitem(github.TRIATTENTION_STATS, "test/other", entry)
    monkeypatch.setattr(github, "_download", lambda url, dest: shutil.copyfile(other, dest))
    b = Budget.parse(48)
    method = build_method({"name": "triattention", "stats_path": "authors:test/other"}, b)
    method.fetch_assets()
    model = _tiny(layers=3)
    with pytest.raises(ConfigError, match=r"stats_path='authors:test/other' holds statistics of a model with 2 "
                                          r"layers, kvbench compresses 3 layers"):
        with CompressionSession(model, method, b):
            pass


def test_the_command_line_refuses_unknown_names(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvbench.assets", "authors:nope"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                                                     "KVBENCH_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 2 and "unknown asset(s) authors:nope; valid: " in proc.stderr
    assert "triattention (all of authors:for_aime24_experiment/qwen3_8b" in proc.stderr


def test_the_run_refuses_offline_in_one_line_before_the_model_loads(tmp_path, monkeypatch):
    """Through ``python -m kvbench.run``: an empty cache and no route to GitHub (a proxy on a closed local port) give
    exit 2 and one line naming the asset, where to put it and the fetch command; the model is never loaded."""
    import os

    monkeypatch.setenv("KVBENCH_FAULT", "model_load:1")  # reaching the model's load would SIGKILL the process
    env = {**os.environ, "KVBENCH_RESULTS_DIR": str(tmp_path / "results"), "KVBENCH_CACHE_DIR": str(tmp_path / "c"),
           "https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": "", "NO_PROXY": ""}
    proc = subprocess.run([sys.executable, "-m", "kvbench.run", "method=triattention", "budget=128",
                           "method.stats_path=authors:for_aime25_experiment/qwen3_8b"], capture_output=True,
                          text=True, env=env, timeout=120, cwd=ROOT)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "asset authors:for_aime25_experiment/qwen3_8b could not be downloaded" in lines[0]
    assert lines[0].endswith("or run: python -m kvbench.assets authors:for_aime25_experiment/qwen3_8b")
    assert not any((tmp_path / "c").rglob("*.pt"))


def test_a_wrong_file_in_the_cache_is_refused_in_one_line(catalog):
    """A file put at the cached path by hand is checked too: the job key names the pinned bytes, so other bytes there
    would be results stored under the wrong key."""
    entry, calls = catalog
    cached = github.cached_path(entry)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"another file")
    method = build_method({"name": "triattention", "stats_path": "authors:test/smol"}, Budget.parse(128))
    digest = hashlib.sha256(b"another file").hexdigest()
    with pytest.raises(DataError, match=re.escape(f"at {cached} has sha256 {digest}, expected {entry.sha256}; remove "
                                                  "it and run: python -m kvbench.assets authors:test/smol")):
        method.fetch_assets()
    assert calls == [] and cached.read_bytes() == b"another file"  # nothing downloaded over it, nothing deleted
