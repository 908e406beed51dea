"""The course's version manifest (``data/stack/versions.json``): NGC releases, what their images carry, the pin.

The files that must agree with it (docker/, ./course, pyproject.toml) and what pip reports of an image's packages
are checked by ``nvlab.ops.stack``.

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


def pinned_release(m: dict[str, Any] | None = None) -> dict[str, Any]:
    """The NGC release the course image and stack use, with its ``tag`` ("26.09") added."""
    return ngc_release((m or manifest())["pinned"], m)


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


def dist_version(*names: str) -> str | None:
    """The version pip reports (not ``__version__``) of the first of ``names`` that is installed, or None."""
    for n in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(n)
    return None
