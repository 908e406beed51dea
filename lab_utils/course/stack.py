"""The course's version manifest (``data/stack/versions.json``): NGC releases, what their images carry, the pin.

``same_release``, ``pip_version`` and ``installed_mismatch`` compare the manifest's versions with pip's. The files
that must agree with it (docker/, ./course, pyproject.toml) are checked by ``nvlab.ops.stack``.

Design notes: docs/internals.md#lab_utilscoursestackpy"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import re
from typing import Any

from lab_utils import DATA_DIR

MANIFEST_PATH = DATA_DIR / "stack" / "versions.json"
MANIFEST_NAME = "lab_utils/data/stack/versions.json"
REGISTRY = "nvcr.io/nvidia"


@functools.lru_cache(maxsize=1)
def manifest() -> dict[str, Any]:
    """The manifest as a dict (read once)."""
    return json.loads(MANIFEST_PATH.read_text())


# PEP 440's release segment, after an optional "v" and epoch; what follows (a0, .post1, +local) is not read.
_RELEASE = re.compile(r"\s*v?(?:\d+!)?(\d+(?:\.\d+)*)")


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version: (2, 14, 0) for "2.14.0a0+5fa4b7e", (10, 13, 3, 9) for "10.13.3.9"."""
    if not (m := _RELEASE.match(version)):
        raise ValueError(f"{version!r} is not a version: expected release numbers first, e.g. 2.14.0 or 2.14.0a0+abc")
    return tuple(int(p) for p in m.group(1).split("."))


def same_release(recorded: str, reported: str) -> bool:
    """Whether a version pip reports ("2.14.0a0+5fa4b7e", "11.3.0.36") is the manifest's ("2.14.0", "11.3.0"):
    its release numbers cut to the manifest's precision are the manifest's (missing ones count as 0, as in PEP 440).
    Pre-release, post-release and local parts are ignored, so 2.14.0a0+5fa4b7e is the image's 2.14.0."""
    want = release(recorded)
    return (release(reported) + (0,) * len(want))[:len(want)] == want


def pinned_release(m: dict[str, Any] | None = None) -> dict[str, Any]:
    """The NGC release the course image and stack use, with its ``tag`` ("26.09") added."""
    m = m or manifest()
    return ngc_release(m["pinned"], m)


def ngc_release(tag: str, m: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest's entry of NGC release ``tag`` ("26.09"), with ``tag`` added; KeyError naming the fix."""
    m = m or manifest()
    if tag not in m["ngc"]:
        what = "pinned release" if tag == m["pinned"] else "NGC release"
        raise KeyError(f"{MANIFEST_NAME}: {what} {tag!r} has no entry under 'ngc' ({', '.join(sorted(m['ngc']))}): "
                       "add what its images carry there")
    return {"tag": tag, **m["ngc"][tag]}


def image_ref(kind: str, tag: str) -> str:
    """``nvcr.io/nvidia/KIND:TAG-py3``."""
    return f"{REGISTRY}/{kind}:{tag}-py3"


def pinned_image(kind: str) -> str:
    """The pinned release's image of ``kind``: "tritonserver" -> "nvcr.io/nvidia/tritonserver:26.09-py3"."""
    rel = pinned_release()
    if kind not in rel.get("images", []):
        raise KeyError(f"{MANIFEST_NAME}: pinned release {rel['tag']} lists no {kind} image "
                       f"(images: {', '.join(rel.get('images', [])) or 'none'}); add {kind!r} to its 'images'")
    return image_ref(kind, rel["tag"])


def ngc_images() -> list[dict[str, str]]:
    """Every NGC image the manifest names, newest release first: image reference, release, kind, CUDA runtime."""
    ngc = manifest()["ngc"]
    return [{"image": image_ref(kind, tag), "release": tag, "kind": kind, "cuda": ngc[tag]["cuda"]}
            for tag in sorted(ngc, key=release, reverse=True) for kind in ngc[tag]["images"]]


# --- what an image has, as pip reports it ---------------------------------------------------------


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


def dist_version(*names: str) -> str | None:
    """The version pip reports (not ``__version__``) of the first of ``names`` that is installed, or None."""
    for n in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(n)
    return None


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
