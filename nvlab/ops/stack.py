"""The files that must agree with the version manifest (``lab_utils.course.stack``), checked and generated.

``check(root)`` compares the manifest with the Dockerfile, ``docker/.env``, ``docker/compose.yaml``, ``./course``
and ``pyproject.toml``; ``compose_env`` writes ``docker/.env``; ``same_release``, ``pip_version`` and
``installed_mismatch`` compare the manifest's versions with pip's.

    python -m nvlab.ops.stack env > docker/.env    # write the compose file's image tags from the manifest
    python -m nvlab.ops.stack check                # exit 1 with one line per mismatch
    python -m nvlab.ops.stack installed 26.09 torch  # print pip's torch here; exit 1 unless it is the image's

Design notes: docs/internals.md#lab_utilscoursestackpy"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from lab_utils.course.catalog import repo_root
from lab_utils.course.stack import (
    MANIFEST_NAME,
    REGISTRY,
    dist_version,
    image_ref,
    manifest,
    ngc_release,
    pinned_release,
    release,
)


def same_release(recorded: str, reported: str) -> bool:
    """Whether a version pip reports ("2.14.0a0+5fa4b7e", "11.3.0.36") is the manifest's ("2.14.0", "11.3.0"):
    its release numbers cut to the manifest's precision are the manifest's (missing ones count as 0, as in PEP 440).
    Pre-release, post-release and local parts are ignored, so 2.14.0a0+5fa4b7e is the image's 2.14.0."""
    want = release(recorded)
    return (release(reported) + (0,) * len(want))[:len(want)] == want


def recorded_version(name: str, tag: str | None = None, m: dict[str, Any] | None = None) -> str:
    """The version of ``name`` the manifest records for NGC ``tag``'s image (default: the pinned release): its
    ``preinstalled`` entry ("2.14.0"), else the release's own field ("torch": "2.10"); KeyError naming the fix."""
    m = m or manifest()
    rel = ngc_release(tag or m["pinned"], m)
    if not (version := rel.get("preinstalled", {}).get(name) or rel.get(name)):
        raise KeyError(f"{MANIFEST_NAME}: NGC {rel['tag']} records no {name} version: add it under the release's "
                       "'preinstalled'")
    return str(version)


def pip_version(name: str, tag: str | None = None, m: dict[str, Any] | None = None) -> str:
    """The lowest version pip may report for the image's ``name``, the part only the image knows (commit, build
    number) left off: "2.14.0a0" for a package the release lists under ``pip_prerelease`` (NGC's torch), else
    the recorded release ("11.3.0" for TensorRT 11.3.0.36). Requirements are judged against it as pip will."""
    m = m or manifest()
    version = recorded_version(name, tag, m)
    prerelease = name in ngc_release(tag or m["pinned"], m).get("pip_prerelease", [])
    return f"{'.'.join(map(str, release(version)))}a0" if prerelease else version


def installed_mismatch(name: str, reported: str | None, tag: str | None = None) -> str | None:
    """Why ``reported`` (what pip reports for ``name`` here; None: not installed) is not NGC ``tag``'s ``name``,
    or None when it is."""
    tag = tag or manifest()["pinned"]
    want = recorded_version(name, tag)
    if reported is None:
        return f"this Python has no {name}, but {MANIFEST_NAME} says the NGC {tag} image carries {name} {want}"
    if same_release(want, reported):
        return None
    return (f"this Python's {name} is {reported} (as pip reports it), but {MANIFEST_NAME} says the NGC {tag} image "
            f"carries {name} {want}: correct the manifest's {tag} entry, or build from the image of the release "
            "the manifest describes")


# What the pinned release must state (the NGC release notes: tag -> CUDA, torch, TensorRT, Triton, tritonclient).
PINNED_FIELDS = ("cuda", "python", "torch", "tensorrt", "triton_server", "tritonclient")


def env_values(m: dict[str, Any] | None = None) -> dict[str, str]:
    """The variables ``docker/.env`` holds for the compose file (image tags and build arguments)."""
    m = m or manifest()
    rel = pinned_release(m)
    return {"NGC_TAG": rel["tag"], "TRITONCLIENT_VERSION": rel["tritonclient"],
            "PYTRITON_VERSION": m["course"]["nvidia-pytriton"], "PROMETHEUS_VERSION": m["services"]["prometheus"],
            "GRAFANA_VERSION": m["services"]["grafana"], "DCGM_EXPORTER_TAG": m["services"]["dcgm_exporter"]}


def compose_env() -> str:
    """The text of ``docker/.env``, generated from the manifest."""
    lines = [
        f"# Generated from {MANIFEST_NAME} by `python -m nvlab.ops.stack env > docker/.env`: "
        "do not edit by hand.",
        "# Image tags only. Secrets (JUPYTER_TOKEN, GRAFANA_ADMIN_PASSWORD) go in the shell's environment, never here.",
    ]
    lines += [f"{k}={v}" for k, v in env_values().items()]
    return "\n".join(lines) + "\n"


# --- reading the consumers ------------------------------------------------------------------------


def parse_env_file(text: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of a compose ``.env`` file (comments and blank lines skipped)."""
    out = {}
    for line in text.splitlines():
        if (line := line.strip()) and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip().strip("\"'")
    return out


def dockerfile_args(text: str) -> dict[str, str]:
    """Default values of ``ARG NAME=VALUE`` lines (the first default of each name)."""
    out: dict[str, str] = {}
    for m in re.finditer(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)=(\S+)", text, re.MULTILINE):
        out.setdefault(m.group(1), m.group(2).strip("\"'"))
    return out


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-?])([^}]*))?\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose-style ``${NAME}``, ``${NAME:-default}`` and ``${NAME:?message}`` with ``env``; KeyError if unset."""

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == "-":
            return arg
        raise KeyError(f"${{{name}}} is not set" + (f": {arg}" if op == "?" else ""))

    return _VAR.sub(sub, value)


# --- the check ------------------------------------------------------------------------------------


def check(root: Path, m: dict[str, Any] | None = None) -> list[str]:
    """Every disagreement between the manifest and the files under ``root``, each naming both sides."""
    m = m or manifest()
    problems: list[str] = []
    rel = pinned_release(m)
    tag = rel["tag"]
    src = MANIFEST_NAME

    if missing := [f for f in PINNED_FIELDS if not rel.get(f)]:
        problems.append(f"{src}: pinned release {tag} does not state {', '.join(missing)}")
    for t, r in m["ngc"].items():
        if r.get("triton_server") and r.get("tritonclient") and r["triton_server"] != r["tritonclient"]:
            problems.append(f"{src}: release {t} pairs Triton server {r['triton_server']} with tritonclient "
                            f"{r['tritonclient']}: the client must match the server's release")
    if "pytorch" not in rel.get("images", []) or "tritonserver" not in rel.get("images", []):
        problems.append(f"{src}: pinned release {tag} must list both the pytorch and the tritonserver image")
    for t, r in m["ngc"].items():
        for name, version in r.get("preinstalled", {}).items():
            if r.get(name) and not same_release(r[name], version):
                problems.append(f"{src}: release {t} has {name} {r[name]} but lists {name} {version} as preinstalled")
        if unknown := sorted(set(r.get("pip_prerelease", [])) - set(r.get("preinstalled", {}))):
            problems.append(f"{src}: release {t} lists {', '.join(unknown)} under pip_prerelease but not under "
                            "preinstalled")

    expected = env_values(m)

    # docker/Dockerfile: the build arguments' defaults and the base image.
    dockerfile = root / "docker" / "Dockerfile"
    text = dockerfile.read_text()
    args = dockerfile_args(text)
    for arg in ("NGC_TAG", "TRITONCLIENT_VERSION", "PYTRITON_VERSION", "PROMETHEUS_VERSION"):
        if args.get(arg) != expected[arg]:
            problems.append(f"docker/Dockerfile has ARG {arg}={args.get(arg)} but {src} says {expected[arg]}")
    if not re.search(r"^FROM\s+nvcr\.io/nvidia/pytorch:\$\{NGC_TAG\}-py3\b", text, re.MULTILINE):
        problems.append(f"docker/Dockerfile's base image is not nvcr.io/nvidia/pytorch:${{NGC_TAG}}-py3, so {src}'s "
                        f"pinned release {tag} does not decide it")

    # docker/.env: what the compose file interpolates.
    env_path = root / "docker" / ".env"
    env = parse_env_file(env_path.read_text()) if env_path.exists() else {}
    if not env_path.exists():
        problems.append(f"docker/.env is missing; {src} generates it: "
                        "python -m nvlab.ops.stack env > docker/.env")
    for k, v in expected.items():
        if env_path.exists() and env.get(k) != v:
            problems.append(f"docker/.env sets {k}={env.get(k)} but {src} says {v} "
                            "(regenerate: python -m nvlab.ops.stack env > docker/.env)")

    # docker/compose.yaml: every image tag and version build argument comes from those variables.
    try:
        import yaml
    except ImportError as err:  # the course depends on it through papermill; a bare CI host may lack it
        raise RuntimeError("reading compose.yaml needs PyYAML: pip install pyyaml") from err
    compose = yaml.safe_load((root / "docker" / "compose.yaml").read_text())
    services = compose.get("services", {})
    want_images = {"triton": image_ref("tritonserver", tag),
                   "prometheus": f"prom/prometheus:{expected['PROMETHEUS_VERSION']}",
                   "grafana": f"grafana/grafana:{expected['GRAFANA_VERSION']}",
                   "dcgm-exporter": f"{REGISTRY}/k8s/dcgm-exporter:{expected['DCGM_EXPORTER_TAG']}"}

    def composed(raw: str) -> str:  # what compose makes of a value, or the value and why it cannot
        try:
            return interpolate(raw, env)
        except KeyError as err:
            return f"{raw} ({err})"

    for name, want in want_images.items():
        if (got := composed(services.get(name, {}).get("image", ""))) != want:
            problems.append(f"docker/compose.yaml service {name} runs image {got or '(none)'} but {src} says {want}")
    build_args = services.get("lab", {}).get("build", {}).get("args", {})
    for arg in ("NGC_TAG", "TRITONCLIENT_VERSION", "PYTRITON_VERSION", "PROMETHEUS_VERSION"):
        if (got := composed(str(build_args.get(arg, "")))) != expected[arg]:
            problems.append(f"docker/compose.yaml builds the lab with {arg}={got or '(not passed)'} but {src} says "
                            f"{expected[arg]}")

    # ./course: the pins of a setup outside the image.
    course = (root / "course").read_text()
    for name, version in m["course"].items():
        found = re.search(rf"\b{re.escape(name)}==([\w.+-]+)", course)
        if not found or found.group(1) != version:
            problems.append(f"./course pins {name}=={found.group(1) if found else '(nothing)'} but {src} says "
                            f"{version}")

    # pyproject.toml: the lab extra's tritonclient must admit the pinned release's client.
    pyproject = (root / "pyproject.toml").read_text()
    bound = re.search(r"tritonclient(?:\[[^\]]*\])?>=([\d.]+)", pyproject)
    if bound and release(bound.group(1)) > release(rel["tritonclient"]):
        problems.append(f"pyproject.toml requires tritonclient>={bound.group(1)} but {src} pairs NGC {tag} with "
                        f"tritonclient {rel['tritonclient']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["env"]:
        sys.stdout.write(compose_env())
        return 0
    if argv == ["check"]:
        try:
            problems = check(repo_root())
        except RuntimeError as err:
            print(f"python -m nvlab.ops.stack check: {err}", file=sys.stderr)
            return 2
        for p in problems:
            print(p, file=sys.stderr)
        if not problems:
            print(f"{MANIFEST_NAME} (NGC {manifest()['pinned']}) agrees with docker/, ./course and pyproject.toml")
        return 1 if problems else 0
    if len(argv) == 3 and argv[0] == "installed":
        tag, name = argv[1], argv[2]
        reported = dist_version(name)
        try:
            problem = installed_mismatch(name, reported, tag)
        except (KeyError, ValueError) as err:  # the manifest lacks the release or package; not a version
            problem = str(err.args[0])
        if problem:
            print(f"python -m nvlab.ops.stack installed: {problem}", file=sys.stderr)
            return 1
        print(reported)
        return 0
    print("usage: python -m nvlab.ops.stack env | check | installed NGC_TAG PACKAGE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
