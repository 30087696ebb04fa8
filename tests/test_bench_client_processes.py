"""A load sent from several client processes (benchclient.client_processes): the same requests as from one, the
client's CPU reported, and a failing or dying process an error that names it, never a hang. Real spawned processes
against tests/test_bench_client.py's scripted HTTP server."""

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchclient.arrivals import ArrivalSpec
from benchclient.client import Target
from benchclient.client_processes import CLIENT_BUSY, ClientUsage, Share, fan_out
from benchclient.run import RunConfig, measured_load
from benchclient.stats import SLO
from benchclient.workload import WorkloadSpec
from coordinator import cli
from tests.test_bench_client import ScriptedServer, scripted_url  # noqa: F401 (scripted_url: a fixture)

pytestmark = pytest.mark.timeout(120)
IDS = WorkloadSpec(kind="uniform", input_len=12, output_len=5, prompt_format="ids", seed=3)


def _sent(processes: int, **cfg) -> tuple[list[tuple], list, ClientUsage]:
    """(the bodies the server got, as sorted (prompt, max_tokens) pairs; the results; the client's usage)."""
    async def go():
        async with ScriptedServer(["fast"]) as server:
            config = RunConfig(target=Target(url=server.url, model="m"), workload=IDS,
                               slo=SLO(ttft_ms=10_000, tpot_ms=10_000), client_processes=processes,
                               **{"warmup_s": 0.0, **cfg})
            run = await measured_load(config)
            return sorted((tuple(b["prompt"]), b["max_tokens"]) for b in server.bodies), run
    bodies, run = asyncio.run(go())
    return bodies, run.results, run.client


@pytest.mark.parametrize("arrival", [ArrivalSpec(rate=200.0, seed=5), ArrivalSpec(kind="concurrency", concurrency=4)])
def test_three_processes_send_exactly_the_requests_one_process_sends(arrival):
    one, results_one, usage_one = _sent(1, arrival=arrival, num_requests=11)
    three, results_three, usage_three = _sent(3, arrival=arrival, num_requests=11)
    assert len(one) == 11 and three == one
    assert all(r.ok for r in results_three) and len(results_three) == 11
    assert [r.start for r in results_three] == sorted(r.start for r in results_three)  # one clock, merged in order
    assert len(usage_one.cpu_s_per_s) == 1 and len(usage_three.cpu_s_per_s) == 3
    assert all(0 < x < 4 for x in usage_one.cpu_s_per_s + usage_three.cpu_s_per_s)


def test_an_open_loop_split_over_processes_keeps_its_warm_up_by_schedule():
    """Rate 40/s for 0.25 s of warm-up then 0.5 s: each request's warm-up mark is the schedule's, whichever process
    sent it, so two processes mark as many as one."""
    marks = {}
    for n in (1, 2):
        _, results, _ = _sent(n, arrival=ArrivalSpec(rate=40.0, seed=1), duration_s=0.5, warmup_s=0.25)
        marks[n] = sorted(r.warmup for r in results)
    assert marks[1] == marks[2] and True in marks[1] and False in marks[1]


def test_more_processes_than_a_closed_loops_lanes_is_refused():
    with pytest.raises(ValueError, match="client_processes \\(3\\) must not exceed the concurrency \\(2\\)"):
        RunConfig(target=Target(url="http://x", model="m"), arrival=ArrivalSpec(kind="concurrency", concurrency=2),
                  client_processes=3)
    with pytest.raises(ValueError, match="client_processes must be an integer"):
        RunConfig(target=Target(url="http://x", model="m"), client_processes=0)


def test_shares_deal_every_item_to_exactly_one_process():
    for count in (1, 2, 3, 5):
        shares = [Share(i, count) for i in range(count)]
        assert all(sum(s.mine(i) for s in shares) == 1 for i in range(40))
        assert all(sum(s.of(total) for s in shares) == total for total in range(12))
    with pytest.raises(ValueError):
        Share(2, 2)


def test_a_busy_client_is_reported_and_an_idle_one_is_not():
    assert ClientUsage((0.2, CLIENT_BUSY)).saturated and "--client-processes 4" in ClientUsage((0.2, 0.9)).warning()
    assert not ClientUsage((0.5,)).saturated and ClientUsage((0.5,)).warning() is None
    assert ClientUsage((0.5, 0.91)).record() == {"processes": 2, "cpu_s_per_s": [0.5, 0.91],
                                                 "busiest_cpu_s_per_s": 0.91, "saturated": True}


async def _raises(share: Share, t0: float, counts, word: str) -> None:
    if share.index == 1:
        raise KeyError(word)


async def _exits(share: Share, t0: float, counts) -> None:
    if share.index == 0:
        os._exit(3)


async def _counts(share: Share, t0: float, counts, n: int) -> int:
    counts[3 * share.index:3 * share.index + 3] = [n, n - 1, share.index]
    return share.index * 10


def test_a_process_that_raises_or_dies_is_an_error_naming_it():
    with pytest.raises(RuntimeError, match="client process 1 failed:(.|\\n)*KeyError: 'gone'"):
        fan_out(_raises, ("gone",), 2, timeout_s=60)
    with pytest.raises(RuntimeError, match="client process 0 exited with code 3"):
        fan_out(_exits, (), 2, timeout_s=60)


def test_fan_out_returns_each_share_in_order_and_passes_its_counts_on():
    seen = []
    got = fan_out(_counts, (4,), 3, timeout_s=60, progress=seen.append)
    assert [value for value, _ in got] == [0, 10, 20] and all(cpu >= 0 for _, cpu in got)
    assert seen and seen[-1] == [4, 3, 0, 4, 3, 1, 4, 3, 2]


def test_pdserve_bench_with_client_processes_saves_the_clients_cpu(scripted_url, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "r.json"
    rc = cli.main(["bench", "--url", scripted_url, "--model", "m", "--concurrency", "2", "--num-requests", "6",
                   "--warmup", "0", "--prompt-format", "ids", "--client-processes", "2", "--out", str(out)])
    assert rc == 0 and "client: 2 process(es)" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["summary"]["completed"] == 6 and doc["settings"]["client_processes"] == 2
    assert doc["client"]["processes"] == 2 and len(doc["client"]["cpu_s_per_s"]) == 2


async def _sleeps(share: Share, t0: float, counts, folder: str) -> None:
    (Path(folder) / f"{os.getpid()}.pid").write_text("")
    await asyncio.sleep(120)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has stopped: only its exit status is left


def test_client_processes_stop_when_their_parent_is_killed(tmp_path):
    """A parent killed with SIGKILL cleans nothing up: its client processes must notice and stop, not go on loading
    a server. The poll below only bounds the wait for that to happen."""
    code = ("from benchclient.client_processes import fan_out; from tests.test_bench_client_processes import _sleeps; "
            f"fan_out(_sleeps, ({str(tmp_path)!r},), 2, 300)")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline and parent.poll() is None:
        time.sleep(0.1)
    pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and all(_running(pid) for pid in pids)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids)
