"""A load that changes during the run, served in mode adaptive: does the layout follow it?

`python benchmarks/adaptive_shift.py CONFIG --set k=v ... --phase NAME:RATE:INPUT:OUTPUT:SECONDS ... --out DIR`
launches `pdserve serve` (CONFIG with the `--set` overrides; mode adaptive, or a static layout to compare), then
sends the phases one after the other without a gap (Poisson arrivals, the chat workload around INPUT prompt and
OUTPUT output tokens, token-id prompts, ignore_eos), while it records every 0.5 s each worker's role (/health) and
the prefill placements so far (/metrics). It prints, per time bin, the goodput under the config's SLO (requests sent
in the bin that met both targets, per second) next to the offered rate, the TTFT and TPOT p90 and the roles, and
writes `shift.json` (every request, the role timeline) and `shift.png` (goodput and offered rate over time, role
changes marked). The reference in the same run is the offered rate: goodput cannot exceed it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchclient.arrivals import ArrivalSpec  # noqa: E402
from benchclient.client import Target, first_model  # noqa: E402
from benchclient.launcher import launched_server, serving_config  # noqa: E402
from benchclient.run import RunConfig, json_safe, result_record, run_load  # noqa: E402
from benchclient.stats import SLO  # noqa: E402
from benchclient.workload import WorkloadSpec  # noqa: E402

BIN_S = 3.0


def _phase(text: str) -> dict:
    name, rate, inp, out, seconds = text.split(":")
    return {"name": name, "rate": float(rate), "input_len": int(inp), "output_len": int(out),
            "seconds": float(seconds)}


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


async def _watch(url: str, stop: asyncio.Event, t0: float, timeline: list) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            try:
                health = (await client.get(f"{url}/health")).json()
                metrics = (await client.get(f"{url}/metrics")).text
            except (httpx.HTTPError, ValueError):
                await asyncio.sleep(0.5)
                continue
            placed = {}
            for line in metrics.splitlines():
                if line.startswith("pdserve_prefill_placement_total{"):
                    placed[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
            timeline.append({"t": time.perf_counter() - t0, "placements": placed,
                             "roles": {w["name"]: w["role"] for w in health.get("workers", [])}})
            await asyncio.sleep(0.5)


async def _run(url: str, model: str, phases: list[dict], warmup_s: float, t0: float) -> list:
    target = Target(url=url, model=model, ignore_eos=True, phases=False)

    async def phase(i: int, p: dict, start_at: float):
        first = i == 0
        await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
        work = WorkloadSpec(kind="chat", input_len=p["input_len"], output_len=p["output_len"], sigma=0.6,
                            max_input_len=7 * p["input_len"] // 2, max_output_len=4 * p["output_len"],
                            prompt_format="ids", seed=i)
        cfg = RunConfig(target=target, workload=work, arrival=ArrivalSpec(rate=p["rate"], seed=7 + i),
                        duration_s=p["seconds"] - (warmup_s if first else 0), warmup_s=warmup_s if first else 0,
                        timeout_s=120)
        return p["name"], await run_load(cfg)
    starts = [sum(q["seconds"] for q in phases[:i]) for i in range(len(phases))]
    return await asyncio.gather(*[phase(i, p, s) for i, (p, s) in enumerate(zip(phases, starts, strict=True))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[], help="serving override key=value (YAML value)")
    ap.add_argument("--phase", action="append", required=True, type=_phase, help="NAME:RATE:INPUT:OUTPUT:SECONDS")
    ap.add_argument("--slo-ttft-ms", type=float, default=500)
    ap.add_argument("--slo-tpot-ms", type=float, default=40)
    ap.add_argument("--warmup-s", type=float, default=3)
    ap.add_argument("--out", type=Path, default=Path("shift"))
    args = ap.parse_args()
    overrides = {k: _value(v) for k, v in (s.split("=", 1) for s in args.set)}
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    args.out.mkdir(parents=True, exist_ok=True)
    serve = serving_config(Path(args.config), overrides, None, None)
    with launched_server(serve, args.out / "server", 300) as server:
        model = first_model(server.url)
        timeline: list = []

        async def both():
            t0 = time.perf_counter() + 0.5
            stop = asyncio.Event()
            watcher = asyncio.create_task(_watch(server.url, stop, t0, timeline))
            try:
                return t0, await _run(server.url, model, args.phase, args.warmup_s, t0)
            finally:
                stop.set()
                await watcher
        t0, runs = asyncio.run(both())
    requests = [{**result_record(r, t0), "phase": name, "met": bool(r.ok and slo.met_by(r))}
                for name, results in runs for r in results]
    total_s = sum(p["seconds"] for p in args.phase)
    rows = _bins(requests, timeline, args.phase, total_s, args.warmup_s)
    for row in rows:
        print(json.dumps(row))
    doc = {"phases": args.phase, "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}, "overrides": overrides,
           "bins": rows, "timeline": timeline, "requests": requests}
    (args.out / "shift.json").write_text(json.dumps(json_safe(doc), indent=1) + "\n")
    _plot(rows, timeline, args.out / "shift.png", slo)


def _bins(requests: list, timeline: list, phases: list, total_s: float, warmup_s: float) -> list[dict]:
    rows, t = [], warmup_s
    while t < total_s - 1e-9:
        end = min(t + BIN_S, total_s)
        sent = [r for r in requests if t <= r["start_s"] < end and not r["warmup"]]
        offered = _phase_at(phases, t)["rate"]
        ttfts = sorted(r["ttft_s"] for r in sent if r["ok"] and r["ttft_s"] is not None)
        tpots = sorted(r["tpot_s"] for r in sent if r["ok"] and r["tpot_s"] is not None)
        roles = next((s["roles"] for s in reversed(timeline) if s["t"] <= end), {})
        rows.append({"from_s": round(t, 1), "to_s": round(end, 1), "phase": _phase_at(phases, t)["name"],
                     "offered_rps": offered, "goodput_rps": round(sum(r["met"] for r in sent) / (end - t), 2),
                     "failed": sum(not r["ok"] for r in sent), "ttft_p90_ms": _p90(ttfts),
                     "tpot_p90_ms": _p90(tpots), "roles": ",".join(f"{k}={v}" for k, v in sorted(roles.items()))})
        t = end
    return rows


def _phase_at(phases: list, t: float) -> dict:
    start = 0.0
    for p in phases:
        if t < start + p["seconds"]:
            return p
        start += p["seconds"]
    return phases[-1]


def _p90(values: list) -> float | None:
    return round(values[min(len(values) - 1, int(0.9 * len(values)))] * 1000, 1) if values else None


def _plot(rows: list, timeline: list, path: Path, slo: SLO) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    mids = [(r["from_s"] + r["to_s"]) / 2 for r in rows]
    ax.plot(mids, [r["goodput_rps"] for r in rows], marker="o", label="goodput (req/s meeting both SLOs)")
    ax.step([r["from_s"] for r in rows], [r["offered_rps"] for r in rows], where="post", linestyle="--",
            color="grey", label="offered rate")
    last = None
    for s in timeline:
        roles = ",".join(f"{k}={v}" for k, v in sorted(s["roles"].items()))
        if last is not None and roles != last:
            ax.axvline(s["t"], color="tab:red", linewidth=0.8)
            ax.annotate(roles, (s["t"], ax.get_ylim()[1] * 0.95), rotation=90, fontsize=6, va="top")
        last = roles
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("requests/s")
    ax.set_title(f"Load that changes, mode adaptive (SLO TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms);"
                 "\nred lines: role changes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
