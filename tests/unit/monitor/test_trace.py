"""Trace format: reading, writing, clear errors, and the defect counts of validate()."""

import math

import numpy as np
import pytest

from megatron_rl.monitor.trace import (
    PRIORITY_METRICS,
    CsvTraceWriter,
    Trace,
    TraceError,
    check_strict,
    metric_order,
    read_trace,
    validate,
    write_trace,
)

HEADER = "timestamp,machine,metric,value\n"


def write(tmp_path, text, name="t.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_csv_round_trip_keeps_rows_and_missing_values(tmp_path):
    rows = [(0.0, "a", "cpu_util", 1.5), (0.0, "b", "cpu_util", math.nan), (1.0, "a", "gpu_power", 300.25)]
    write_trace(Trace.from_rows(rows), tmp_path / "x.csv")
    got = list(read_trace(tmp_path / "x.csv").rows())
    assert [r[:3] for r in got] == [r[:3] for r in rows]
    np.testing.assert_array_equal([r[3] for r in got], [r[3] for r in rows])  # NaN == NaN here
    assert not list(tmp_path.glob(".x.csv.*"))  # no temp file left behind


def test_directory_of_files_is_one_trace(tmp_path):
    write(tmp_path, HEADER + "0,a,cpu_util,1\n", "part1.csv")
    write(tmp_path, HEADER + "0,b,cpu_util,2\n1,a,cpu_util,3\n", "part2.csv")
    write(tmp_path, "ignored", "notes.txt")
    tr = read_trace(tmp_path)
    assert len(tr) == 3 and sorted(tr.machines) == ["a", "b"]


def test_missing_column_names_it_and_the_allowed_columns(tmp_path):
    p = write(tmp_path, "timestamp,machine,metric\n0,a,cpu_util\n")
    with pytest.raises(TraceError) as e:
        read_trace(p)
    msg = str(e.value)
    assert "missing column(s) 'value'" in msg and "timestamp, machine, metric, value" in msg


@pytest.mark.parametrize(
    "row, words",
    [
        ("abc,a,cpu_util,1", ["row 3", "'timestamp'", "'abc'", "finite number"]),
        ("inf,a,cpu_util,1", ["row 3", "'timestamp'", "'inf'"]),
        ("1,,cpu_util,1", ["row 3", "'machine' is empty", "hostname"]),
        ("1,a,,1", ["row 3", "'metric' is empty"]),
        ("1,a,cpu_util,fast", ["row 3", "'value'", "'fast'", "empty or nan for missing"]),
        ("1,a,cpu_util", ["row 3", "3 fields", "header has 4"]),
    ],
)
def test_malformed_row_is_named(tmp_path, row, words):
    p = write(tmp_path, HEADER + "0,a,cpu_util,1\n" + row + "\n")
    with pytest.raises(TraceError) as e:
        read_trace(p)
    for w in words:
        assert w in str(e.value)
    assert str(p) in str(e.value)


def test_path_errors(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "nope.csv")
    with pytest.raises(TraceError, match="allowed: .csv, .parquet"):
        read_trace(write(tmp_path, "x", "t.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no .csv or .parquet"):
        read_trace(tmp_path / "empty")
    with pytest.raises(TraceError, match="empty file"):
        read_trace(write(tmp_path, ""))


def test_parquet_needs_pyarrow_or_says_what_to_install(tmp_path):
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(TraceError, match="pip install pyarrow"):
            read_trace(write(tmp_path, "x", "t.parquet"))
    else:
        tr = Trace.from_rows([(0.0, "a", "cpu_util", 1.0), (1.0, "a", "cpu_util", 2.0)])
        write_trace(tr, tmp_path / "t.parquet")
        assert list(read_trace(tmp_path / "t.parquet").rows()) == list(tr.rows())


def test_validate_counts_every_defect(tmp_path):
    body = [
        "0,a,cpu_util,1",
        "0,b,cpu_util,",
        "0,c,cpu_util,nan",  # 2 missing values
        "0,a,gpu_power,300",
        "0,b,gpu_power,301",  # c never reports gpu_power
        "2,a,cpu_util,1",
        "1,a,cpu_util,1",  # a goes back in time once
        "2,b,cpu_util,2",
        "2,b,cpu_util,2",  # one duplicate
        "2,a,my_custom,5",  # a non-canonical metric
        "30,a,cpu_util,1",
        "30,b,cpu_util,1",  # c left after t=0
        "12,d,cpu_util,1",
        "30,d,cpu_util,1",  # d joined at 12
    ]
    rep = validate(read_trace(write(tmp_path, HEADER + "\n".join(body) + "\n")))
    assert rep.rows == 14 and rep.machines == 4 and (rep.start, rep.end) == (0.0, 30.0)
    assert rep.nan_values == 2
    assert rep.out_of_order == 1
    assert rep.duplicates == 1
    assert rep.unknown_metrics == ["my_custom"]
    assert rep.missing_metrics == [m for m in PRIORITY_METRICS if m not in ("cpu_util", "gpu_power")]
    assert rep.partial_metrics == {"gpu_power": 2, "my_custom": 3}
    assert rep.joined == {"d": 12.0}
    assert rep.left == {"c": 0.0}
    text = "\n".join(rep.lines())
    assert "out-of-order rows: 1" in text and "machines joining late: 1" in text


def test_validate_rejects_an_empty_trace():
    with pytest.raises(TraceError, match="no rows"):
        validate(Trace.from_rows([]))


def test_metric_order_puts_priority_first_and_unknown_last():
    assert metric_order(["zzz", "gpu_power", "step_time", "pfc_tx_packets"]) == [
        "pfc_tx_packets",
        "gpu_power",
        "step_time",
        "zzz",
    ]


def test_streaming_writer_appends_with_one_header(tmp_path):
    p = tmp_path / "s.csv"
    w = CsvTraceWriter(p)
    w.write([(1.0, "a", "cpu_util", 3.0)])
    w.close()
    w = CsvTraceWriter(p)
    w.write([(2.0, "a", "cpu_util", None)])
    w.close()
    assert p.read_text().count("timestamp") == 1
    tr = read_trace(p)
    assert len(tr) == 2 and math.isnan(tr.values[1])


def test_a_file_grouped_by_metric_is_not_out_of_order(tmp_path):
    body = "0,a,cpu_util,1\n1,a,cpu_util,1\n0,a,gpu_power,2\n1,a,gpu_power,2\n"
    assert validate(read_trace(write(tmp_path, HEADER + body))).out_of_order == 0


def test_strict_refuses_an_unknown_metric_and_suggests_the_close_name(tmp_path):
    tr = read_trace(write(tmp_path, HEADER + "0,a,cpu_util,1\n0,a,gpu_dutycycle,5\n"))
    with pytest.raises(TraceError) as e:
        check_strict(tr, where="t.csv")
    msg = str(e.value)
    assert msg.startswith("t.csv: unknown metric 'gpu_dutycycle' (did you mean gpu_duty_cycle?)")
    assert "allowed: pfc_tx_packets" in msg and "\n" not in msg
    assert "non-canonical metrics (lowest priority): gpu_dutycycle (did you mean gpu_duty_cycle?)" in "\n".join(
        validate(tr).lines()
    )


def test_strict_names_the_first_series_that_goes_back_in_time(tmp_path):
    body = "0,a,cpu_util,1\n5,a,gpu_power,1\n3,b,cpu_util,1\n2,b,cpu_util,1\n9,a,cpu_util,1\n"
    tr = read_trace(write(tmp_path, HEADER + body))
    with pytest.raises(TraceError, match=r"time goes back in machine 'b', metric 'cpu_util': 2 s after 3 s"):
        check_strict(tr)


def test_strict_accepts_a_canonical_trace_in_order_and_one_grouped_by_metric(tmp_path):
    body = "0,a,cpu_util,1\n1,a,cpu_util,1\n0,a,gpu_power,2\n1,a,gpu_power,2\n0,b,step_time,7\n"
    check_strict(read_trace(write(tmp_path, HEADER + body)))  # raises nothing
