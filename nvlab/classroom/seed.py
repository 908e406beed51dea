"""A student's copy of the labs, made at each server start by the student's own process (never by root).

First start: ``labs/`` is copied. Later starts never overwrite a file: a lab the course changed since the student's
copy was made appears beside it under a new name (``01_cuda_timing.new-<hash>.ipynb``), and a lab the student
deleted is not brought back. What was handed out is recorded in ``labs/.nvlab-seeded.json`` (file -> sha256).

``python -m nvlab.classroom.seed --labs SRC --dest DEST -- CMD...`` seeds, then replaces itself with CMD (the
single-user server), so the hub's spawner starts it as it would start the server itself."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

MANIFEST = ".nvlab-seeded.json"
# not course material: generated folders and checkpoints never handed out
SKIP = {".ipynb_checkpoints", "__pycache__", MANIFEST}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def seed_labs(src: Path | str, dest: Path | str) -> dict[str, list[str]]:
    """Copy ``src`` into ``dest`` without ever overwriting: returns the files 'copied', 'offered' (a new course
    version under a new name), 'kept' (the student's copy left as it is)."""
    src, dest = Path(src), Path(dest)
    if not src.is_dir():
        raise FileNotFoundError(f"the course's labs folder {src} does not exist (or this user cannot read it)")
    dest.mkdir(parents=True, exist_ok=True)
    manifest_path = dest / MANIFEST
    try:
        seeded: dict[str, str] = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        seeded = {}
    done: dict[str, list[str]] = {"copied": [], "offered": [], "kept": []}
    for rel in sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file()):
        if SKIP.intersection(rel.parts):
            continue
        digest, key = _sha(src / rel), rel.as_posix()
        target = dest / rel
        if key not in seeded and not target.exists():
            what, to = "copied", target
        elif seeded.get(key) == digest or (target.exists() and _sha(target) == digest):
            done["kept"].append(key)  # the same version the student has (edited or not)
            seeded.setdefault(key, digest)
            continue
        elif key in seeded and not target.exists():
            done["kept"].append(key)  # deleted by the student: not brought back
            continue
        else:
            what, to = "offered", dest / rel.with_name(f"{rel.stem}.new-{digest[:8]}{rel.suffix}")  # beside theirs
            if to.exists():
                done["kept"].append(key)
                continue
        to.parent.mkdir(parents=True, exist_ok=True)
        tmp = to.with_name(f".{to.name}.part")
        shutil.copyfile(src / rel, tmp)
        os.replace(tmp, to)  # never a half-written lab, even when the server start is killed
        done[what].append(to.relative_to(dest).as_posix())
        if what == "copied":
            seeded[key] = digest
    tmp = manifest_path.with_name(MANIFEST + ".part")
    tmp.write_text(json.dumps(seeded, indent=1, sort_keys=True))
    os.replace(tmp, manifest_path)
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nvlab.classroom.seed", description=__doc__)
    p.add_argument("--labs", required=True, help="the course's labs folder (read only)")
    p.add_argument("--dest", required=True, help="the student's labs folder (~ is the student's home)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to run after seeding")
    args = p.parse_args(argv)
    dest = Path(os.path.expanduser(args.dest))
    try:
        done = seed_labs(args.labs, dest)
        print(f"nvlab classroom: labs in {dest}: {len(done['copied'])} copied, {len(done['offered'])} new course "
              f"version(s) offered beside the student's copy, {len(done['kept'])} kept", file=sys.stderr, flush=True)
    except OSError as err:  # the server still starts: the student keeps working on what they have
        print(f"nvlab classroom: could not copy the labs into {dest}: {err}", file=sys.stderr, flush=True)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        return 0
    os.execvp(cmd[0], cmd)  # the single-user server takes this process over (its pid is the one the spawner watches)


if __name__ == "__main__":
    sys.exit(main())
