"""The oracle `tfmoe sql`'s output is held to: what it printed through pandas before issue 23 (DuckDB's ``.df()``,
then ``to_json(orient="records", date_format="iso", default_handler=str)``, ``to_csv(index=False)``, or the frame's
cells in a table). Tests only: tfmoe itself prints without pandas (harness/reading/sql_output.py)."""

from __future__ import annotations

import warnings
from typing import Any

from tfmoe.contract.tables import cell
from tfmoe.harness.reading import sql_output


def pandas_texts(con: Any, query: str) -> dict[str, Any]:
    with warnings.catch_warnings():  # pandas 3.1 deprecates what DuckDB's .df() does with zone-aware columns
        warnings.simplefilter("ignore")
        df = con.execute(query).df()
    try:
        as_json = df.to_json(orient="records", date_format="iso", default_handler=str)
    except (OverflowError, ValueError) as exc:  # pandas' ujson fails on some values (BIT)
        as_json = f"raised {type(exc).__name__}"
    return {"columns": [str(c) for c in df.columns],
            "cells": [[cell(v) for v in row] for row in df.itertuples(index=False)],
            "json": as_json, "csv": df.to_csv(index=False)}


def tfmoe_texts(con: Any, query: str) -> dict[str, Any]:
    result = sql_output.Result.fetch(con.execute(query))
    return {"columns": result.columns, "cells": [[cell(v) for v in row] for row in sql_output.table_rows(result)],
            "json": sql_output.json_records(result), "csv": sql_output.csv_text(result)}
