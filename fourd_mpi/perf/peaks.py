"""The one table of data-sheet peaks: dense TFLOP/s per device and dtype, each with its source (pure).

Every figure the suite calls **MFU** or **HFU** divides by a peak from this table (or one the user
gives with ``--peak-tflops``); nothing else is called a peak:

- ``MFU = model FLOPs / (t_step x ranks x peak)`` (:data:`MFU_FORMULA`): the model FLOPs of the step
  (Narayanan et al.'s 72 convention, recompute not counted), as Megatron-LM and PaLM report it;
- ``HFU = hardware FLOPs / (t_step x ranks x peak)`` (:data:`HFU_FORMULA`): the FLOPs the step executes,
  recomputed forward work included (Megatron's 96 convention with full recompute);
- ``% of measured GEMM`` (:data:`GEMM_PCT_FORMULA`) is a different figure with its own name: model
  FLOP/s per rank over the standalone speed of the step's largest local GEMM on this machine.

Peaks are **dense** (no 2:4 sparsity) per device a rank drives: one GPU, or one GCD of an MI250X.
``float8`` is the FP8 (E4M3/E5M2) tensor-core rate of Hopper; the A100 and MI250X data sheets give none.
``float32`` is the non-tensor-core FP32 rate; ``tf32`` the tensor-core rate a ``float32`` run with
``--tf32`` uses. A CPU has no entry: its peak depends on the model, core count, clock and vector
units, so the suite reports no MFU on a CPU unless the user gives ``--peak-tflops``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

#: the FP8 GEMM dtype (a column of the table and a dtype of the model, not of ``run``: :mod:`fourd_mpi.perf.terms`)
FP8 = "float8"
MFU_FORMULA = "MFU = model FLOPs per step / (median step time x ranks x data-sheet peak per rank)"
HFU_FORMULA = ("HFU = hardware FLOPs per step (recomputed forward work included) / (median step time x ranks x "
               "data-sheet peak per rank)")
GEMM_PCT_FORMULA = ("% of measured GEMM = model FLOP/s per rank / standalone TFLOP/s of the step's largest local GEMM "
                    "(same shape, library and dtype, all ranks at once; median over ranks)")
NO_CPU_PEAK = ("not reported: no data-sheet peak for a CPU (it depends on the model, cores, clock and vector units); "
               "give --peak-tflops with your CPU's peak per rank")


@dataclass(frozen=True)
class Device:
    """One device of the table: ``peaks`` dense TFLOP/s per dtype, ``source`` the data sheet they come from."""

    name: str
    title: str
    pattern: str  # a regular expression matched (case-insensitive) against the runtime's device name
    peaks: Dict[str, float]
    source: str


A100 = "NVIDIA A100 Tensor Core GPU data sheet (2021): dense BF16/FP16 312, TF32 156, FP32 19.5, FP64 tensor core 19.5"
H100 = ("NVIDIA H100 Tensor Core GPU data sheet (2023), SXM column: dense BF16/FP16 989 (1,979 with sparsity), "
        "FP8 1,979 (3,958 with sparsity), TF32 495, FP32 67, FP64 tensor core 67")
#: the devices, in matching order (the first whose pattern matches a device name wins)
DEVICES: Tuple[Device, ...] = (
    Device("gh200", "NVIDIA GH200 (Hopper GPU)", r"GH200",
           {"bfloat16": 989.0, "float16": 989.0, "float8": 1979.0, "tf32": 494.0, "float32": 67.0, "float64": 67.0},
           "NVIDIA GH200 Grace Hopper Superchip data sheet (2023): dense BF16/FP16 990, FP8 1,979 (3,958 with "
           "sparsity), TF32 494, FP32 67, FP64 tensor core 67"),
    Device("h200", "NVIDIA H200 SXM", r"H200",
           {"bfloat16": 989.0, "float16": 989.0, "float8": 1979.0, "tf32": 494.0, "float32": 67.0, "float64": 67.0},
           "NVIDIA H200 Tensor Core GPU data sheet (2024), SXM column: dense BF16/FP16 989 (1,979 with sparsity), "
           "FP8 1,979 (3,958 with sparsity), TF32 494, FP32 67, FP64 tensor core 67"),
    Device("h100-pcie", "NVIDIA H100 PCIe", r"H100.*PCIe",
           {"bfloat16": 756.0, "float16": 756.0, "float8": 1513.0, "tf32": 378.0, "float32": 51.0, "float64": 51.0},
           "NVIDIA H100 Tensor Core GPU data sheet (2023), PCIe column: dense BF16/FP16 756, FP8 1,513 (3,026 with "
           "sparsity), TF32 378, FP32 51, FP64 tensor core 51"),
    Device("h100-nvl", "NVIDIA H100 NVL", r"H100.*NVL",
           {"bfloat16": 835.5, "float16": 835.5, "float8": 1670.5, "tf32": 417.5, "float32": 60.0, "float64": 60.0},
           "NVIDIA H100 Tensor Core GPU data sheet (2023), NVL column: dense BF16/FP16 835.5 (1,671 with sparsity), "
           "FP8 1,670.5 (3,341 with sparsity), TF32 417.5, FP32 60, FP64 tensor core 60"),
    Device("h100-sxm", "NVIDIA H100 SXM", r"H100",
           {"bfloat16": 989.0, "float16": 989.0, "float8": 1979.0, "tf32": 494.7, "float32": 67.0, "float64": 67.0},
           H100),
    Device("a100", "NVIDIA A100", r"A100",
           {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5, "float64": 19.5}, A100),
    Device("mi250x-gcd", "AMD Instinct MI250X, one GCD", r"MI250X",
           {"bfloat16": 191.5, "float16": 191.5, "float32": 47.9, "float64": 47.9},
           "AMD Instinct MI250X data sheet: dense BF16/FP16 383, FP32/FP64 matrix 95.7 per OAM of 2 GCDs "
           "(halved: one rank drives one GCD)"),
)
BY_NAME: Dict[str, Device] = {d.name: d for d in DEVICES}


def device(name: str) -> Device:
    """The table's entry ``name`` (KeyError naming the known ones otherwise)."""
    if name not in BY_NAME:
        raise KeyError(f"no data-sheet peaks for device {name!r} (known: {', '.join(BY_NAME)})")
    return BY_NAME[name]


def match_device(runtime_name: str) -> Optional[Device]:
    """The entry whose pattern matches a runtime device name (``NVIDIA H100 80GB HBM3``), or None."""
    for d in DEVICES:
        if re.search(d.pattern, runtime_name or "", re.IGNORECASE):
            return d
    return None


def dtype_key(dtype: str, tf32: bool = False) -> str:
    """The table column of a run's arithmetic: ``tf32`` for float32 GEMMs on tensor cores, else the dtype."""
    return "tf32" if tf32 and dtype == "float32" else dtype


def peak_tflops(dev: Device, dtype: str, tf32: bool = False) -> Optional[float]:
    """Dense data-sheet TFLOP/s of ``dev`` for ``dtype`` (None when the data sheet gives none)."""
    value = dev.peaks.get(dtype_key(dtype, tf32))
    return None if value is None else float(value)


def peak_source(dev: Device, dtype: str, tf32: bool = False) -> str:
    """How a peak is named in a summary: device, dtype column, and the data sheet."""
    return f"data sheet: {dev.title}, {dtype_key(dtype, tf32)} dense [{dev.source}]"


def utilization_pct(flops_per_step: float, step_s: float, ranks: int, peak: Optional[float]) -> float:
    """``100 F / (t_step x ranks x peak x 1e12)``: MFU with model FLOPs, HFU with hardware FLOPs (NaN: no peak)."""
    if not peak or not step_s or step_s <= 0:
        return float("nan")
    return 100.0 * flops_per_step / (step_s * ranks * peak * 1e12)


def runtime_peak(device_name: Optional[str], dtype: str, tf32: bool = False) -> Tuple[Optional[float], str]:
    """``(peak TFLOP/s per rank, source)`` for a run: the table's entry for the GPU the runtime names
    (``device_name``; None on a CPU), or ``(None, why not)``."""
    if device_name is None:
        return None, NO_CPU_PEAK
    dev = match_device(device_name)
    if dev is None:
        return None, (f"not reported: no data-sheet peak for device {device_name!r} in fourd_mpi/perf/peaks.py; "
                      f"give --peak-tflops")
    value = peak_tflops(dev, dtype, tf32)
    if value is None:
        return None, f"not reported: the {dev.title} data sheet gives no {dtype_key(dtype, tf32)} peak"
    return value, peak_source(dev, dtype, tf32)


def _number(value) -> Optional[float]:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if value == value and value not in (float("inf"), float("-inf")) else None


def stored_peaks(summary: Dict) -> Tuple[Optional[float], Optional[float]]:
    """``(data-sheet peak, measured GEMM)`` TFLOP/s per rank of a trace's stored run summary, old or new.

    Summaries with a ``gemm_tflops`` key keep both apart. Older ones had one ``peak_tflops``: the
    ``--peak-tflops`` value the user gave (``peak_source == "--peak-tflops"``: taken as the data-sheet
    peak) or the measured standalone GEMM (any other source: the GEMM, no data-sheet peak)."""
    summary = summary if isinstance(summary, dict) else {}
    if "gemm_tflops" in summary:
        return _number(summary.get("peak_tflops")), _number(summary.get("gemm_tflops"))
    old = _number(summary.get("peak_tflops"))
    if summary.get("peak_source") == "--peak-tflops":
        return old, None
    return None, old
