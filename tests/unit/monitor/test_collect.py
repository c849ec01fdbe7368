"""Collector: psutil metrics and no GPU metrics on this machine; NVML aggregation with a
fake pynvml; rates from counters; step-time hook; background thread writing a trace."""

import sys
import time
import types

import pytest

from megatron_rl.monitor.collect import Collector, NvmlSource, PsutilSource, StepTimeSource, parse_pause_frames
from megatron_rl.monitor.trace import read_trace

GPU_NAMES = {
    "gpu_duty_cycle",
    "gpu_power",
    "gpu_mem_used",
    "gpu_graphics_activity",
    "gpu_tensor_activity",
    "gpu_temperature",
    "gpu_ecc_errors",
    "nvlink_bandwidth",
    "pcie_tx_bytes",
    "pcie_rx_bytes",
}


def test_cpu_machine_yields_psutil_metrics_and_no_gpu_metrics():
    c = Collector(hostname="h1", sources=[PsutilSource(), NvmlSource()])
    first = c.sample()
    assert {"cpu_util", "host_mem_used"} <= set(first)
    assert 0.0 <= first["cpu_util"] <= 100.0 and 0.0 < first["host_mem_used"] <= 100.0
    assert not GPU_NAMES & set(first)  # absent, not zero
    second = c.sample()
    assert {"net_rx_bytes", "net_tx_bytes"} <= set(second)  # rates need two readings
    assert all(v >= 0 for v in second.values())
    rows = c.drain()
    assert {r[1] for r in rows} == {"h1"} and len(rows) == len(first) + len(second)
    assert c.drain() == []


def test_nvml_absent_means_no_metrics(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as if not installed
    src = NvmlSource()
    assert not src.available and src.read() == {}


class _FakeNvml(types.ModuleType):
    """Two GPUs; GPU 1 has no power sensor; NVLink counters grow 1 MiB per read."""

    NVML_TEMPERATURE_GPU = 0
    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 1, 0
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 138, 139
    NVML_SUCCESS = 0

    def __init__(self):
        super().__init__("pynvml")
        self.reads = 0

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=[90, 70][h])

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1:
            raise RuntimeError("not supported")
        return 500_000  # mW

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=[40, 60][h], total=100)

    def nvmlDeviceGetTemperature(self, h, kind):
        return [60, 75][h]

    def nvmlDeviceGetPcieThroughput(self, h, which):
        return 1  # KB/s

    def nvmlDeviceGetTotalEccErrors(self, h, a, b):
        return [0, 2][h]

    def nvmlDeviceGetFieldValues(self, h, ids):
        self.reads += 1
        kib = 1024 * (self.reads // 2 + 1) // 2  # tx and rx each grow 256 KiB per machine read
        return [types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(ullVal=kib)) for _ in ids]

    def nvmlGpmSampleAlloc(self):
        raise RuntimeError("GPM needs Hopper")


def test_nvml_aggregates_over_gpus_and_drops_what_fails(monkeypatch):
    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    src = NvmlSource()
    assert src.available
    first = src.read()
    assert first["gpu_duty_cycle"] == 80.0  # mean of 90 and 70
    assert first["gpu_power"] == 500.0  # GPU 1 has no sensor: mean over the one that does
    assert first["gpu_mem_used"] == 50.0 and first["gpu_temperature"] == 75 and first["gpu_ecc_errors"] == 2
    assert first["pcie_tx_bytes"] == 2048.0  # summed, KB/s -> bytes/s
    assert "nvlink_bandwidth" not in first  # a counter: no rate yet
    assert "gpu_graphics_activity" not in first and "gpu_tensor_activity" not in first  # no GPM
    time.sleep(0.01)
    second = src.read()
    assert second["nvlink_bandwidth"] > 0
    src.close()
    assert src.read() == {}


def test_pause_frame_parsing():
    out = (
        "NIC statistics:\n     rx_packets: 10\n     tx_prio3_pause: 120\n     tx_prio4_pause: 5\n"
        "     tx_pause_ctrl_phy: 7\n     rx_prio3_pause: 99\n"
    )
    assert parse_pause_frames(out) == 132
    assert parse_pause_frames("NIC statistics:\n rx_packets: 1\n") is None


def test_step_time_hook_is_absent_until_a_step_finishes():
    c = Collector(hostname="h", sources=[])
    assert c.sample() == {}
    c.record_step_time(2.5)
    assert c.sample() == {"step_time": 2.5}


def test_a_failing_source_does_not_stop_the_others():
    class Broken:
        def read(self):
            raise OSError("sensor gone")

        def close(self):
            pass

    step = StepTimeSource()
    step.record(1.0)
    c = Collector(hostname="h", sources=[Broken(), step])
    assert c.sample() == {"step_time": 1.0} and c.errors == 1


def test_background_thread_writes_a_readable_trace(tmp_path):
    ticks = []

    def clock():  # one fake second per sample
        ticks.append(len(ticks))
        return float(ticks[-1])

    path = tmp_path / "h.csv"
    c = Collector(hostname="h", interval_s=0.02, sources=[PsutilSource()], trace_path=str(path), clock=clock)
    with c:
        deadline = time.monotonic() + 5
        while len(ticks) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    tr = read_trace(path)
    assert tr.machines == ["h"] and "cpu_util" in tr.metrics
    assert sorted(set(tr.timestamps[tr.metric_idx == tr.metrics.index("cpu_util")])) == [
        float(t) for t in ticks
    ]  # every sample reached the file, once


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        Collector(hostname="h", interval_s=0, sources=[])


def test_machines_are_named_as_slurm_knows_them(monkeypatch):
    from megatron_rl.monitor.collect import default_hostname

    monkeypatch.setenv("SLURMD_NODENAME", "gpu-node-17")
    assert Collector(sources=[]).hostname == "gpu-node-17"
    monkeypatch.delenv("SLURMD_NODENAME")
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-node-18.cluster.example.org")
    assert default_hostname() == "gpu-node-18"
