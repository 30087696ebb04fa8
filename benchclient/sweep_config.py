"""SweepConfig: one validated, frozen pool-sizing experiment loaded from `configs/sweeps/<name>.yaml`.

Owns the YAML schema (`KEYS` below) and its checks: an unknown key or a bad value fails at load with the file,
the key (`layouts[1].prefill`, `workloads[0].kind`, `slo.ttft_ms`) and the reason; every layout's serving config
(the base config + `overrides` + the layout) is validated by pdserve's own loader before anything starts.
A cell is one (layout, workload, load); `cells()` lists them in run order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchclient.arrivals import ArrivalSpec
from benchclient.run_config import MAX_CLIENT_PROCESSES
from benchclient.stats import SLO
from benchclient.workload import build_requests
from benchclient.workload_spec import WorkloadSpec
from engine.config_error import ConfigError

KEYS = {"description", "base_config", "output_dir", "ray_address", "overrides", "layouts", "workloads", "loads", "slo",
        "extra_slos",
        "warmup_s", "duration_s", "timeout_s", "start_timeout_s", "endpoint", "ignore_eos", "restart_per_cell",
        "seed", "client_processes"}
REQUIRED = ("base_config", "layouts", "workloads", "loads")
LAYOUT_KEYS = {"name", "mode", "prefill", "decode", "workers", "set"}
LOAD_KEYS = {"arrival", "rates", "concurrencies", "burstiness"}


@dataclass(frozen=True)
class Layout:
    name: str
    mode: str                    # "disaggregated" | "collocated" | "adaptive" (prefill + decode: its starting split)
    prefill: int                 # 0 when collocated
    decode: int                  # the collocated workers count here (pdserve runs them as the decode pool)
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    def serve_overrides(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "decode.workers": self.decode}
        if self.mode != "collocated":
            out["prefill.workers"] = self.prefill
        return {**out, **dict(self.overrides)}


@dataclass(frozen=True)
class Cell:
    layout: Layout
    workload: WorkloadSpec
    arrival: ArrivalSpec

    @property
    def key(self) -> str:
        return f"{self.layout.name}|{self.workload.name}|{self.arrival.label}"

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", self.key)


@dataclass(frozen=True)
class SweepConfig:
    path: Path
    base_config: Path
    output_dir: Path
    layouts: tuple[Layout, ...]
    workloads: tuple[WorkloadSpec, ...]
    loads: tuple[ArrivalSpec, ...]
    overrides: tuple[tuple[str, Any], ...] = ()
    ray_address: str | None = None   # None: each server starts a local Ray; "auto": join the running cluster
    slo: SLO = SLO()
    extra_slos: tuple[SLO, ...] = ()  # more SLO pairs each cell's goodput is also given under (goodput@<ttft>/<tpot>)
    warmup_s: float = 5.0
    duration_s: float = 60.0
    timeout_s: float = 300.0
    start_timeout_s: float = 600.0
    endpoint: str = "completions"
    ignore_eos: bool = True
    restart_per_cell: bool = True    # a fresh system per cell; False: one server per layout serves its cells
    seed: int = 0
    client_processes: int = 1        # OS processes sending each cell's load (benchclient.client_processes)
    description: str = ""            # shown at the top of the report

    def cells(self) -> list[Cell]:
        return [Cell(lay, w, a) for lay in self.layouts for w in self.workloads for a in self.loads]


def load_sweep_config(path: str | Path) -> SweepConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such sweep config") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None

    def fail(key: str, reason: str) -> ConfigError:
        return ConfigError(f"{path}: {key}: {reason}")

    _no_unknown(_mapping(raw, "top level", fail), KEYS, "", fail)
    for key in (k for k in REQUIRED if k not in raw):
        raise fail(key, "is required")
    base = _resolve(raw["base_config"], path)
    if not base.is_file():
        raise fail("base_config", f"no such file {raw['base_config']!r}")
    overrides = _mapping(raw.get("overrides", {}), "overrides", fail)
    scalars = {k: raw[k] for k in ("warmup_s", "duration_s", "timeout_s", "start_timeout_s") if k in raw}
    for key, value in scalars.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                key != "warmup_s" and value == 0):
            raise fail(key, f"must be a {'non-negative' if key == 'warmup_s' else 'positive'} number, got {value!r}")
    for key, kind in (("endpoint", str), ("ray_address", str), ("ignore_eos", bool), ("restart_per_cell", bool),
                      ("seed", int), ("output_dir", str), ("description", str)):
        if key in raw and not isinstance(raw[key], kind):
            raise fail(key, f"must be a {kind.__name__}, got {raw[key]!r}")
    processes = raw.get("client_processes", 1)
    if isinstance(processes, bool) or not isinstance(processes, int) or not 1 <= processes <= MAX_CLIENT_PROCESSES:
        raise fail("client_processes", f"must be an integer in [1, {MAX_CLIENT_PROCESSES}], got {processes!r}")
    if raw.get("endpoint", "completions") not in ("completions", "chat"):
        raise fail("endpoint", f"must be 'completions' or 'chat', got {raw['endpoint']!r}")
    slo_raw = _mapping(raw.get("slo", {}), "slo", fail)
    _no_unknown(slo_raw, {"ttft_ms", "tpot_ms"}, "slo.", fail)
    try:
        slo = SLO(**slo_raw)
    except ValueError as e:
        raise fail("slo", str(e)) from None
    extra_slos = []
    for i, item in enumerate(raw.get("extra_slos") or []):
        item = _mapping(item, f"extra_slos[{i}]", fail)
        _no_unknown(item, {"ttft_ms", "tpot_ms"}, f"extra_slos[{i}].", fail)
        try:
            extra_slos.append(SLO(**item))
        except (TypeError, ValueError) as e:
            raise fail(f"extra_slos[{i}]", str(e)) from None
    if not isinstance(raw.get("extra_slos") or [], list):
        raise fail("extra_slos", f"must be a list of {{ttft_ms, tpot_ms}}, got {raw['extra_slos']!r}")
    seed = raw.get("seed", 0)
    layouts = _layouts(raw["layouts"], fail)
    for i, lay in enumerate(layouts):
        _check_serving(base, {**overrides, **lay.serve_overrides()}, f"layouts[{i}]", fail)
    plain = {k: raw[k] for k in ("ray_address", "endpoint", "ignore_eos", "restart_per_cell", "seed", "description",
                                 "client_processes") if k in raw}
    return SweepConfig(
        path=path, base_config=base, output_dir=Path(raw.get("output_dir", f"sweeps/{path.stem}")), layouts=layouts,
        workloads=_workloads(raw["workloads"], seed, path, fail), loads=_loads(raw["loads"], seed, fail),
        overrides=tuple(overrides.items()), slo=slo, extra_slos=tuple(extra_slos), **plain, **scalars)


def _resolve(name: Any, sweep_path: Path) -> Path:
    """A path as given (relative to the working folder), else relative to the sweep file's folder."""
    p = Path(str(name))
    return p if p.is_absolute() or p.exists() else sweep_path.parent / p


def _no_unknown(raw: dict, known: set[str], prefix: str, fail) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise fail(prefix + str(unknown[0]), f"unknown key; known keys here: {sorted(known)}")


def _mapping(value: Any, key: str, fail) -> dict:
    if isinstance(value, dict):
        return value
    raise fail(key, f"must be a mapping, got {value!r}")


def _list(value: Any, key: str, fail) -> list:
    if isinstance(value, list) and value:
        return value
    raise fail(key, f"must be a non-empty list, got {value!r}")


def _count(raw: dict, key: str, where: str, fail) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fail(f"{where}.{key}", f"must be a positive integer (workers), got {value!r}")
    return value


def _layouts(value: Any, fail) -> tuple[Layout, ...]:
    out = []
    for i, raw in enumerate(_list(value, "layouts", fail)):
        where = f"layouts[{i}]"
        raw = _mapping(raw, where, fail)
        _no_unknown(raw, LAYOUT_KEYS, f"{where}.", fail)
        mode = raw.get("mode", "disaggregated")
        if mode in ("disaggregated", "adaptive"):
            if "workers" in raw:
                raise fail(f"{where}.workers", f"is for collocated layouts; give prefill and decode ({mode})")
            prefill, decode = _count(raw, "prefill", where, fail), _count(raw, "decode", where, fail)
            name = raw.get("name", f"{prefill}P+{decode}D" if mode == "disaggregated"
                           else f"adaptive from {prefill}P+{decode}D")
        elif mode == "collocated":
            if "prefill" in raw or "decode" in raw:
                raise fail(where, "a collocated layout has `workers`, not prefill/decode")
            prefill, decode = 0, _count(raw, "workers", where, fail)
            name = raw.get("name", f"collocated x{decode}")
        else:
            raise fail(f"{where}.mode", f"must be 'disaggregated', 'collocated' or 'adaptive', got {mode!r}")
        overrides = _mapping(raw.get("set", {}), f"{where}.set", fail)
        if not isinstance(name, str) or not name or "|" in name:
            raise fail(f"{where}.name", f"must be a non-empty string without '|', got {name!r}")
        out.append(Layout(name, mode, prefill, decode, tuple(overrides.items())))
    names = [lay.name for lay in out]
    if len(set(names)) != len(names):
        raise fail("layouts", f"names must be unique, got {names}")
    return tuple(out)


def _check_serving(base: Path, overrides: dict, where: str, fail) -> None:
    from coordinator.config.serve_config import load_serve_config  # the serving stack's own checks
    try:
        load_serve_config(base, overrides)
    except ConfigError as e:
        raise fail(where, f"its serving config is invalid: {e}") from None


def _workloads(value: Any, seed: int, path: Path, fail) -> tuple[WorkloadSpec, ...]:
    out = []
    for i, raw in enumerate(_list(value, "workloads", fail)):
        raw = dict(_mapping(raw, f"workloads[{i}]", fail))
        raw.setdefault("name", f"workload{i}")
        raw.setdefault("seed", seed)
        if raw.get("path"):
            raw["path"] = str(_resolve(raw["path"], path))
        try:
            out.append(WorkloadSpec.from_dict(raw))
            build_requests(out[-1], 1)  # a file workload's file is read and checked now, not mid-sweep
        except (TypeError, ValueError, OSError) as e:
            raise fail(f"workloads[{i}]", str(e)) from None
    names = [w.name for w in out]
    if len(set(names)) != len(names) or any("|" in n for n in names):
        raise fail("workloads", f"names must be unique and without '|', got {names}")
    return tuple(out)


def _loads(value: Any, seed: int, fail) -> tuple[ArrivalSpec, ...]:
    raw = _mapping(value, "loads", fail)
    _no_unknown(raw, LOAD_KEYS, "loads.", fail)
    if "rates" not in raw and "concurrencies" not in raw:
        raise fail("loads", "give `rates` (requests/s, open loop) and/or `concurrencies` (closed loop)")
    arrival, burst = raw.get("arrival", "poisson"), raw.get("burstiness", 1.0)
    if arrival not in ("poisson", "gamma"):
        raise fail("loads.arrival", f"must be 'poisson' or 'gamma', got {arrival!r}")
    out = []
    for j, rate in enumerate(_list(raw["rates"], "loads.rates", fail) if "rates" in raw else []):
        try:
            out.append(ArrivalSpec(kind=arrival, rate=rate, burstiness=burst, seed=seed))
        except ValueError as e:
            raise fail(f"loads.rates[{j}]", str(e)) from None
    for j, conc in enumerate(_list(raw["concurrencies"], "loads.concurrencies", fail) if "concurrencies" in raw
                             else []):
        try:
            out.append(ArrivalSpec(kind="concurrency", concurrency=conc, seed=seed))
        except ValueError as e:
            raise fail(f"loads.concurrencies[{j}]", str(e)) from None
    return tuple(out)
