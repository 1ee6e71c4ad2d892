"""What lorarl adds to a verifiers v1 episode: the same episodes played by verifiers' own loop (`Env.run_episode`,
concurrently, against a token-in/token-out route that answers at once) and by lorarl (`env=verifiers`: its episode
runner, its route, its batching and its check of each branch), the engine's answer the same fixed reply on both sides
(no model: what is left is each side's own machinery, verifiers' harness program included).

Both sides play `plugins/v1_say.py` (one task a number, "<i>*7", scored by whether the reply holds 7). Run in
verifiers v1's environment (`scripts/vllm_cpu_env.sh --verifiers-v1`); the sides interleaved, `--repeats` times:

    .venv-verifiers-v1/bin/python benchmarks/verifiers_v1_overhead.py [--episodes 16] [--repeats 3]
        # then: scripts/results.py record verifiers_v1_overhead
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
TASKSET = "v1_say"  # benchmarks/plugins/v1_say.py


def reply_ids(tokenizer) -> list[int]:
    from v1_say import REPLY

    return [*tokenizer.encode(REPLY, add_special_tokens=False), tokenizer.eos_token_id]


async def verifiers_side(environment, tokenizer, episodes: int) -> float:
    """Seconds for `episodes` of verifiers' own loop, against a route answering the fixed reply at once."""
    import verifiers.v1 as vf
    from aiohttp import web

    ids = reply_ids(tokenizer)

    async def generate(request: web.Request) -> web.Response:
        await request.json()
        logprobs = {"content": [{"token": f"token_id:{t}", "logprob": -0.5} for t in ids]}
        choice = {"index": 0, "token_ids": ids, "finish_reason": "stop", "logprobs": logprobs}
        return web.json_response({"request_id": "r", "choices": [choice]})

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
    client = vf.TrainClientConfig(base_url=url, api_key_var="LORARL_VERIFIERS_KEY", renderer={"name": "default"},
                                  renderer_model_name=tokenizer.name_or_path)  # fmt: skip
    ctx = vf.ModelContext(model="m", client=client, sampling=vf.SamplingConfig(temperature=1.0, max_tokens=16))
    tasks = list(environment.taskset.take(episodes))
    try:
        async with environment.serving():
            start = time.perf_counter()
            played = await asyncio.gather(*(environment.run_episode(task, ctx) for task in tasks))
            elapsed = time.perf_counter() - start
    finally:
        await runner.cleanup()
    assert all(e.ok and e.traces[0].reward == 1.0 for e in played), [e.errors for e in played]
    return elapsed


def lorarl_side(runner, tokenizer, examples: list) -> float:
    """Seconds for the same episodes played by lorarl's episode runner, the engine's answer the fixed reply."""
    from lorarl.trainer.engines import Completion, SamplingParams

    ids = tuple(reply_ids(tokenizer))

    def engine(prompts, sampling) -> list:
        return [Completion(i, ids, (-0.5,) * len(ids), True, 0) for i in range(len(prompts))]

    episodes = runner.episodes(examples, 1)
    start = time.perf_counter()
    runner.play(engine, episodes, SamplingParams(max_tokens=16))
    elapsed = time.perf_counter() - start
    assert all(sum(e.rewards) == 1.0 for e in episodes), [e.stop_reason for e in episodes]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=16, help="episodes played at once, per side and run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, interleaved")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent / "plugins"))  # the taskset both sides play
    from v1_say import REPLY

    from lorarl.trainer import default_task
    from lorarl.trainer.config import load_config
    from lorarl.trainer.data import Example
    from lorarl.trainer.envs.episodes import EpisodeRunner
    from lorarl.trainer.envs.verifiers_v1 import load
    from lorarl.trainer.models import load_tokenizer

    tokenizer = load_tokenizer(default_task.EMBEDDED["calculator"])
    config = load_config(None, ["env=verifiers", f"env.verifiers.id={TASKSET}"])
    runner = EpisodeRunner(config.env, tokenizer, eos=tokenizer.eos_token_id)
    examples = [Example(f"{i}*7", REPLY, (), {"idx": i}, f"task {i}") for i in range(args.episodes)]
    settings = json.dumps({"id": TASKSET, "args": {}, "config": {}}, sort_keys=True)
    environment = load.__wrapped__(settings)  # as lorarl loads it (a subprocess seat, the null harness): its own copy
    lorarl_side(runner, tokenizer, examples[:2])  # warm-up: each side's harness program prepared once
    asyncio.run(verifiers_side(environment, tokenizer, 2))
    runs: dict[str, list[float]] = {"verifiers": [], "lorarl": []}
    for _ in range(args.repeats):
        runs["verifiers"].append(asyncio.run(verifiers_side(environment, tokenizer, args.episodes)))
        runs["lorarl"].append(lorarl_side(runner, tokenizer, examples))
    own, ours = (statistics.median(runs[side]) / args.episodes for side in ("verifiers", "lorarl"))
    print(json.dumps({"episodes": args.episodes, "runs": args.repeats, "harness": "null", "runtime": "subprocess",
                      "verifiers_s_per_episode": own, "lorarl_s_per_episode": ours,
                      "added_s_per_episode": ours - own, "ratio": ours / own,
                      "verifiers_runs_s": runs["verifiers"], "lorarl_runs_s": runs["lorarl"]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
