"""Offline installs: a folder of wheels for the course and its dependencies (``nvlab wheelhouse``).

Built on a machine that reaches PyPI, for one that does not (an air-gapped cluster, an offline GPU runner, an
NGC container without network)::

    nvlab wheelhouse DIR [--python 3.12] [--platform linux_x86_64] [--extras lab,torch] [--exclude-preinstalled]

``--exclude-preinstalled`` leaves out what the pinned NGC PyTorch image already has. The folder gets
``README.txt`` (the install commands, ``install_commands``) and ``requirements.txt``.

Design notes: docs/internals.md#nvlabopswheelhousepy"""

from __future__ import annotations

import email.parser
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab_utils.course.catalog import repo_root
from lab_utils.course.stack import manifest, pinned_release
from lab_utils.procs import temporary_folder
from nvlab import writable_problem
from nvlab.ops.stack import pip_version

# The newest glibc a named platform assumes: Ubuntu 22.04 (2.35). nvidia-pytriton's wheels need it; NGC 25.xx and
# later images are Ubuntu 24.04 (2.39). Ask for more with a manylinux tag, e.g. manylinux_2_39_x86_64.
DEFAULT_GLIBC = (2, 35)
_LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
STUB_LABEL = "preinstalled"  # local version label of the placeholder wheels for what the target already has
MIN_PYTHON = (3, 10)  # pyproject.toml's requires-python


class WheelhouseError(RuntimeError):
    """A wheelhouse cannot be built as asked; the message says why and what to do."""


@dataclass
class Wheelhouse:
    path: Path
    python: str  # "3.12"
    arch: str
    platform_tags: list[str]
    extras: list[str]
    left_out: dict[str, str]  # name -> version the manifest records for the target ("2.14.0")
    wheels: list[str] = field(default_factory=list)

    @property
    def size_mib(self) -> float:
        return sum(p.stat().st_size for p in self.path.glob("*.whl")) / 2**20


# --- target: Python version and platform tags -------------------------------------------------------


def target_python(text: str | None) -> str:
    """``"3.12"`` from ``--python`` (default: this interpreter); WheelhouseError below the course's minimum."""
    if text is None:
        return f"{sys.version_info.major}.{sys.version_info.minor}"
    if not (m := re.fullmatch(r"(?:cp|py)?(\d)\.?(\d+)", text.strip())):
        raise WheelhouseError(f"--python {text!r}: give the target's Python as MAJOR.MINOR, e.g. --python 3.12")
    version = (int(m.group(1)), int(m.group(2)))
    if version < MIN_PYTHON:
        raise WheelhouseError(f"--python {text}: the course needs Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} "
                              "(pyproject.toml requires-python)")
    return f"{version[0]}.{version[1]}"


def _unsupported(p: str) -> WheelhouseError:
    low = p.lower()
    kind = ("Windows" if low.startswith("win") else "macOS" if low.startswith("macosx") else
            "musl libc (Alpine)" if low.startswith("musllinux") else
            f"architecture {low.split('_', 1)[-1]}" if low.startswith(("linux_", "manylinux")) else "unknown")
    return WheelhouseError(
        f"platform {p!r} ({kind}) is not supported: the course installs on Linux with glibc on x86_64 or aarch64, "
        f"as NGC images and GPU servers are. Use --platform linux_x86_64 or linux_aarch64 (manylinux wheels up to "
        f"glibc {DEFAULT_GLIBC[0]}.{DEFAULT_GLIBC[1]}), or a manylinux tag such as manylinux_2_39_x86_64")


def _manylinux_tags(arch: str, glibc: tuple[int, int]) -> list[str]:
    """Every manylinux tag a machine with ``glibc`` accepts, newest first (pip wants the exact tags)."""
    tags = []
    for minor in range(glibc[1], 4, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        tags += [f"{legacy}_{arch}" for legacy, v in _LEGACY.items() if v == (2, minor)]
    return tags


def platform_tags(platforms: Sequence[str] | None) -> tuple[str, list[str]]:
    """(architecture, pip ``--platform`` tags) for ``--platform`` values (default: this machine's architecture)."""
    if not platforms:
        machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
        platforms = [f"linux_{machine}"]
    arches: set[str] = set()
    tags: list[str] = []
    for p in platforms:
        if m := re.fullmatch(r"linux[_-](x86_64|aarch64)", p):
            arch, glibc = m.group(1), DEFAULT_GLIBC
        elif m := re.fullmatch(r"manylinux_2_(\d+)_(x86_64|aarch64)", p):
            arch, glibc = m.group(2), (2, int(m.group(1)))
        elif (m := re.fullmatch(r"(manylinux1|manylinux2010|manylinux2014)_(x86_64|aarch64)", p)):
            arch, glibc = m.group(2), _LEGACY[m.group(1)]
        else:
            raise _unsupported(p)
        arches.add(arch)
        tags += [t for t in _manylinux_tags(arch, glibc) if t not in tags]
    if len(arches) > 1:
        raise WheelhouseError(f"--platform {' '.join(platforms)} mixes {' and '.join(sorted(arches))}: build one "
                              "wheelhouse per architecture")
    return arches.pop(), tags


def target_environment(python: str, arch: str) -> dict[str, str]:
    """Environment-marker values of the target (PEP 508), for re-evaluating requirements."""
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "implementation_version": f"{python}.0", "platform_python_implementation": "CPython", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": arch, "platform_release": "",
            "platform_version": ""}


# --- reading wheels ------------------------------------------------------------------------------


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _packaging() -> Any:
    from packaging import requirements, version

    return requirements, version


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        name = next((n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
        if name is None:
            raise WheelhouseError(f"{path.name} has no .dist-info/METADATA: not a wheel; remove it")
        msg = email.parser.HeaderParser().parsestr(z.read(name).decode("utf-8", "replace"))
    return str(msg["Name"]), str(msg["Version"]), list(msg.get_all("Requires-Dist") or [])


def missing_requirements(folder: Path, roots: Iterable[tuple[str, Iterable[str]]], environment: dict[str, str],
                         provided: dict[str, str] | None = None) -> list[str]:
    """Requirements of the wheels reachable from ``roots`` that no wheel in ``folder`` satisfies, for the target.

    ``roots`` are (name, extras); markers are evaluated with ``environment`` (``target_environment``);
    ``provided`` maps names the target already has (left out on purpose) to the version pip reports there
    ("2.14.0a0+5fa4b7e", or ``stack.pip_version``'s "2.14.0a0"): a requirement that version does not satisfy is
    missing too, as pip on the target would find it unmet."""
    requirements, version = _packaging()
    wheels: dict[str, list[tuple[Any, list[str]]]] = {}
    for w in sorted(folder.glob("*.whl")):
        name, ver, requires = wheel_metadata(w)
        wheels.setdefault(canonical(name), []).append((version.Version(ver), requires))
    have = {canonical(k): version.Version(v) for k, v in (provided or {}).items()}
    missing: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    queue = [(canonical(n), frozenset(e)) for n, e in roots]
    while queue:
        if (key := queue.pop()) in seen:
            continue
        seen.add(key)
        name, extras = key
        for _, requires in wheels.get(name, []):
            for line in requires:
                req = requirements.Requirement(line)
                wanted = {""} | set(extras)
                if req.marker and not any(req.marker.evaluate({**environment, "extra": e}) for e in wanted):
                    continue
                dep = canonical(req.name)
                extra = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
                if dep in have:
                    # pip admits an installed pre-release when the specifier contains it: 2.14.0a0 meets
                    # torch>=2.4 but not torch>=2.14.
                    if not req.specifier.contains(have[dep], prereleases=True):
                        missing.add(f"{req.name}{extra}{req.specifier}")
                    continue
                versions = [v for v, _ in wheels.get(dep, [])]
                if not any(req.specifier.contains(v, prereleases=True) for v in versions):
                    missing.add(f"{req.name}{extra}{req.specifier}")
                    continue
                queue.append((dep, frozenset(req.extras)))
    return sorted(missing)


# --- building -------------------------------------------------------------------------------------


def install_commands(wheelhouse: str, extras: str = "lab") -> list[str]:
    """The commands that install the course from ``wheelhouse`` with no index (run in the course checkout)."""
    spec = f".[{extras}]" if extras else "."
    cmds = [f"python -m pip install --no-index --find-links {wheelhouse} -e '{spec}'"]
    if "lab" in extras.split(","):
        cmds.append(f"python -m pip install --no-index --find-links {wheelhouse} --no-deps "
                    f"nvidia-pytriton=={manifest()['course']['nvidia-pytriton']}")
    cmds.append("nvlab doctor")
    return cmds


def _project_extras(root: Path) -> list[str]:
    text = (root / "pyproject.toml").read_text()
    block = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[)", text, re.MULTILINE | re.DOTALL)
    return re.findall(r"^([A-Za-z0-9_-]+)\s*=", block.group(1), re.MULTILINE) if block else []


def _build_requires(root: Path) -> list[str]:
    text = (root / "pyproject.toml").read_text()
    block = re.search(r"^\[build-system\]\n(.*?)(?=^\[|\Z)", text, re.MULTILINE | re.DOTALL)
    found = re.search(r"requires\s*=\s*\[(.*?)\]", block.group(1), re.DOTALL) if block else None
    return re.findall(r"\"([^\"]+)\"", found.group(1)) if found else ["setuptools"]


def _setuptools_builds_wheels() -> bool:
    """Whether this interpreter's setuptools can build the course's wheel itself (>= 70.1 has bdist_wheel built in,
    and pyproject.toml asks for >= 68): then pip skips setting up an isolated build environment."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:  # what is installed, read from its metadata: the course never imports setuptools
        found = installed("setuptools")
    except PackageNotFoundError:
        return False
    return tuple(int(p) for p in re.findall(r"\d+", found)[:2]) >= (70, 1)


def _stub_wheel(folder: Path, name: str, version: str) -> Path:
    """An empty wheel standing for a package the target already has (so the resolver does not fetch it)."""
    full = f"{version}+{STUB_LABEL}"
    dist = f"{name.replace('-', '_')}-{full}.dist-info"
    path = folder / f"{name.replace('-', '_')}-{full}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {full}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: nvlab\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def placeholder_args(folder: Path, left_out: dict[str, str]) -> list[str]:
    """pip arguments that make ``left_out`` (name -> the version pip reports on the target, "2.14.0a0") count as
    installed: placeholder wheels in ``folder`` and a constraint to exactly them, so nothing that needs e.g. torch
    downloads the real one, and a requirement the target's version does not meet fails the resolution."""
    if not left_out:
        return []
    stubs = folder / "placeholders"
    stubs.mkdir(exist_ok=True)
    constraints = folder / "placeholders.txt"
    constraints.write_text("".join(f"{n}=={v}+{STUB_LABEL}\n" for n, v in left_out.items()))
    for n, v in left_out.items():
        _stub_wheel(stubs, n, v)
    return ["--find-links", str(stubs), "--constraint", str(constraints)]


def _pip(args: list[str], what: str, python: str, arch: str, hint: str = "") -> None:
    """Run pip (its progress on the terminal); WheelhouseError naming the package pip could not find, or with
    ``hint`` when pip found the requirements in conflict."""
    proc = subprocess.Popen([sys.executable, "-m", "pip", *args], stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate()
    if proc.returncode == 0:
        return
    tail = "\n".join(line for line in err.strip().splitlines()[-6:] if line.strip())
    pkg = re.search(r"No matching distribution found for (\S+)", err) or re.search(
        r"Could not find a version that satisfies the requirement (\S+)", err)
    if pkg:
        raise WheelhouseError(f"{what}: no wheel of {pkg.group(1)} for CPython {python} on Linux {arch} "
                              f"(manylinux): PyPI has none for that target, or the target is unsupported; pick "
                              f"another --python/--platform, or leave the package's extra out.\npip said:\n{tail}")
    if hint and "ResolutionImpossible" in err:
        raise WheelhouseError(f"{what}: the requirements conflict. {hint}\npip said:\n{tail}")
    raise WheelhouseError(f"{what}: pip failed (exit {proc.returncode}).\npip said:\n{tail}")


def _image_note(left_out: dict[str, str], provided: dict[str, str], tag: str) -> str:
    """What the image has and why a requirement on it can fail there: the end of a WheelhouseError."""
    has = ", ".join(f"{n} {left_out[n]}" + (f" (pip sees {provided[n]}+<commit>, below {left_out[n]})"
                                            if provided[n] != left_out[n] else "") for n in provided)
    return (f"The NGC {tag} image has {has}, which pip there keeps: a dependency that needs another version cannot "
            "be installed. Pin that dependency to an older version, or move the manifest's pinned release to an "
            "image that meets it")


def build(dest: Path | str, *, python: str | None = None, platforms: Sequence[str] | None = None,
          extras: Sequence[str] = ("lab", "torch"), exclude_preinstalled: bool = False, root: Path | None = None,
          log: Callable[[str], None] = print) -> Wheelhouse:
    """Download wheels of the course and its dependencies into ``dest`` for the target; see the module docstring."""
    requirements, _ = _packaging()
    root = root or repo_root()
    if not (root / "pyproject.toml").is_file():
        raise WheelhouseError(f"{root} is not the course checkout (no pyproject.toml): run from the checkout")
    m = manifest()
    rel = pinned_release(m)
    if exclude_preinstalled and python is None:
        python = rel["python"]  # the image's Python
    py = target_python(python)
    arch, tags = platform_tags(platforms)
    valid = _project_extras(root)
    extras = [e for e in dict.fromkeys(x.strip() for x in extras) if e]
    if unknown := [e for e in extras if e not in valid]:
        raise WheelhouseError(f"--extras {','.join(unknown)}: the course's extras are {', '.join(valid)}")
    left_out: dict[str, str] = dict(rel.get("preinstalled", {})) if exclude_preinstalled else {}
    # What pip will report in the image (2.14.0a0+<commit>, not 2.14.0): requirements are judged against it.
    provided = {n: pip_version(n, rel["tag"], m) for n in left_out}
    image_names = {canonical(n) for n in provided}
    if exclude_preinstalled and "torch" in extras:
        extras.remove("torch")
        log(f"--exclude-preinstalled: torch comes from the NGC {rel['tag']} image, not from the wheelhouse")
    pkg_extras = [e for e in extras if e != "torch"]  # the torch extra is unpinned: the course's pin is used

    dest = Path(dest).resolve()
    if why := writable_problem(dest, "wheelhouse folder"):
        raise WheelhouseError(why)
    target = ["--only-binary=:all:", "--python-version", py, "--implementation", "cp"]
    for t in tags:
        target += ["--platform", t]
    what = f"CPython {py}, Linux {arch} (manylinux up to glibc 2.{int(tags[0].split('_')[2])})"
    log(f"wheelhouse for {what} in {dest}; extras: {','.join(extras) or 'none'}"
        + (f"; left out (the NGC {rel['tag']} image has them): {', '.join(left_out)}" if left_out else ""))

    with temporary_folder("wheelhouse") as tmp:
        # The course's wheel, built from a copy so the checkout gets no build/ or egg-info from this.
        src = tmp / "src"
        src.mkdir()
        for f in ("pyproject.toml", "README.md"):
            shutil.copy2(root / f, src / f)
        for pkg in ("lab_utils", "nvlab"):
            shutil.copytree(root / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        isolation = ["--no-build-isolation"] if _setuptools_builds_wheels() else []
        _pip(["wheel", "--quiet", "--no-deps", *isolation, "--wheel-dir", str(tmp / "course"), str(src)],
             "building the course's wheel", py, arch)
        course_wheel = next((tmp / "course").glob("*.whl"))

        extra_args = placeholder_args(tmp, provided)
        image_note = _image_note(left_out, provided, rel["tag"]) if provided else ""

        def download(args: list[str], what: str, hint: str = "") -> None:  # then the placeholders out of ``dest``
            _pip(["download", "--dest", str(dest), *target, *args], what, py, arch, hint)
            for stub in dest.glob(f"*+{STUB_LABEL}-*.whl"):
                stub.unlink()

        course_req = f"nvlab[{','.join(pkg_extras)}]" if pkg_extras else "nvlab"
        reqs = [f"{course_req} @ {course_wheel.as_uri()}", *_build_requires(root)]
        if "torch" in extras:
            reqs.append(f"torch=={m['course']['torch']}")
        if exclude_preinstalled and "lab" in pkg_extras:
            reqs.append(f"tritonclient[grpc,http]=={rel['tritonclient']}")  # the image's server's client
        log("resolving and downloading the course's dependencies with pip download ...")
        download([*extra_args, *reqs], "downloading the dependencies", image_note)
        if "lab" in pkg_extras:
            no_deps = [f"{n}=={m['course'][n]}" for n in ("nvidia-pytriton", "tensorrt-stubs")]
            download(["--no-deps", *no_deps], "downloading nvidia-pytriton and tensorrt-stubs")

        # pip judged environment markers for this interpreter: check the folder for the target, fetch what it lacks.
        roots: list[tuple[str, Iterable[str]]] = [("nvlab", pkg_extras), ("setuptools", ())]
        if "torch" in extras:
            roots.append(("torch", ()))
        env = target_environment(py, arch)
        for _ in range(3):
            if not (missing := missing_requirements(dest, roots, env, provided)):
                break
            # A requirement on what the image has cannot be downloaded: pip there keeps the image's version.
            if unmet := [r for r in missing if canonical(requirements.Requirement(r).name) in image_names]:
                raise WheelhouseError(f"for Python {py} the wheels need {', '.join(unmet)}. {image_note}")
            log(f"for Python {py} the wheels also need: {', '.join(missing)} (pip judged markers for Python "
                f"{target_python(None)}); downloading them ...")
            download([*extra_args, *missing], "downloading for the target's markers", image_note)
        else:
            if missing := missing_requirements(dest, roots, env, provided):
                raise WheelhouseError(f"the wheelhouse still lacks {', '.join(missing)} for Python {py}")

    course_version = wheel_metadata(next(dest.glob("nvlab-*.whl")))[1]
    house = Wheelhouse(dest, py, arch, tags, extras, left_out, sorted(p.name for p in dest.glob("*.whl")))
    _write_instructions(house, course_version, pkg_extras, m)
    log(f"{len(house.wheels)} wheels, {house.size_mib:.0f} MiB in {dest}; install as {dest / 'README.txt'} says")
    return house


def _write_instructions(house: Wheelhouse, course_version: str, pkg_extras: list[str], m: dict[str, Any]) -> None:
    extras = ",".join(pkg_extras)
    course_req = f"nvlab[{extras}]" if extras else "nvlab"
    reqs = [f"{course_req}=={course_version}"]
    if "torch" in house.extras:
        reqs.append(f"torch=={m['course']['torch']}")
    (house.path / "requirements.txt").write_text(
        f"# Top-level requirements of this wheelhouse (CPython {house.python}, Linux {house.arch}); see README.txt.\n"
        + "\n".join(reqs) + "\n")
    left = ", ".join(f"{n} {v}" for n, v in house.left_out.items())
    lines = [f"Wheels of nvlab {course_version} and its dependencies for CPython {house.python} on Linux {house.arch} "
             f"({house.platform_tags[0]} and older); extras: {','.join(house.extras) or 'none'}.",
             f"{len(house.wheels)} wheels, {house.size_mib:.0f} MiB."
             + (f" Left out because the target already has them (NGC {m['pinned']} image): {left}." if left else ""),
             "", "Install with no package index, in the course checkout (labs and solutions included):", "",
             *[f"    {c}" for c in install_commands(str(house.path), extras)], ""]
    if "lab" in pkg_extras:
        lines += ["or let ./course do the same offline" + (" (torch comes from here when none is importable):"
                                                           if "torch" in house.extras else ":"), "",
                  f"    PIP_NO_INDEX=1 PIP_FIND_LINKS={house.path} ./course lab", ""]
    lines += ["Without the checkout (the nvlab command and lab_utils only):", "",
              f"    python -m pip install --no-index --find-links {house.path} -r {house.path / 'requirements.txt'}",
              "", "If this folder moves, use its new path in these commands."]
    if "torch" not in house.extras and not house.left_out:
        lines.append("torch is not in this wheelhouse: the target must have it (nvlab doctor says so if not).")
    (house.path / "README.txt").write_text("\n".join(lines) + "\n")
