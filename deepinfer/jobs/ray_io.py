"""The files of a `deepinfer run --ray` job, read and written by Ray Data in the workers.

- `LineSource`: JSON-lines inputs (a path, a glob, a folder), one row per non-blank line with its
  line number (`raw`, `line`, `source`), so the stage parses each line exactly as a local job does;
  a file is streamed in 1 MiB reads (never held whole).
- `ShardSink`: each write task appends its rows' result lines to one shard
  `part-<run>-<task>.jsonl` in the output folder (a retried task rewrites its own shard from the
  start; a resumed run gets a new <run>), flushed line by line: after a kill -9 a shard holds whole
  lines plus at most one half line.
- `scan_shards`: on resume, cuts each shard's half-written last line and returns the keys written
  (what the stage skips), so the resume state is the shards themselves.
- The manifest (`manifest.json` next to the shards): what job the folder holds, checked on resume.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Callable, Iterable, Iterator

from deepinfer.jobs.errors import JobUsageError

MANIFEST = "manifest.json"
SHARD_GLOB = "part-*.jsonl"
_READ = 1 << 20  # bytes per read of an input file
_ROWS = 4096  # input lines per block


def expand_inputs(spec: str | list[str]) -> list[str]:
    """Local input files of a path, a glob or a folder (sorted); JobUsageError when there are none."""
    items = [spec] if isinstance(spec, str) else list(spec)
    files: list[str] = []
    for item in items:
        if os.path.isdir(item):
            found = sorted(p for p in glob.glob(os.path.join(item, "*")) if os.path.isfile(p))
        elif glob.has_magic(item):
            found = sorted(p for p in glob.glob(item) if os.path.isfile(p))
        else:
            found = [item] if os.path.isfile(item) else []
        if not found:
            raise JobUsageError(f"input {item!r} matches no file")
        files.extend(os.path.abspath(p) for p in found)
    return files


def input_format(files: list[str]) -> str:
    """'parquet' when every file ends in .parquet, 'jsonl' when none does; mixing is refused."""
    parquet = [f.endswith(".parquet") for f in files]
    if all(parquet):
        return "parquet"
    if any(parquet):
        raise JobUsageError("the inputs mix Parquet and JSON-lines files; give one kind")
    return "jsonl"


def _line_source_class() -> Any:
    from ray.data.datasource import FileBasedDatasource

    class LineSource(FileBasedDatasource):
        def _read_stream(self, f: Any, path: str) -> Iterator[Any]:
            import pyarrow as pa

            raws: list[str] = []
            lines: list[int] = []
            line_no = 0
            tail = b""

            def block() -> Any:
                return pa.table({"raw": pa.array(raws, pa.string()), "line": pa.array(lines, pa.int64()),
                                 "source": pa.array([path] * len(raws), pa.string())})

            while True:
                chunk = f.read(_READ)
                if chunk:
                    parts = (tail + chunk).split(b"\n")
                    tail = parts.pop()  # the start of a line the next read completes
                else:
                    parts, tail = ([tail] if tail else []), b""
                for part in parts:
                    line_no += 1
                    if part.strip():
                        raws.append(part.decode("utf-8", errors="replace"))
                        lines.append(line_no)
                        if len(raws) >= _ROWS:
                            yield block()
                            raws, lines = [], []
                if not chunk:
                    break
            if raws:
                yield block()

    return LineSource


def read_input(files: list[str], fmt: str) -> Any:
    """The job's input as a Ray Dataset (read lazily, in the workers)."""
    import ray.data

    # zero CPUs: with every CPU held by an engine actor, a read task that needs one never runs and
    # the pipeline stalls (measured: no record in 5 min on a 2-CPU cluster with 2 replicas)
    remote = {"num_cpus": 0}
    if fmt == "parquet":
        return ray.data.read_parquet(files, ray_remote_args=remote)
    return ray.data.read_datasource(_line_source_class()(files), ray_remote_args=remote)


def _sink_class() -> Any:
    from ray.data.block import BlockAccessor
    from ray.data.datasource import Datasink

    class ShardSink(Datasink):
        def __init__(self, folder: str, run: str) -> None:
            self.folder, self.run = folder, run
            self.totals = {"written": 0, "failed": 0, "tokens": 0}

        def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, int]:
            path = os.path.join(self.folder, f"part-{self.run}-{ctx.task_idx:06d}.jsonl")
            n = failed = tokens = 0
            with open(path, "wb") as f:  # "wb": a retried task starts its shard again
                for block in blocks:
                    t = BlockAccessor.for_block(block).to_arrow()
                    if t.num_rows == 0:
                        continue
                    for line, ok, tok in zip(t.column("result").to_pylist(), t.column("ok").to_pylist(),
                                             t.column("tokens").to_pylist()):
                        f.write(line.encode("utf-8") + b"\n")  # one write per line: at most one half line
                        n += 1
                        failed += not ok
                        tokens += tok
                    f.flush()
                os.fsync(f.fileno())
            if n == 0:
                os.unlink(path)
            return {"written": n, "failed": failed, "tokens": tokens}

        def on_write_complete(self, write_result: Any) -> None:
            for r in write_result.write_returns:
                for k in self.totals:
                    self.totals[k] += r[k]

    return ShardSink


def shard_sink(folder: str, run: str) -> Any:
    return _sink_class()(folder, run)


def shards(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, SHARD_GLOB)))


def scan_shards(folder: str, key_of: Callable[[dict[str, Any]], str]) -> tuple[set[str], int]:
    """(keys written, bytes of half lines cut) over every shard; a complete line that does not
    parse is an error (JobUsageError), as for a local job's output."""
    from deepinfer.jobs.output import recover

    keys: set[str] = set()
    cut = 0
    for path in shards(folder):
        k, c = recover(path, key_of)
        dup = keys & k
        if dup:
            raise JobUsageError(f"{path}: key {sorted(dup)[0]} is also in another shard; the output is not "
                                "one job's (remove it or pick another --output)")
        keys |= k
        cut += c
    return keys, cut


def read_manifest(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:
        raise JobUsageError(f"{path} is not a deepinfer manifest ({e})") from e


def write_manifest(folder: str, manifest: dict[str, Any]) -> None:
    """Replace the manifest atomically (a kill leaves the old or the new one, never half)."""
    path = os.path.join(folder, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
