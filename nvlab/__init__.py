"""The course's command (``nvlab``): what a trainer, a maintainer and CI run, above the labs' library.

``cli`` is the command line; ``ops`` executes notebooks, generates the labs from their solutions, paces them and
builds offline wheelhouses; ``classroom`` runs one JupyterHub for a class. Notebooks import ``lab_utils``, never
this package; this package imports ``lab_utils``. ``writable_problem`` checks a folder option of the command."""

import tempfile
from pathlib import Path


def writable_problem(folder: Path, option: str) -> str | None:
    """Why ``folder`` cannot be created and written (one line naming it), or None; it exists afterwards."""
    try:
        if folder.exists() and not folder.is_dir():
            return f"{option} {folder}: that is a file, not a folder: pass a folder you can write"
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        why = err.strerror or err
        return f"{option} {folder}: cannot create or write this folder ({why}): pass a folder you can write"
    return None
