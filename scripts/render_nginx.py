"""Write the nginx configs the course renders and commits for reading (``lab_utils.serving.service.RENDERED_CONFIGS``:
the compose stack's, lab 07's service's) from the template ``lab_utils/data/nginx/nginx.conf.j2``.

Run after changing the template or the service's limits: ``python scripts/render_nginx.py`` (``--check``: exit 1 when
a committed file differs from what the template renders; ``tests/test_nginx.py`` checks the same).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lab_utils.serving.service import RENDERED_CONFIGS

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when a file is out of date")
    args = ap.parse_args()
    stale = []
    for rel, render in RENDERED_CONFIGS.items():
        path, text = ROOT / rel, render()
        if path.exists() and path.read_text() == text:
            continue
        stale.append(rel)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {rel}")
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}: run python scripts/render_nginx.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
