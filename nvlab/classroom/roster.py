"""The trainer's roster (CSV: ``username[,email][,gpu][,role]``) and the GPU pool its students share.

Every problem is found before anything starts and reported together, one line each with the roster's line number
(``RosterError``). GPUs are what ``nvidia-smi -L`` lists: whole GPUs by index or UUID, MIG instances by UUID."""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# What Linux's useradd accepts (Debian's default NAME_REGEX, lower case only) and JupyterHub keeps as it is: a student
# is a system user of the same name in local mode. 32 characters is useradd's limit.
NAME_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
COLUMNS = ("username", "email", "gpu", "role")
ROLES = ("student", "trainer")
# Names a roster may not take: system accounts a local-mode hub would otherwise hand a server to.
RESERVED = frozenset({"root", "daemon", "bin", "sys", "sync", "games", "man", "lp", "mail", "news", "uucp", "proxy",
                      "www-data", "backup", "list", "irc", "nobody", "systemd-network", "messagebus", "sshd",
                      "admin", "hub", "jupyterhub"})


class RosterError(ValueError):
    """A roster the hub cannot start with; the message lists every problem, one per line."""


@dataclass(frozen=True)
class Student:
    """One roster line: ``gpu`` as written ('' when the pool decides), ``role`` 'student' or 'trainer'."""

    username: str
    email: str = ""
    gpu: str = ""
    role: str = "student"
    line: int = 0

    @property
    def admin(self) -> bool:
        return self.role == "trainer"


@dataclass(frozen=True)
class Device:
    """A GPU a student's server can be given: a whole GPU (``kind`` 'gpu') or a MIG instance ('mig')."""

    kind: str
    index: int  # the GPU's index (a MIG instance: its parent GPU's)
    uuid: str  # GPU-... or MIG-...
    name: str  # "NVIDIA H200", or a MIG profile such as "1g.18gb"


def parse_roster(text: str, source: str = "roster") -> list[Student]:
    """The roster's students, checked: a header naming ``username`` (other columns from ``COLUMNS``), valid and
    unique names (case-insensitive), known roles. Raises ``RosterError`` listing every problem."""
    rows = list(csv.reader(io.StringIO(text.lstrip("\ufeff"))))
    rows = [(n, r) for n, r in enumerate(rows, 1) if any(c.strip() for c in r)]
    if not rows:
        raise RosterError(f"{source}: empty; write a header line `username,email,gpu,role` and one line per student")
    header = [c.strip().lower() for c in rows[0][1]]
    problems = []
    if "username" not in header:
        raise RosterError(f"{source}: line {rows[0][0]}: the header {','.join(header)!r} has no `username` column; "
                          "the first line must be a header such as `username,email,gpu,role`")
    if unknown := [c for c in header if c not in COLUMNS]:
        problems.append(f"line {rows[0][0]}: unknown column(s) {', '.join(map(repr, unknown))}: the columns are "
                        f"{', '.join(COLUMNS)}")
    if dup := [c for c, k in Counter(header).items() if k > 1]:
        problems.append(f"line {rows[0][0]}: column(s) {', '.join(dup)} given twice")
    students, seen = [], {}
    for n, row in rows[1:]:
        if len(row) > len(header):
            problems.append(f"line {n}: {len(row)} fields but the header has {len(header)}")
            continue
        f = {k: v.strip() for k, v in zip(header, row, strict=False)}  # a short line: its last columns empty
        name, role = f.get("username", ""), (f.get("role") or "student").lower()
        if not NAME_RE.match(name):
            why = "upper case letters" if NAME_RE.match(name.lower()) else "not a valid user name"
            problems.append(f"line {n}: username {name!r}: {why}: use 1-32 of a-z, 0-9, '_' and '-', starting with "
                            "a letter or '_'")
        elif name in RESERVED:
            problems.append(f"line {n}: username {name!r} is a system account's name: choose another")
        elif name in seen:
            problems.append(f"line {n}: username {name!r} is already on line {seen[name]}: each student once")
        else:
            seen[name] = n
        if role not in ROLES:
            problems.append(f"line {n}: role {f.get('role')!r}: use 'student' (or leave it empty) or 'trainer'")
        email = f.get("email", "")
        if email and not re.match(r"^[^@\s]+@[^@\s]+\.[^@\s]+$", email):
            problems.append(f"line {n}: email {email!r} is not an e-mail address")
        students.append(Student(name, email, f.get("gpu", ""), role, n))
    if not students and not problems:
        problems.append("no students: add one line per student under the header")
    if students and not any(s.admin for s in students):
        problems.append("no trainer: give the trainer's line the role `trainer` (the hub's admin)")
    if problems:
        raise RosterError(f"{source}: " + "\n  ".join(["the roster has problems:", *problems]))
    return students


def read_roster(path: Path | str) -> list[Student]:
    """``parse_roster`` of the file at ``path`` (a missing or unreadable file is a ``RosterError`` too)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RosterError(f"cannot read the roster {path}: {err}") from None
    return parse_roster(text, str(path))


_SMI_GPU = re.compile(r"^GPU (\d+): (.+?) \(UUID: (GPU-[0-9a-fA-F-]+)\)")
_SMI_MIG = re.compile(r"^\s+MIG (\S+)\s+Device\s+\d+: \(UUID: (MIG-[0-9a-zA-Z/-]+)\)")


def parse_smi_list(text: str) -> list[Device]:
    """``nvidia-smi -L``'s lines as devices: each GPU, and under it each of its MIG instances."""
    out: list[Device] = []
    parent = -1
    for line in text.splitlines():
        if m := _SMI_GPU.match(line):
            parent = int(m.group(1))
            out.append(Device("gpu", parent, m.group(3), m.group(2)))
        elif (m := _SMI_MIG.match(line)) and parent >= 0:
            out.append(Device("mig", parent, m.group(2), m.group(1)))
    return out


def gpu_inventory() -> tuple[list[Device], str]:
    """This machine's GPUs and MIG instances (``nvidia-smi -L``), and where that came from (a reason when none)."""
    if not (smi := shutil.which("nvidia-smi")):
        return [], "no NVIDIA driver here (nvidia-smi is not on the PATH)"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return [], f"nvidia-smi -L failed: {err}"
    if out.returncode:
        return [], f"nvidia-smi -L failed: {(out.stderr or out.stdout).strip()[:200]}"
    devices = parse_smi_list(out.stdout)
    return devices, f"nvidia-smi -L: {len(devices)} device(s)" if devices else "nvidia-smi -L lists no GPU"


def gpu_pool(spec: str, devices: list[Device], why_none: str = "") -> list[Device]:
    """The devices students share, from ``--gpus``: 'none', 'all' (every whole GPU; a GPU in MIG mode by its MIG
    instances), 'mig' (every MIG instance) or indices such as '0,1'. Raises ``RosterError`` naming what is missing."""
    spec = spec.strip().lower()
    if spec == "none":
        return []
    migs = [d for d in devices if d.kind == "mig"]
    if spec == "all":
        if not devices:
            raise RosterError(f"--gpus all, but {why_none or 'this machine has no GPU'}: pass --gpus none for "
                              "servers without a GPU")
        split = {d.index for d in migs}  # a GPU in MIG mode is shared by its instances, not whole
        return [d for d in devices if (d.kind == "gpu" and d.index not in split) or d.kind == "mig"]
    if spec == "mig":
        if not migs:
            raise RosterError("--gpus mig, but no MIG instance exists here (nvidia-smi -L lists none): create them "
                              "with `nvidia-smi mig -cgi ... -C`, or pass --gpus all")
        return migs
    try:
        wanted = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise RosterError(f"--gpus {spec!r}: give all, mig, none or GPU indices such as 0,1") from None
    whole = {d.index: d for d in devices if d.kind == "gpu"}
    if missing := [i for i in wanted if i not in whole]:
        have = ", ".join(str(i) for i in sorted(whole)) or f"none ({why_none or 'nvidia-smi -L lists none'})"
        raise RosterError(f"--gpus {spec}: GPU {', '.join(map(str, missing))} does not exist; this machine's GPUs: "
                          f"{have}")
    if not wanted:
        raise RosterError("--gpus is empty: give all, mig, none or GPU indices such as 0,1")
    return [whole[i] for i in wanted]


def assign_gpus(students: list[Student], pool: list[Device], devices: list[Device],
                why_none: str = "") -> dict[str, Device | None]:
    """Each student's device: the roster's ``gpu`` when given (an index or a UUID that exists here), else the
    pool's devices in turn (more students than devices: several share one, round-robin). Raises ``RosterError``
    for a roster GPU that does not exist."""
    problems, out = [], {}
    for s in students:
        if not s.gpu:
            continue
        if s.gpu.lower() == "none":
            out[s.username] = None
        elif d := next((x for x in devices if s.gpu == x.uuid
                        or (x.kind == "gpu" and s.gpu.isdigit() and int(s.gpu) == x.index)), None):
            out[s.username] = d
        else:
            have = ", ".join(f"{d.index}" if d.kind == "gpu" else d.uuid for d in devices)
            problems.append(f"line {s.line}: gpu {s.gpu!r} for {s.username} does not exist on this machine "
                            f"({'its devices: ' + have if have else why_none or 'no GPU'}); fix the gpu column "
                            "(an index, a GPU-/MIG- UUID from `nvidia-smi -L`, or none)")
    if problems:
        raise RosterError("the roster names GPUs this machine lacks:\n  " + "\n  ".join(problems))
    rest = [s for s in students if s.username not in out]
    for i, s in enumerate(rest):
        out[s.username] = pool[i % len(pool)] if pool else None
    return out


def sharing_note(assigned: dict[str, Device | None]) -> str | None:
    """A caveat when students share a device: a GPU's memory is not divided between processes (MIG divides it)."""
    count = Counter(d.uuid for d in assigned.values() if d)
    shared = {u: k for u, k in count.items() if k > 1}
    if not shared:
        return None
    worst = max(shared.values())
    return (f"{len(shared)} device(s) shared by up to {worst} students each: their processes share the GPU's memory "
            "and compute with no limit between them, so one student's large run can make another's fail with out "
            "of memory; give whole GPUs or MIG instances where the labs' peaks do not fit together")
