"""Where a serving run's long gaps between tokens fall (issue 26's ITL tail).

    python -m bench.serving ... --records-out /tmp/records.jsonl.gz
    python -m bench.itl_gaps /tmp/records.jsonl.gz [--threshold-ms 25]

Per rate in the records: the gaps between a stream's consecutive token messages that are
longer than `--threshold-ms`, and how they bunch in time. A stall of something every stream
passes through (the decode worker's engine or its front) makes many streams' long gaps end
within a few milliseconds of each other, spread over all client processes; a stall of one
gateway or client process makes that client process's streams' gaps end together. The table:
long gaps (all, per 1,000 messages, per client process); the share of them that end in a 10 ms
bin with long gaps of a quarter or more of the running streams over two or more client
processes (a global stall), and in a bin with no other client process's (one client process
and the gateway process it reached, or a lone gap).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path
from typing import Any

from bench.common import table
from bench.serving_load import Record

BIN_S = 0.010


def write_records(path: Path, rate: float, records: list[Record], client_processes: int) -> None:
    """Append one line: the rate and, per request, its client process, send time, token times
    and status (times on CLOCK_MONOTONIC, the same in every client process of the host)."""
    line = {
        "rate": rate,
        "requests": [
            {"client": i % max(1, client_processes), "sent": r.sent, "times": r.token_times,
             "status": r.status}
            for i, r in enumerate(records)
        ],
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "at") as f:
        f.write(json.dumps(line) + "\n")


def analyse(line: dict[str, Any], threshold_s: float) -> dict[str, Any]:
    ends: list[tuple[float, int, int]] = []  # (end time, request, client)
    gaps = 0
    for n, req in enumerate(line["requests"]):
        times = req["times"]
        # NOTE: the tokens of one message share its time: their gap is 0, not a gap
        stamps = sorted(set(times))
        for a, b in zip(stamps, stamps[1:], strict=False):
            gaps += 1
            if b - a > threshold_s:
                ends.append((b, n, req["client"]))
    bins: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for end, n, client in ends:
        bins[int(end / BIN_S)].append((n, client))
    running = _running_per_bin(line["requests"])
    global_, single = 0, 0
    for key, members in bins.items():
        streams = {n for n, _ in members}
        clients = {c for _, c in members}
        if len(clients) == 1:
            single += len(members)
        elif len(streams) >= max(2, running.get(key, 0) // 4):
            global_ += len(members)
    per_client = collections.Counter(c for _, _, c in ends)
    return {
        "rate": line["rate"],
        "messages": gaps,
        "long_gaps": len(ends),
        "long_per_1k_messages": round(1000 * len(ends) / max(1, gaps), 2),
        "in_global_stalls": round(global_ / max(1, len(ends)), 2),
        "one_client_only": round(single / max(1, len(ends)), 2),
        "per_client": dict(sorted(per_client.items())),
    }


STALL_LINE = re.compile(
    r"(?P<who>\S+)(?: \(pid \d+\))?:? (?:event loop woke|slow engine turn) (?P<ms>[\d.]+) ms"
    r"(?: late)? at monotonic (?P<at>[\d.]+)"
)


def read_stall_log(path: Path) -> list[tuple[float, float, str]]:
    """(start, end, who) of every stall a service logged (`SPLITSERVE_STALL_LOG_MS`): a slow
    engine turn (who: the line's logger prefix, e.g. `decode-core`) or a late event loop (who:
    the service)."""
    events = []
    for line in path.read_text(errors="replace").splitlines():
        match = STALL_LINE.search(line)
        if match is None:
            continue
        who = "engine turn" if "slow engine turn" in line else "event loop"
        core = re.search(r"(\w+)-core ", line)
        who = f"{core[1]} {who}" if core and who == "engine turn" else f"{match['who']} {who}"
        end = float(match["at"])
        events.append((end - float(match["ms"]) / 1e3, end, who))
    return events


def global_stalls(line: dict[str, Any], threshold_s: float) -> list[tuple[float, float]]:
    """(start, end) of each global stall: a bin where a quarter or more of the running streams'
    long gaps end, over two or more client processes (start: the bin's median gap start)."""
    bins: dict[int, list[tuple[float, float, int]]] = collections.defaultdict(list)
    for req in line["requests"]:
        stamps = sorted(set(req["times"]))
        for a, b in zip(stamps, stamps[1:], strict=False):
            if b - a > threshold_s:
                bins[int(b / BIN_S)].append((a, b, req["client"]))
    running = _running_per_bin(line["requests"])
    out = []
    for key, gaps in sorted(bins.items()):
        if len({c for *_, c in gaps}) > 1 and len(gaps) >= max(2, running.get(key, 0) // 4):
            starts = sorted(a for a, _, _ in gaps)
            out.append((starts[len(starts) // 2], max(b for _, b, _ in gaps)))
    return out


def explain(stalls: list[tuple[float, float]], events: list[tuple[float, float, str]]) -> dict:
    """How many stalls overlap a logged stall of each kind by half their length or more."""
    found: collections.Counter[str] = collections.Counter()
    for start, end in stalls:
        whos = {
            who for a, b, who in events if min(b, end) - max(a, start) >= 0.5 * (end - start)
        }
        for who in whos or {"nothing logged"}:
            found[who] += 1
    return {"global stalls": len(stalls), **dict(found.most_common())}


def _running_per_bin(requests: list[dict[str, Any]]) -> dict[int, int]:
    """Streams between their first and last token, per bin."""
    delta: collections.Counter[int] = collections.Counter()
    for req in requests:
        if len(req["times"]) > 1:
            delta[int(req["times"][0] / BIN_S)] += 1
            delta[int(req["times"][-1] / BIN_S) + 1] -= 1
    running, count = {}, 0
    for key in range(min(delta, default=0), max(delta, default=0) + 1):
        count += delta.get(key, 0)
        running[key] = count
    return running


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", help="bench.serving --records-out's file")
    parser.add_argument("--threshold-ms", type=float, default=25.0)
    parser.add_argument(
        "--stall-log", type=Path, help="the services' log (run with SPLITSERVE_STALL_LOG_MS): "
        "which logged stalls the global stalls overlap",
    )  # fmt: skip
    args = parser.parse_args(argv)
    threshold_s = args.threshold_ms / 1000
    with gzip.open(args.records, "rt") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    rows = [analyse(line, threshold_s) for line in lines]
    print(table(rows, list(rows[0]) if rows else []))
    if args.stall_log is not None:
        events = read_stall_log(args.stall_log)
        for line in lines:
            print(f"{line['rate']} req/s:", explain(global_stalls(line, threshold_s), events))
    return rows


if __name__ == "__main__":
    main()
