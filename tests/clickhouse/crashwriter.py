"""A sink in a process of its own, to be killed with SIGKILL and recovered (test_crash.py).

python -m tests.clickhouse.crashwriter MODE CHDB_DIR SPOOL_DIR [ACKED]
  die-after-insert  write 3,000 rows, then SIGKILL itself the moment the store has taken a
                    batch and before the spool forgets it (the crash window of write-ahead)
  stream            write rows in chunks of 500 and print "acked N" after each flush()
                    returns (everything taken is spooled, so N rows are acknowledged),
                    until killed
  recover           open the same store and spool, deliver what is spooled, print counts
                    as JSON (ACKED: how many of rows 0..ACKED-1 must be there)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import replace

from kvscope.sinks.options import DeliveryOptions
from kvscope.sinks.spool import Spool
from kvscope.store.sink import ClickHouseSink
from tests.clickhouse.rowsource import trace

OPTIONS = DeliveryOptions(batch_rows=1000, batch_interval_s=0.1, backoff_initial_s=0.02,
                          backoff_max_s=0.2)


def main(mode: str, chdb_dir: str, spool_dir: str, acked: int = 0) -> None:
    opts = replace(OPTIONS, batch_rows=250) if mode == "stream" else OPTIONS
    if mode == "die-after-insert":
        done = Spool.done

        def die(self: Spool, batch: object) -> None:
            if getattr(batch, "seq", 0) == 2:
                while len(self) < 2:  # until batch 3 is spooled too
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            done(self, batch)  # type: ignore[arg-type]

        Spool.done = die  # type: ignore[method-assign]
    sink = ClickHouseSink(f"chdb://{chdb_dir}", database="crash", spool_dir=spool_dir,
                          options=opts)
    if mode == "die-after-insert":
        for i in range(3000):
            sink.write("request_traces", trace(i))
        sink.flush(30)
        raise SystemExit("still alive")
    if mode == "stream":
        i = 0
        while True:
            for _ in range(500):
                sink.write("request_traces", trace(i))
                i += 1
            sink.flush(10)
            print(f"acked {i}", flush=True)
    ok = sink.flush(60)
    client = sink.client()
    n, distinct, below = client.query(
        "SELECT count(), uniqExact(request_id), countIf(prompt_len < {a:UInt32}) "
        "FROM crash.request_traces", parameters={"a": acked}).result_rows[0]
    print(json.dumps({"delivered": ok, "count": n, "distinct": distinct, "below": below,
                      "stats": sink.stats().rows_written}), flush=True)
    sink.close(5)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:]))
