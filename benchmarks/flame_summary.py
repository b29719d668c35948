"""Summarise a py-spy profile: where the server's CPU time goes, by function.

Record the profile while a load runs (``py-spy record -p PID -d 15 -r 200 -f raw -o F
--nonblocking``), then ``python benchmarks/flame_summary.py F [--top 25]``. Prints, for the
functions that take the most samples, the share of all samples in which the function is on
the stack ("inclusive") and the share in which it is the innermost frame ("self"), grouped by
thread (event loop vs. search/worker threads). Idle samples (a thread waiting in epoll, a
queue or a lock) are counted apart so that the shares are of busy time.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

IDLE = re.compile(
    r"\b(run_forever|_run_once|select|poll|wait|_worker|acquire|get)\b \((?:uvloop|selectors|threading|concurrent|queue|asyncio)"
)
FRAME = re.compile(r"^(?P<name>[^ ]+) \((?P<file>[^:)]+)")


def frame_label(frame: str) -> str:
    """'parse_json (service/http/payload.py:120)' -> 'parse_json (payload.py)'."""
    m = FRAME.match(frame)
    if not m:
        return frame
    return f"{m.group('name')} ({m.group('file').rsplit('/', 1)[-1]})"


def summarise(lines: list[str], top: int) -> str:
    inclusive: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    busy = idle = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith(("thread", "process")) else "?"
        innermost = frame_label(frames[-1])
        if IDLE.search(frames[-1]) or innermost.startswith(("select ", "wait ", "_worker ")):
            idle += n
            continue
        busy += n
        threads[thread] += n
        for label in {frame_label(f) for f in frames[1:]}:
            inclusive[label] += n
        self_time[innermost] += n
    out = [f"busy samples: {busy}, idle samples: {idle}"]
    out.append(
        "threads (share of busy): "
        + ", ".join(f"{t}: {100 * n / busy:.1f}%" for t, n in threads.most_common(4))
    )
    out.append(f"{'inclusive %':>11} {'self %':>7}  function")
    for label, n in inclusive.most_common(top):
        out.append(f"{100 * n / busy:11.1f} {100 * self_time[label] / busy:7.1f}  {label}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("profile", help="py-spy raw (collapsed stacks) output")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.profile) as f:
        print(summarise(f.readlines(), args.top))


if __name__ == "__main__":
    main()
