"""The trainer's progress page under a class's load: 30 synthetic students x 70 exercises (the course's first 70, lab
order) x 10 checks each (21,000 records), written as the service keeps them (one JSON-lines file per student), then
timed as the service does the work: reading them at its start, rendering the page, the table the page refreshes
every few seconds, and the CSV.

    python benchmarks/progress_page.py [--students 30] [--exercises 70] [--attempts 10] [--repeat 5] [--out FILE]

Target: the page renders in under 1 s. The results file keeps the median and the slowest of ``--repeat`` runs (s)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab_utils.course import progress  # noqa: E402
from nvlab.classroom import progress_service as svc  # noqa: E402 - after the checkout is on the path

TARGET_S = 1.0


def synthesize(data: Path, students: int, exercises: int, attempts: int, seed: int = 0) -> int:
    """Write ``students`` files of the course's first ``exercises`` exercises (lab order), each checked ``attempts``
    times; the record count."""
    rng = random.Random(seed)
    names = [n for lab in progress.catalog().values() for n in lab][:exercises]
    now, n = time.time(), 0
    for s in range(students):
        with (data / f"student{s:02d}.jsonl").open("w") as f:
            t = now - 3 * 3600
            for name in names:
                for a in range(1, attempts + 1):
                    t += rng.uniform(0.5, 1.5)
                    outcome = "right" if a == attempts or rng.random() < 0.2 else "wrong"
                    message = "" if outcome == "right" else \
                        f"`answer`: expected about {rng.uniform(1, 1000):.4g} (within 1%); yours is 0.5x that."
                    f.write(json.dumps({"v": 1, "id": f"{s}-{n}", "lab": name[:2], "exercise": name,
                                        "outcome": outcome, "message": message, "attempt": a, "time": t}) + "\n")
                    n += 1
    return n


def timed(fn, repeat: int) -> dict[str, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": round(statistics.median(times), 4), "max_s": round(max(times), 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--students", type=int, default=30)
    p.add_argument("--exercises", type=int, default=70)
    p.add_argument("--attempts", type=int, default=10)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nvlab-progress-bench-") as tmp:
        data = Path(tmp)
        records = synthesize(data, args.students, args.exercises, args.attempts)
        size = sum(f.stat().st_size for f in data.iterdir())
        stores: list[svc.Store] = []
        load = timed(lambda: stores.append(svc.Store(data)), args.repeat)
        store = stores[-1]

        def page() -> None:  # a page view sums every student up again (as after new records arrive)
            for st in store.students.values():
                st._summary = None
            svc.render_page(store)

        result = {
            "what": f"{args.students} students x {args.exercises} exercises x {args.attempts} checks",
            "records": records, "bytes_on_disk": size,
            "load_at_start": load,
            "page_render": timed(page, args.repeat),
            "page_render_cached_summaries": timed(lambda: svc.render_page(store), args.repeat),
            "table_refresh": timed(lambda: svc.render_rows(store), args.repeat),
            "csv": timed(lambda: svc.render_csv(store), args.repeat),
            "page_bytes": len(svc.render_page(store)), "csv_bytes": len(svc.render_csv(store)),
            "target_s": TARGET_S,
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "cpu": platform.processor()
                        or platform.machine()},
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
        }
    result["page_under_target"] = result["page_render"]["max_s"] < TARGET_S
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if result["page_under_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
