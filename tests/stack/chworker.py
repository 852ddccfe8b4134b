"""Runs SQL on a chDB store in a process of its own (chDB allows one data directory per
process, and the test process may have opened another): ``python -m tests.stack.chworker
DSN DATABASE``, then one JSON request per stdin line, one JSON answer per stdout line.

    {"sql": "SELECT ..."}                          -> {"columns": [...], "rows": [[...]]}
    {"saved": "NAME", "params": {"k": "v"}}       -> the same, as ``kvscope query NAME``
    anything failing                               -> {"error": "..."}
"""

from __future__ import annotations

import json
import sys
from typing import Any


def serve(dsn: str, database: str) -> None:
    import clickhouse_connect

    from dashboards.clickhouse import load
    from kvscope.store import query

    client = clickhouse_connect.get_client(dsn=dsn, database=database)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if "saved" in req:
                cols, rows = query.run_saved(client, load(req["saved"]), req["params"])
            else:
                result = client.query(req["sql"])
                cols, rows = list(result.column_names), [list(r) for r in result.result_rows]
            answer: dict[str, Any] = {"columns": cols, "rows": rows}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            answer = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
        print(json.dumps(answer, default=str), flush=True)
    client.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
