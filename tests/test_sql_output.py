"""`tfmoe sql`'s output without pandas (issue 23): every DuckDB type, each format, the same text pandas printed
(tests/sql_pandas_oracle.py), except where pandas printed something that is not the data (F-151)."""

from __future__ import annotations

import math
import random
import struct
from pathlib import Path

import duckdb
import pytest
from sql_pandas_oracle import pandas_texts, tfmoe_texts

from tfmoe.api.testing import launched
from tfmoe.harness.reading import sql
from tfmoe.harness.reading.sql_output import deduplicate, json_float

# One SELECT list per case: every DuckDB type, with NULLs, empty results, repeated names, special floats and
# strings (quotes, commas, slashes, control characters, non-ASCII), mixed precisions in one column.
SAME_AS_PANDAS = [
    '1 AS a',
    '1::BIGINT AS a UNION ALL SELECT NULL',
    'true AS b UNION ALL SELECT false',
    'true AS b UNION ALL SELECT NULL',
    '1.5 AS d',
    '1.5::DOUBLE AS d UNION ALL SELECT NULL',
    "'x' AS s UNION ALL SELECT NULL",
    'sum(1) AS h',
    "DATE '2020-01-02' AS d UNION ALL SELECT NULL",
    "TIMESTAMP '2020-01-02 03:04:05.123456' AS t",
    "TIMESTAMPTZ '2020-01-02 03:04:05.123456+00' AS t UNION ALL SELECT NULL",
    "TIMESTAMPTZ '2020-01-02 00:00:00+00' AS t",
    'INTERVAL 3 DAY + INTERVAL 5 SECOND AS i',
    '[1,2,3] AS l',
    "{'a': 1, 'b': 'x'} AS s",
    "MAP {'k': 1} AS m",
    "'\\xAA'::BLOB AS b",
    "TIME '03:04:05' AS t",
    "TIME '01:02:03.25' AS t UNION ALL SELECT NULL",
    "'00000000-0000-0000-0000-000000000001'::UUID AS u",
    '123456789012345678901::HUGEINT AS h',
    '18446744073709551615::UBIGINT AS u',
    '1::TINYINT AS t UNION ALL SELECT NULL',
    '1::FLOAT AS f',
    '0.1::FLOAT AS f UNION ALL SELECT NULL UNION ALL SELECT 3.4e38::FLOAT UNION ALL SELECT 1e-7::FLOAT',
    "'nan'::DOUBLE AS f UNION ALL SELECT 'inf'::DOUBLE UNION ALL SELECT '-inf'::DOUBLE",
    '1 AS a, 2 AS a, 3 AS a_1, 4 AS A',
    '123456789.123456789::DOUBLE AS x',
    "'a/b' AS s",
    '\'é€😀"\\\\\' AS s',
    'chr(10) || chr(9) || chr(127) || chr(31) || chr(8232) || chr(13) || chr(8) || chr(12) AS s',
    '\'a,b\' AS s UNION ALL SELECT \'x"y\' UNION ALL SELECT \'\' UNION ALL SELECT \' lead\'',
    "TIMESTAMP '2020-01-02 03:04:05.123999' AS t UNION ALL SELECT TIMESTAMP '2020-01-02 03:04:05'",
    "TIMESTAMP '2020-01-02 03:04:05.5' AS t UNION ALL SELECT TIMESTAMP '2020-01-02 03:04:05'",
    "TIMESTAMP '2020-01-02 00:00:00' AS t UNION ALL SELECT NULL",
    "TIMESTAMP '1960-01-02 03:04:05.123999' AS t",
    "TIMESTAMP_S '2020-01-02 03:04:05' AS t",
    "TIMESTAMP_MS '2020-01-02 03:04:05.5' AS t",
    'INTERVAL 3 DAY AS i',
    'INTERVAL 1 MONTH AS i',
    'INTERVAL 500 MILLISECOND AS i UNION ALL SELECT INTERVAL 1 SECOND',
    'INTERVAL 1 MICROSECOND AS i',
    '-INTERVAL 5 SECOND AS i',
    '-INTERVAL 1 DAY - INTERVAL 500 MILLISECOND AS i',
    '-INTERVAL 1 DAY AS i',
    'INTERVAL 1 DAY AS i UNION ALL SELECT NULL',
    'INTERVAL 1 DAY AS i UNION ALL SELECT INTERVAL 1 HOUR',
    "'a'::ENUM('a','b') AS e UNION ALL SELECT NULL",
    '[0.5, 0.25] AS l',
    "['a','b'] AS l",
    '[1.0,2.0]::FLOAT[] AS l',
    '[[1,2],[3]] AS l',
    "[{'a':1}] AS l",
    '[1,2]::INTEGER[2] AS a',
    'union_value(k := 1) AS u',
    '\'{"a":1}\'::JSON AS j',
    '1.25::DECIMAL(30,2) AS d',
    'NULL AS n',
    '1::INTEGER AS a WHERE false',
    '[1,2]::BIGINT[] AS l UNION ALL SELECT []',
    "MAP {'k': [1]} AS m",
    "{'a': [1,2]} AS s",
    "{'a': NULL} AS s",
    '[NULL]::VARCHAR[] AS l',
    "[NULL, 'a'] AS l",
    '0.1::DOUBLE + 0.2 AS x',
    "[DATE '2020-01-02'] AS l",
    "[TIMESTAMP '2020-01-02 03:04:05'] AS l",
    '[INTERVAL 1 DAY] AS l',
    "['00000000-0000-0000-0000-000000000001'::UUID] AS l",
    '[1::HUGEINT] AS l',
    "[TIME '01:02:03'] AS l",
    "[TIMESTAMPTZ '2020-01-02 03:04:05+00'] AS l",
    "{'d': DATE '2020-01-02', 't': TIMESTAMP '2020-01-02 03:04:05', 'x': 1.5::DECIMAL(3,1), 'f': 0.1::DOUBLE} AS s",
    "{'i': INTERVAL 1 DAY, 'tz': TIMESTAMPTZ '2020-01-02 03:04:05+00', 'b': true, 'u': '00000000-0000-0000-0000-000000000001'::UUID} AS s",
    "MAP {1: 'x'} AS m",
    "[['a','b'],['c']] AS l",
    'range(1, 30) AS l',
    '[1.5::DOUBLE, 2.25, 1e10] AS l',
    '[0.1::DOUBLE, 1e-9] AS l',
    '[true, false] AS l',
    "['a very long string that numpy must wrap when it prints the array', 'another long string value', 'third'] AS l",
    "1 AS x, 'y' AS y, 2.5::DOUBLE AS z UNION ALL SELECT NULL, NULL, NULL",
    'INTERVAL 500 MILLISECOND AS i UNION ALL SELECT INTERVAL 1 SECOND UNION ALL SELECT NULL',
    'INTERVAL 1 DAY AS i UNION ALL SELECT INTERVAL 1 MICROSECOND',
    '-INTERVAL 1 DAY AS i UNION ALL SELECT INTERVAL 1 MICROSECOND',
    "chr(127) || 'x' || chr(0) || chr(1) || chr(55) AS s",
    '\'"\' || chr(92) || \'/\' AS s',
    "{'s': 'a/b', 'l': [1, NULL]} AS s",
    "'\\u007f' || chr(127) AS s",
    "TIMESTAMPTZ '2020-01-02 03:04:05.77+00' AS t",
    "TIMESTAMPTZ '2020-01-02 03:04:05.77+00' AS t UNION ALL SELECT TIMESTAMPTZ '2020-01-02 03:04:05.548433+00'",
    "TIMESTAMPTZ '2020-01-02 03:04:05+00' AS t UNION ALL SELECT TIMESTAMPTZ '2020-01-02 03:04:05.5+00'",
    "TIMESTAMPTZ '2020-01-02 00:00:00+00' AS t UNION ALL SELECT NULL",
]


@pytest.mark.parametrize("select", SAME_AS_PANDAS)
def test_each_type_prints_as_pandas_printed_it(select: str) -> None:
    con = duckdb.connect()
    assert tfmoe_texts(con, f"SELECT {select}") == pandas_texts(con, f"SELECT {select}")


def test_zone_aware_values_print_in_the_connections_zone_as_pandas_did() -> None:
    con = duckdb.connect()
    con.execute("SET TimeZone = 'Europe/Berlin'")
    query = ("SELECT TIMESTAMPTZ '2020-01-02 03:04:05.77+00' AS t UNION ALL SELECT TIMESTAMPTZ '2020-07-02 03:04:05+00'"
             " UNION ALL SELECT NULL")
    got = tfmoe_texts(con, query)
    assert got == pandas_texts(con, query)
    assert got["csv"] == "t\n2020-01-02 04:04:05.770+01:00\n2020-07-02 05:04:05.000+02:00\n\"\"\n"


# F-151: where pandas' text is not the data, tfmoe prints the data. (select, field, pandas' text, tfmoe's text)
NOT_PANDAS = [
    ("[1, NULL] AS l", "json", '[{"l":[1,0]}]', '[{"l":[1,null]}]'),  # the masked slot's 0
    ("[1.5::DOUBLE, NULL] AS l", "json", '[{"l":[1.5,0.0]}]', '[{"l":[1.5,null]}]'),
    ("[true, NULL] AS l", "json", '[{"l":[true,false]}]', '[{"l":[true,null]}]'),
    ("['a'::ENUM('a','b')] AS l", "json", '[{"l":[0]}]', '[{"l":["a"]}]'),  # the codes, not the labels
    ("['a'::ENUM('a','b')] AS l", "csv", "l\n[0]\n", "l\n['a']\n"),
    ("'101'::BIT AS b", "json", "raised OverflowError", '[{"b":"101"}]'),
    ("'101'::BIT AS b", "csv", "b\nb'\\x05\\xfd'\n", "b\n101\n"),  # DuckDB's bytes, not the bits
]


@pytest.mark.parametrize(("select", "field", "pandas_text", "text"), NOT_PANDAS)
def test_where_pandas_misprinted_the_data_tfmoe_prints_the_data(select: str, field: str, pandas_text: str,
                                                               text: str) -> None:
    con = duckdb.connect()
    assert pandas_texts(con, f"SELECT {select}")[field] == pandas_text  # still so in the pandas tested
    assert tfmoe_texts(con, f"SELECT {select}")[field] == text


def test_values_pandas_refused_print() -> None:
    con = duckdb.connect()
    with pytest.raises(duckdb.Error):
        pandas_texts(con, "SELECT 12345678901234567890123::VARINT AS v")
    assert tfmoe_texts(con, "SELECT 12345678901234567890123::VARINT AS v")["csv"] == "v\n12345678901234567890123\n"


def _doubles(n: int) -> list[float]:
    rng = random.Random(0)
    out = [0.0, -0.0, 1.0, -1.0, 0.5, 1e16, 1e16 - 2, 9999999999999998.0, 1e-15, 9.99e-16, 5e-11, 1.5e-10,
           0.99999999995, 0.999999999949, 2.5e-10, 5e-324, 1.7976931348623157e308, -2.5e-300, 1e15 + 0.3]
    while len(out) < n:
        k = rng.random()
        if k < 0.3:
            out.append(rng.uniform(-1e6, 1e6))
        elif k < 0.6:
            v = struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
            out.append(v if math.isfinite(v) else 1.0)
        elif k < 0.8:
            out.append(rng.random() * 10 ** rng.randint(-20, 20))
        else:
            out.append(round(rng.uniform(-100, 100), rng.randint(0, 12)))
    return out


def test_json_floats_match_pandas_ujson_on_many_doubles() -> None:
    import pandas as pd

    values = _doubles(20_000)
    expected = pd.Series(values).to_json(orient="values")[1:-1].split(",")
    got = [json_float(v) for v in values]
    assert [(v, e, g) for v, e, g in zip(values, expected, got, strict=True) if e != g] == []
    assert json_float(float("nan")) == json_float(float("inf")) == json_float(float("-inf")) == "null"


@pytest.mark.parametrize(("names", "unique"), [
    (["a", "b"], ["a", "b"]),
    (["a", "a", "a"], ["a", "a_1", "a_2"]),
    (["a", "a", "a_1"], ["a", "a_1", "a_1_1"]),  # a name a rename took is renamed in turn
    (["A", "a"], ["A", "a_1"]),  # case-insensitive, as DuckDB's names are
    ([], []),
])
def test_repeated_column_names_are_renamed_as_duckdbs_df_did(names: list[str], unique: list[str]) -> None:
    assert deduplicate(names) == unique
    if names:
        con = duckdb.connect()
        select = ", ".join(f'{i} AS "{n}"' for i, n in enumerate(names))
        assert list(con.execute(f"SELECT {select}").df().columns) == unique


@pytest.fixture
def two_runs(fake_experiment) -> list[Path]:
    return [launched(fake_experiment, args)[1][-1] for args in (["seed=1"], ["seed=2", "mode=fail_check"])]


@pytest.mark.parametrize("query", [
    "SELECT * FROM runs ORDER BY seed", "SELECT * FROM metrics ORDER BY run_id, step",
    "SELECT * FROM checks ORDER BY run_id", "SELECT * FROM timings ORDER BY run_id",
    "SELECT experiment, count(*) AS n, sum(wall_s) AS s, max(finished_at) - min(started_at) AS span, "
    "list(seed ORDER BY seed) AS seeds, min(started_at)::DATE AS day FROM runs GROUP BY ALL",
])
def test_the_views_of_real_runs_print_as_pandas_printed_them(two_runs: list[Path], query: str) -> None:
    con = sql.connect(Path("runs"), query)
    got = tfmoe_texts(con, query)
    assert got == pandas_texts(con, query) and len(got["cells"]) > 0
