"""Data prep's speed and memory against pyarrow simply reading the same files, measured in the same run.

    .venv/bin/python bench/prep.py [--mb 100 500 2000] [--file-mb 0] [--repeat 3] [--tmp DIR]

For each size a CSV source is generated (an id, six floats, a category, a 0/1 label: ~68 bytes a
row), as one file, or as files of at most --file-mb MB. Each side runs in a process of its own,
alternating, --repeat times: pyarrow reading the files (the faster of pyarrow.csv.read_csv per file
and a pyarrow.dataset scan to one table, both on all CPUs) and `prepare(source, out, label="label")`
with its defaults. MB/s is the source's bytes over the call's wall time (imports excluded); the
best run, with the spread (slowest/best) as this VM's speed drifts. CPU is each side's least CPU
time (user + system, the interpreter's start and imports included) over the runs, per GB: steadier
than MB/s on a shared machine; its ratio says what prep costs next to a read whatever the cores.
Peak RSS is sampled from /proc every 20 ms over the process and its descendants (pass 1's process pool): the largest
process's VmHWM, and the largest sum over the processes alive at one sample. The spill files go to --tmp.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEADER = b"id,f0,f1,f2,f3,f4,f5,cat,label\n"

READ = """
import json, os, sys, time
import pyarrow.csv as pc, pyarrow.dataset as ds
src, how = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if how == "read_csv":
    rows = sum(pc.read_csv(os.path.join(src, f)).num_rows for f in sorted(os.listdir(src)))
else:
    rows = ds.dataset(src, format="csv").to_table().num_rows
print(json.dumps({"seconds": time.perf_counter() - t, "rows": rows}))
"""

PREP = """
import json, sys, time
from elastic_step.data.prep import prepare
if __name__ == "__main__":
    t = time.perf_counter()
    r = prepare(sys.argv[1], sys.argv[2], label="label")
    print(json.dumps({"seconds": time.perf_counter() - t, "rows": r.train.total_rows + r.eval.total_rows}))
"""


def make_source(folder: pathlib.Path, mb: float, file_mb: float) -> tuple[int, int]:
    """CSV files of about `mb` MB in all under `folder`; (rows, bytes). Rows differ only in their id:
    one block of random rows is made once and written with new ids (~100 MB/s)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pa_csv

    rng = np.random.default_rng(0)
    n = 200_000
    cols = {f"f{j}": np.round(rng.random(n), 6) for j in range(6)}
    cols["cat"] = pc.binary_join_element_wise("c", pc.cast(pa.array(rng.integers(0, 1000, n)), pa.string()), "")
    cols["label"] = rng.integers(0, 2, n)
    out = pa.BufferOutputStream()
    pa_csv.write_csv(pa.table(cols), out, write_options=pa_csv.WriteOptions(include_header=False, quoting_style="none"))
    rest = pa.array(out.getvalue().to_pybytes().split(b"\n")[:-1], pa.binary())
    rest = pc.binary_join_element_wise(rest, pa.scalar(b"\n"), b"")
    folder.mkdir(parents=True)
    rows = total = 0
    part = None
    part_bytes = 0
    while total < mb * 1e6:
        if part is None or (file_mb and part_bytes >= file_mb * 1e6):
            if part is not None:
                part.close()
            part = open(folder / f"part-{rows:012d}.csv", "wb")
            part.write(HEADER)
            part_bytes = len(HEADER)
        ids = pc.cast(pa.array(np.arange(rows, rows + n)), pa.string()).cast(pa.binary())
        lines = pc.binary_join_element_wise(ids, rest, b",")
        offsets = np.frombuffer(lines.buffers()[1], dtype=np.int32)[: n + 1]
        part.write(memoryview(lines.buffers()[2])[offsets[0] : offsets[-1]])
        size = int(offsets[-1] - offsets[0])
        rows, total, part_bytes = rows + n, total + size, part_bytes + size
    part.close()
    return rows, sum(p.stat().st_size for p in folder.iterdir())


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0.0


def _status_mb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) >> 10
    except OSError:
        pass
    return 0


def run(code: str, args: list[str], env: dict) -> dict:
    """Run `code` in a new process; its printed JSON plus its tree's peak RSS (MB) and CPU time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    hwm: dict[int, int] = {}
    cpu: dict[int, float] = {}  # descendants the process does not wait for (pass 1's pool): last seen
    total = [0]

    def sample() -> None:
        while proc.poll() is None:
            pids = _descendants(proc.pid)
            rss = 0
            for pid in pids:
                hwm[pid] = max(hwm.get(pid, 0), _status_mb(pid, "VmHWM"))
                rss += _status_mb(pid, "VmRSS")
                if pid != proc.pid:
                    cpu[pid] = max(cpu.get(pid, 0.0), _cpu_s(pid))
            total[0] = max(total[0], rss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"failed:\n{err[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_mb"], result["total_mb"], result["processes"] = max(hwm.values(), default=0), total[0], len(hwm)
    result["cpu_s"] = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime + sum(cpu.values())
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, nargs="+", default=[100, 500, 2000], help="source sizes, MB")
    p.add_argument("--file-mb", type=float, default=0, help="split the source in files of this many MB (0: one file)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tmp", default=None, help="where the source, spill files and output go (default: TMPDIR)")
    args = p.parse_args()
    print(
        f"CSV source as {'one file' if not args.file_mb else f'files of {args.file_mb:g} MB'}; "
        f"{os.cpu_count()} CPUs; best of {args.repeat}, spread = slowest/best"
    )
    print(
        f"{'source MB':>9} {'files':>5} {'rows':>10} {'pyarrow MB/s':>12} {'spread':>6} {'prep MB/s':>9} "
        f"{'spread':>6} {'ratio':>5} {'CPU s/GB pyarrow':>16} {'prep':>5} {'ratio':>5} "
        f"{'prep peak RSS MB':>16} {'all procs MB':>12} {'pyarrow RSS MB':>14}"
    )
    for mb in args.mb:
        with tempfile.TemporaryDirectory(prefix="bench-prep-", dir=args.tmp) as tmp:
            work = pathlib.Path(tmp)
            rows, size = make_source(work / "src", mb, args.file_mb)
            env = dict(os.environ, TMPDIR=tmp, PYTHONPATH=str(ROOT))
            reads, preps = [], []
            for _ in range(args.repeat):  # alternate: a slow moment of this VM only slows one run
                reads += [dict(run(READ, [str(work / "src"), how], env), how=how) for how in ("read_csv", "scan")]
                preps.append(run(PREP, [str(work / "src"), str(work / "out")], env))
                shutil.rmtree(work / "out")
            assert all(r["rows"] == rows for r in reads + preps)
            best_how = min(reads, key=lambda r: r["seconds"])["how"]
            read_s = sorted(r["seconds"] for r in reads if r["how"] == best_how)
            prep_s = sorted(r["seconds"] for r in preps)
            read_cpu, prep_cpu = (
                min(r["cpu_s"] for r in runs) / (size / 1e9)
                for runs in ([r for r in reads if r["how"] == best_how], preps)
            )
            print(
                f"{size / 1e6:>9.0f} {len(list((work / 'src').iterdir())):>5} {rows:>10} "
                f"{size / 1e6 / read_s[0]:>12.1f} {read_s[-1] / read_s[0]:>6.2f} {size / 1e6 / prep_s[0]:>9.1f} "
                f"{prep_s[-1] / prep_s[0]:>6.2f} {read_s[0] / prep_s[0]:>5.2f} "
                f"{read_cpu:>16.1f} {prep_cpu:>5.1f} {read_cpu / prep_cpu:>5.2f} "
                f"{max(r['peak_mb'] for r in preps):>16} {max(r['total_mb'] for r in preps):>12} "
                f"{max(r['peak_mb'] for r in reads):>14}",
                flush=True,
            )


if __name__ == "__main__":
    main()
