"""`masgraph watch` under load: open a 100k-episode run dir, follow a live run at 50 episodes/s, and the cost of
watching to the run watched.

    .venv/bin/python benchmarks/watch.py all [--episodes 100000] [--rate 50] [--seconds 20]

open    A run dir of N episodes written by the real RunStore (4 LLM steps an episode, AgentFlow's shape: 300 prompt
        and 20 completion token ids a call, so events.jsonl is about N × 7 KB), opened by the app headless in a
        fresh process; time from process start (imports included) until the table holds every row and the first
        frame is drawn, and the process's peak RSS. Peer in the same run: the same process reading the run with
        masgraph's own trace reader (read_traces, every line parsed), what a watcher without the index would do.
        Targets: < 2 s, < 300 MB.
follow  A writer process emits episodes at --rate through the RunStore (each episode's lines when it ends); the app
        follows in another process at its default poll (0.25 s). Latency per episode: the time its row is in the
        table (after the refresh that added it) minus the time its index line was written. Target: p99 < 1 s.
run     The AgentFlow-shaped graph on the scripted backend through Runner (the `masgraph run` path), unwatched vs
        watched by `masgraph watch`'s app in a second process vs watched in-process as `--watch` runs it (the run
        on a worker thread, the app on the main one). Target: watched ≥ 0.95x unwatched episodes/s.

Appends to benchmarks/results/watch.md with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_file import results_file

HERE = Path(__file__).resolve().parent
NODES = ("planner", "executor", "verifier", "generator")


# -- writing runs -------------------------------------------------------------------------------------------

def episode_events(i: int, now: float):
    """The events of one AgentFlow-shaped episode, as the scheduler would send them."""
    from masgraph.events import EpisodeFinished, EpisodeStarted, StepFinished, StepStarted
    from masgraph.trace import LLMCall, Step, Trace

    eid = f"{i:06d}-basic_arithmetic-test-{i}-0"
    events: list = [EpisodeStarted(episode_id=eid, item_id=f"item-{i}", query=f"Calculate {i} * 7 + 3.",
                                   started=now)]
    steps = []
    for k, node in enumerate(NODES):
        events.append(StepStarted(episode_id=eid, node=node, turn=1, started=now))
        call = LLMCall(policy=node, prompt_ids=list(range(1000, 1300)), completion_ids=list(range(20)),
                       logprobs=[-0.1] * 20, text="Sub-goal: x\nTool: calculator", temperature=0.0, top_p=1.0,
                       latency_s=0.5)
        step = Step(episode_id=eid, index=k, node=node, role=node if node != "planner" else "planner", turn=1,
                    route="stop" if node == "verifier" else None, sources=[NODES[k - 1]] if k else [],
                    text=call.text, llm=[call], started=now, duration_s=0.5)
        steps.append(step)
        events.append(StepFinished(step=step))
    events.append(EpisodeFinished(trace=Trace(episode_id=eid, item_id=f"item-{i}", query=f"Calculate {i} * 7 + 3.",
                                              steps=steps, answer=str(i * 7 + 3), reward=float(i % 3 == 0),
                                              duration_s=2.0)))
    return events


def spec_yaml() -> str:
    return (HERE.parent / "graphs" / "agentflow.yaml").read_text()


def write_run(path: Path, episodes: int) -> Path:
    """A finished run dir of `episodes` episodes (reused when it already holds them)."""
    import yaml

    from masgraph.rundir.store import RunStore
    from masgraph.spec import GraphSpec

    if (path / "summary.json").exists() and json.loads((path / "summary.json").read_text()).get("episodes") == episodes:
        return path
    spec = GraphSpec.model_validate(yaml.safe_load(spec_yaml()))
    store = RunStore(path, spec, {"benchmark": "watch"})
    now = time.time()
    for i in range(episodes):
        for event in episode_events(i, now):
            store.emit(event)
        if i % 10000 == 0:
            print(f"  writing {i:,}/{episodes:,}", file=sys.stderr, flush=True)
    store.close({"episodes": episodes})
    return path


# -- open ---------------------------------------------------------------------------------------------------

OPEN_APP = r'''
import time; t0 = time.perf_counter()
import asyncio, json, resource, sys
from masgraph.watch.app import WatchApp
async def main():
    app = WatchApp(sys.argv[1])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2"); await pilot.pause()
        from masgraph.watch.app import EpisodeTable
        rows = len(app.query_one(EpisodeTable).rows)
        dt = time.perf_counter() - t0
    print(json.dumps({"s": dt, "rows": rows, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
asyncio.run(main())
'''

OPEN_PEER = r'''
import time; t0 = time.perf_counter()
import json, resource, sys
from masgraph.rundir.store import read_traces
n = sum(1 for _ in read_traces(sys.argv[1]))
print(json.dumps({"s": time.perf_counter() - t0, "rows": n,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def child(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_open(episodes: int, root: Path) -> dict:
    run = write_run(root / f"open-{episodes}", episodes)
    size = (run / "events.jsonl").stat().st_size
    app = [child(OPEN_APP, str(run)) for _ in range(3)]
    peer = child(OPEN_PEER, str(run))
    assert all(a["rows"] == episodes for a in app) and peer["rows"] == episodes
    res = {"episodes": episodes, "events_mb": size / 2**20, "index_mb": (run / "episodes.jsonl").stat().st_size / 2**20,
           "app_s": [round(a["s"], 2) for a in app], "app_rss_mb": max(a["rss_mb"] for a in app),
           "peer_s": round(peer["s"], 2), "peer_rss_mb": peer["rss_mb"]}
    print(f"open: {episodes:,} episodes, events.jsonl {res['events_mb']:.0f} MB; app {res['app_s']} s, peak RSS "
          f"{res['app_rss_mb']:.0f} MB; read_traces {res['peer_s']} s ({res['peer_s'] / min(res['app_s']):.1f}x the "
          f"app), {res['peer_rss_mb']:.0f} MB")
    return res


# -- follow -------------------------------------------------------------------------------------------------

WRITER = r'''
import asyncio, sys, time
sys.path.insert(0, sys.argv[4])
from watch import episode_events
from masgraph.rundir.store import RunStore
async def main(path, rate, seconds):
    store = RunStore(path, None, {"benchmark": "watch-follow"})
    (__import__("pathlib").Path(path) / "spec.yaml").write_text(open(sys.argv[5]).read())
    t0 = time.perf_counter(); n = 0
    while (dt := time.perf_counter() - t0) < seconds:
        due = int(dt * rate)
        while n < due:
            for e in episode_events(n, time.time()):
                store.emit(e)
            n += 1
        await asyncio.sleep(0.005)
    store.close({"episodes": n})
    print(n)
asyncio.run(main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3])))
'''

FOLLOWER = r'''
import asyncio, json, sys, time
from pathlib import Path
from masgraph.watch.app import WatchApp
lat = []
class Timed(WatchApp):
    def refresh_views(self, full=False):
        before = self._shown
        super().refresh_views(full)
        now = time.time()
        lat.extend(now - r.ended for r in self.index.rows[before:])
async def main(path):
    while not (Path(path) / "config.json").exists():
        await asyncio.sleep(0.01)
    app = Timed(path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2")
        while not app.index.ended:
            await asyncio.sleep(0.1)
        await pilot.pause()
    print(json.dumps({"n": len(lat), "lat": lat}))
asyncio.run(main(sys.argv[1]))
'''


def bench_follow(rate: float, seconds: float, root: Path) -> dict:
    path = root / f"follow-{time.time_ns()}"
    follower = subprocess.Popen([sys.executable, "-c", FOLLOWER, str(path)], stdout=subprocess.PIPE, text=True)
    time.sleep(1.5)  # the follower imports Textual first
    spec = str(HERE.parent / "graphs" / "agentflow.yaml")
    writer = subprocess.run([sys.executable, "-c", WRITER, str(path), str(rate), str(seconds), str(HERE), spec],
                            capture_output=True, text=True, check=True)
    out, _ = follower.communicate(timeout=120)
    got = json.loads(out.strip().splitlines()[-1])
    written = int(writer.stdout.strip())
    lat = sorted(got["lat"])
    res = {"rate": rate, "seconds": seconds, "written": written, "seen": got["n"],
           "p50_s": round(statistics.median(lat), 3), "p99_s": round(lat[int(0.99 * (len(lat) - 1))], 3),
           "max_s": round(lat[-1], 3)}
    print(f"follow: {written} episodes at {rate}/s; seen {got['n']}; event->screen p50 {res['p50_s']} s, "
          f"p99 {res['p99_s']} s, max {res['max_s']} s")
    return res


# -- the watched run's throughput ---------------------------------------------------------------------------

RUN = r'''
import asyncio, json, sys, tempfile, threading, time
from pathlib import Path
from masgraph.agents.registry import register_agent
from masgraph.backends.scripted import ScriptedBackend
from masgraph.graph import GraphBuilder
from masgraph.node import NodeOutput
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.rundir.store import new_run_dir
from masgraph.tasks import Item, Task

@register_agent("llm_step")
async def llm_step(ctx):
    c = await ctx.generate([{"role": "user", "content": "x" * 300 + ctx.query}])
    return NodeOutput(text=c.text, route="stop")

class Nothing(Task):
    name = "nothing"
    def generate(self, split, n, seed):
        return [Item(f"q{i}", f"q{i}", "") for i in range(n)]
    def score(self, item, answer):
        return 0.0

mode, n, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3]
b = GraphBuilder("agentflow_shape").add_policy("p", backend="scripted")
for i, node in enumerate(["planner", "executor", "verifier", "generator"]):
    b.add_node(node, role="custom", agent="llm_step", policy="p")
    if i:
        b.add_edge(["planner", "executor", "verifier", "generator"][i - 1], node)
runner = Runner(b.compile(), RunConfig(n=n, split="train", concurrency=32, runs_dir=runs),
                backends={"scripted": ScriptedBackend(default="Sub-goal: x\nTool: calculator", delay_s=0.002)})
task = Nothing(); items = task.items("train", n)
run_dir = new_run_dir(runs, "watched")
times = {}
async def go():
    t0 = time.perf_counter()
    await runner.run_items(task, items, run_dir=run_dir)
    times["s"] = time.perf_counter() - t0
if mode == "inprocess":
    from masgraph.watch import _Background
    from masgraph.watch.app import WatchApp
    job = _Background(go); job.thread.start()
    while not (run_dir / "config.json").exists():
        time.sleep(0.01)
    async def watch():
        app = WatchApp(run_dir, poll_s=float(__import__("os").environ.get("WATCH_POLL", "0.25")))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("1")
            while not job.done.is_set():
                await asyncio.sleep(0.1)
    asyncio.run(watch())
    assert job.error is None, job.error
else:
    if mode == "process":
        print(run_dir, flush=True)
    asyncio.run(go())
print(json.dumps({"eps": n / times["s"]}))
'''


def bench_run(episodes: int, root: Path, repeats: int) -> dict:
    out: dict[str, list[float]] = {"unwatched": [], "process": [], "inprocess": []}
    for _ in range(repeats):
        for mode in out:
            runs = root / f"runs-{mode}-{time.time_ns()}"
            if mode == "process":
                proc = subprocess.Popen([sys.executable, "-c", RUN, mode, str(episodes), str(runs)],
                                        stdout=subprocess.PIPE, text=True)
                run_dir = proc.stdout.readline().strip()  # type: ignore[union-attr]
                watcher = subprocess.Popen([sys.executable, "-c", FOLLOWER, run_dir], stdout=subprocess.DEVNULL)
                rest = proc.communicate(timeout=600)[0]
                watcher.wait(timeout=120)
                out[mode].append(json.loads(rest.strip().splitlines()[-1])["eps"])
            else:
                r = subprocess.run([sys.executable, "-c", RUN, mode, str(episodes), str(runs)], capture_output=True,
                                   text=True, check=True)
                out[mode].append(json.loads(r.stdout.strip().splitlines()[-1])["eps"])
    med = {k: statistics.median(v) for k, v in out.items()}
    res = {"episodes": episodes, "eps": {k: [round(x, 1) for x in v] for k, v in out.items()},
           "ratio_process": round(med["process"] / med["unwatched"], 3),
           "ratio_inprocess": round(med["inprocess"] / med["unwatched"], 3)}
    print(f"run: {episodes} episodes x {repeats}; eps/s unwatched {res['eps']['unwatched']}, watched by a second "
          f"process {res['eps']['process']} ({res['ratio_process']}x), watched in-process {res['eps']['inprocess']} "
          f"({res['ratio_inprocess']}x)")
    return res


def record(results: dict, argv: list[str]) -> None:
    lines = [f"\n## watch ({time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, {os.cpu_count()} cores)\n",
             f"Command: `python benchmarks/watch.py {' '.join(argv)}`\n"]
    if "open" in results:
        o = results["open"]
        lines.append(f"- open {o['episodes']:,} episodes (events.jsonl {o['events_mb']:.0f} MB, episodes.jsonl "
                     f"{o['index_mb']:.0f} MB): app {o['app_s']} s (3 fresh processes), peak RSS "
                     f"{o['app_rss_mb']:.0f} MB; target < 2 s and < 300 MB. Peer, same run: read_traces "
                     f"{o['peer_s']} s ({o['peer_s'] / min(o['app_s']):.1f}x), {o['peer_rss_mb']:.0f} MB.\n")
    if "follow" in results:
        f = results["follow"]
        lines.append(f"- follow at {f['rate']:.0f} episodes/s for {f['seconds']:.0f} s ({f['written']} written, "
                     f"{f['seen']} seen): event to screen p50 {f['p50_s']} s, p99 {f['p99_s']} s, max {f['max_s']} s;"
                     " target < 1 s.\n")
    if "run" in results:
        r = results["run"]
        lines.append(f"- watched run, {r['episodes']} episodes a run: episodes/s unwatched {r['eps']['unwatched']}, "
                     f"watched by a second process {r['eps']['process']} ({r['ratio_process']}x of the medians), "
                     f"watched in-process as --watch {r['eps']['inprocess']} ({r['ratio_inprocess']}x); target "
                     "≥ 0.95x.\n")
    with open(results_file("watch"), "a") as f:
        f.writelines(lines)
    print("".join(lines))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["open", "follow", "run", "all"])
    p.add_argument("--episodes", type=int, default=100_000)
    p.add_argument("--rate", type=float, default=50.0)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--run-episodes", type=int, default=10000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where run dirs go (default a temp dir; the 100k run is ~700 MB)")
    p.add_argument("--no-record", action="store_true", help="print only (a smoke run)")
    args = p.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="masgraph-watch-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    results = {}
    if args.what in ("open", "all"):
        results["open"] = bench_open(args.episodes, root)
    if args.what in ("follow", "all"):
        results["follow"] = bench_follow(args.rate, args.seconds, root)
    if args.what in ("run", "all"):
        results["run"] = bench_run(args.run_episodes, root, args.repeats)
    if not args.no_record:
        record(results, sys.argv[1:])


if __name__ == "__main__":
    main()
