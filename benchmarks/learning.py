"""Does asynchronous training learn as well as on-policy training, and what does tandem cost?

Runs the tiny pipeline (configs/tiny.yaml, each run a fresh process) at max_lag 0, 2 and 4, with
the importance correction on and off, all at the same number of samples, and one bare reference:
the same model, warm-start, environment, samples and loss in a single plain process loop, with
the engine in-process and no Prefect, HTTP or storage. It prints a table of final batch reward,
held-out eval score and wall time, writes JSON with --out, and ends with

    overhead_vs_bare: W        training-phase wall time of the embedded default (lag 2, corrected)
                               / the bare loop's
    lag4_corrected_vs_onpolicy: X   eval score at lag 4 with correction / eval score at lag 0

Usage: python benchmarks/learning.py [--steps N] [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs import TINY_CONFIG, load_config  # noqa: E402
from flows.cli import run_command  # noqa: E402
from infra.engines.cpu import CpuEngine  # noqa: E402
from infra.engines.scheduler import GenerationJob  # noqa: E402
from infra.scratch import scratch_dir  # noqa: E402
from infra.modelfactory import load_model, load_tokenizer, prepare_initial_model  # noqa: E402
from tasks.envs import environment_factory  # noqa: E402
from tasks.loss import group_advantages  # noqa: E402
from tasks.rollout import run_episode, run_group  # noqa: E402
from tasks.trainer import Trainer, build_batch  # noqa: E402
from tasks.warmup import warm_start  # noqa: E402

console = Console(stderr=True)


class InProcessClient:
    """The EngineClient.generate interface over a CpuEngine in this process: no HTTP."""

    def __init__(self, engine: CpuEngine):
        self.engine = engine

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None):
        job = GenerationJob(rid=rid or "bare", input_ids=list(input_ids), params=sampling_params)
        await asyncio.wrap_future(self.engine.submit(job))
        return [
            {"output_ids": s.output_ids, "meta_info": {
                "finish_reason": s.finish_reason, "weight_version": job.weight_version,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(s.logprobs, s.output_ids)]}}
            for s in job.samples
        ]  # fmt: skip


def bare_loop(overrides: list[str], work: Path) -> dict:
    """The reference: warm-start, then sample -> advantages -> one step, in one plain loop."""
    from infra.engines.api import SamplingParams

    config = load_config(TINY_CONFIG, overrides)
    path = prepare_initial_model(config.model, work / "initial", config.seed)
    model, tokenizer = load_model(path), load_tokenizer(path)
    warm_start(model, tokenizer, config)
    model.save_pretrained(work / "v0")
    tokenizer.save_pretrained(work / "v0")
    engine = CpuEngine(work / "v0", max_batch_size=config.engine.max_batch_size, weight_version="0")
    client = InProcessClient(engine)
    make_env = environment_factory(config.env.entrypoint, config.env.max_turns, config.env.kwargs)
    train_prompts = make_env().prompts("train", config.env.train_prompts, config.seed)
    eval_prompts = make_env().prompts("eval", config.env.eval_prompts, config.seed)
    gen = config.generation
    sampling = SamplingParams(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k, max_new_tokens=gen.max_new_tokens)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=gen.max_new_tokens)
    episode = {"max_turns": config.env.max_turns, "context_length": config.model.max_position_embeddings, "producer": "bare"}

    async def score() -> tuple[float, float]:
        """Mean greedy reward and the share of exact answers, as tasks/evaluation.py scores."""
        runs = [run_episode(client, make_env(), p, tokenizer, greedy, loaded_version=0, group_id="eval", **episode) for p in eval_prompts]
        rewards = [e.reward for e in await asyncio.gather(*runs)]
        return sum(rewards) / len(rewards), sum(r >= 1.0 for r in rewards) / len(rewards)

    trainer, rewards = Trainer(load_model(work / "v0"), config.training, sampling_temperature=gen.temperature), []
    before, _ = asyncio.run(score())
    started = time.monotonic()
    for slot in range(config.training.steps):
        prompts = [train_prompts[(slot * config.training.prompts_per_step + i) % len(train_prompts)] for i in range(config.training.prompts_per_step)]

        async def sample() -> list:
            groups = [run_group(client, make_env, p, gen.samples_per_prompt, tokenizer, sampling, loaded_version=trainer.version,
                                group_id=f"s{i}", **episode) for i, p in enumerate(prompts)]  # fmt: skip
            return [row for group in await asyncio.gather(*groups) for row in group]

        rows = asyncio.run(sample())
        batch_rewards = torch.tensor([r.reward for r in rows])
        trainer.rl_step(build_batch(rows, group_advantages(batch_rewards, [r.group_id for r in rows])))
        engine.model.load_state_dict(trainer.model.state_dict())
        rewards.append(float(batch_rewards.mean()))
    seconds = time.monotonic() - started
    after, solved = asyncio.run(score())
    engine.shutdown()
    tail = rewards[-max(1, len(rewards) // 10):]
    return {"name": "bare loop", "eval_before": before, "eval_after": after, "solved_after": solved,
            "reward_end": sum(tail) / len(tail), "train_seconds": seconds}  # fmt: skip


def pipeline_run(name: str, overrides: list[str], root: Path) -> dict:
    """One tiny pipeline in a fresh process; its numbers read back from summary.json and metrics."""
    run_id = name.replace(" ", "-").replace(",", "")
    command = run_command(TINY_CONFIG, [f"run_id={run_id}", f"storage.root=file://{root}", *overrides])
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads((root / run_id / "summary.json").read_text())
    steps = [json.loads(line) for line in (root / run_id / "metrics" / "trainer.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["event"] == "train_step"]
    train_seconds = steps[-1]["busy_seconds"] + steps[-1]["idle_seconds"] if steps else 0.0
    return {"name": name, "eval_before": summary["eval_before"], "eval_after": summary["eval_after"], "solved_after": summary["solved_after"],
            "reward_end": summary["reward_end"], "train_seconds": train_seconds, "wall_seconds": wall,
            "dropped_stale": summary["dropped_stale"], "max_trained_lag": summary["max_trained_lag"],
            "identity_holds": summary["identity_holds"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="RL steps of every run (same samples for all).")
    parser.add_argument("--out", type=Path, help="Write every measurement as JSON here.")
    parser.add_argument("--quick", action="store_true", help="Lag 0 and 4 only, 10 steps: a smoke run.")
    args = parser.parse_args()
    steps = 10 if args.quick else args.steps
    common = [f"training.steps={steps}"]
    runs = [("lag 0", 0, True), ("lag 4, corrected", 4, True)]
    if not args.quick:
        runs = [("lag 0", 0, True), ("lag 0, uncorrected", 0, False), ("lag 2, corrected", 2, True),
                ("lag 2, uncorrected", 2, False), ("lag 4, corrected", 4, True), ("lag 4, uncorrected", 4, False)]  # fmt: skip
    results = []
    with scratch_dir("tandem-learning-") as root, Progress(console=console) as progress:  # kept only after a failure
        task = progress.add_task("learning runs", total=len(runs) + 1)
        progress.update(task, description="bare loop")
        results.append(bare_loop(common, root / "bare"))
        progress.advance(task)
        for name, lag, corrected in runs:
            progress.update(task, description=name)
            overrides = [*common, f"lag.max_lag={lag}", f"training.importance_correction={str(corrected).lower()}",
                         "training.publish_every=1"]  # fmt: skip
            results.append(pipeline_run(name, overrides, root / "runs"))
            progress.advance(task)
    print(f"\n{steps} RL steps per run, same samples per run; eval = mean greedy reward on held-out prompts\n")
    print("| run | eval before | eval after | exact after | final batch reward | training seconds | max trained lag |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['name']} | {r['eval_before']:.3f} | {r['eval_after']:.3f} | {r['solved_after']:.1%} | {r['reward_end']:.3f} "
              f"| {r['train_seconds']:.0f} | {r.get('max_trained_lag', 0)} |")  # fmt: skip
    by_name = {r["name"]: r for r in results}
    onpolicy = by_name["lag 0"]
    default = by_name.get("lag 2, corrected", onpolicy)
    overhead = default["train_seconds"] / by_name["bare loop"]["train_seconds"]
    ratio = by_name["lag 4, corrected"]["eval_after"] / max(onpolicy["eval_after"], 1e-9)
    if args.out:
        args.out.write_text(json.dumps({"steps": steps, "runs": results, "overhead_vs_bare": overhead,
                                        "lag4_corrected_vs_onpolicy": ratio}, indent=2))  # fmt: skip
    print(f"overhead_vs_bare: {overhead:.2f}")
    print(f"lag4_corrected_vs_onpolicy: {ratio:.2f}")


if __name__ == "__main__":
    main()
