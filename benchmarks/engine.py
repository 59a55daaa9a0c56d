"""Throughput of tandem's CPU engine against HF `generate` on the tiny model.

    python benchmarks/engine.py [--out FILE] [--quick]

Builds the factory's tiny model (ModelConfig defaults), starts one CPU engine process on loopback
and measures generated tokens/s at 1, 8 and 32 concurrent HTTP requests through `EngineClient`.
Every request takes one of 32 distinct prompts of 8-12 tokens and samples exactly
`NEW_TOKENS` tokens (temperature 1, ignore_eos), so all modes do the same work. References, on
the same model, prompts and output lengths, measured in this process while the engine is idle:
- sequential: `model.generate` one prompt at a time (what a naive rollout loop gets);
- batched generate: one `model.generate` call over all 32 prompts, left-padded with an attention
  mask (the ceiling: no HTTP, no scheduling, everything in one batch from the start).
Each reference takes the better of torch's default thread count and one thread (the engine's
own count on 2 cores: it leaves a core to HTTP). The engine is measured while this process only
runs the HTTP client. Rounds interleave all modes; each figure is the median over rounds. The last two lines printed are `speedup_at_32: X` (engine at 32 / sequential)
and `ceiling_ratio_at_32: Y` (engine at 32 / batched generate); targets X >= 8, Y >= 0.5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402

from configs.sections import ModelConfig  # noqa: E402
from infra.engines.api import SamplingParams  # noqa: E402
from infra.engines.client import EngineClient  # noqa: E402
from infra.engines.process import cpu_engine_process  # noqa: E402
from infra.modelfactory import TASK_VOCABULARY, load_model, save_tiny_model  # noqa: E402
from infra.ports import free_port_block  # noqa: E402

NUM_PROMPTS = 32
NEW_TOKENS = 32
CONCURRENCY = (1, 8, 32)


def make_prompts(count: int = NUM_PROMPTS, seed: int = 0) -> list[list[int]]:
    """`count` distinct task-like prompts: <bos>, then 7-11 tokens drawn from the task alphabet."""
    rng = random.Random(seed)
    bos = TASK_VOCABULARY.index("<bos>")
    words = list(range(5, len(TASK_VOCABULARY)))  # everything but the special tokens
    prompts: set[tuple[int, ...]] = set()
    while len(prompts) < count:
        prompts.add((bos, *rng.choices(words, k=rng.randint(7, 11))))
    return [list(p) for p in sorted(prompts)]


def generate_kwargs() -> dict:
    """Plain sampling at temperature 1 with exactly NEW_TOKENS new tokens. transformers 5.x
    defaults are None, so every knob is explicit; EOS is switched off (like ignore_eos) rather
    than masked with min_new_tokens, whose logits processor made batched generate several times
    slower here."""
    return dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip


@torch.inference_mode()
def sequential_generate(model, prompts: list[list[int]]) -> float:
    """Tokens/s of `generate` one prompt at a time."""
    started, tokens = time.perf_counter(), 0
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **generate_kwargs())
        tokens += out.shape[1] - len(prompt)
    assert tokens == len(prompts) * NEW_TOKENS, "generate stopped early"
    return tokens / (time.perf_counter() - started)


@torch.inference_mode()
def batched_generate(model, prompts: list[list[int]]) -> float:
    """Tokens/s of one left-padded `generate` call over all prompts."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, **generate_kwargs())
    elapsed = time.perf_counter() - started
    assert out.shape[1] - width == NEW_TOKENS, "generate stopped early"
    return len(prompts) * NEW_TOKENS / elapsed


async def engine_run(url: str, prompts: list[list[int]], requests: int, concurrency: int) -> float:
    """Tokens/s of `requests` /generate calls, `concurrency` in flight at once."""
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    gate = asyncio.Semaphore(concurrency)
    async with EngineClient([url]) as client:
        async def one(i: int) -> int:
            async with gate:
                result = await client.generate(prompts[i % len(prompts)], params, return_logprob=True)
                return result[0]["meta_info"]["completion_tokens"]

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(requests))))
        elapsed = time.perf_counter() - started
    assert tokens == requests * NEW_TOKENS, tokens
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="two rounds instead of seven (smoke test)")
    parser.add_argument("--rounds", type=int, help="measurement rounds (figures are medians); default 7, 2 with --quick")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 7)
    prompts = make_prompts()
    default_threads = torch.get_num_threads()
    # Requests per engine run: the prompt set once at concurrency 1 (the sequential reference's
    # work), four times above it so that ramp-up and drain are a small part of the run.
    requests = {c: len(prompts) * (1 if c == 1 else 4) for c in CONCURRENCY}
    samples: dict[str, list[float]] = {"sequential": [], "batched": [], **{f"engine@{c}": [] for c in CONCURRENCY}}

    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        model_dir = save_tiny_model(ModelConfig(), Path(tmp) / "model", seed=0)
        engine = cpu_engine_process(model_dir, free_port_block(count=1), Path(tmp) / "engine.log")
        engine.start()
        try:
            model = load_model(model_dir).eval()
            sequential_generate(model, prompts[:4])  # warm-ups
            batched_generate(model, prompts)
            asyncio.run(engine_run(engine.url, prompts, 64, 32))
            # Rounds interleave the modes, so that load from elsewhere on the machine hits all
            # of them alike. References run while the engine idles; engine runs while this
            # process only drives the HTTP client.
            for _ in range(rounds):
                # Each reference at its best of torch's default threads and one thread: on a busy
                # machine an oversubscribed intra-op pool can make generate 5x slower, and a
                # reference slowed by that would flatter the engine.
                sequential_rates, batched_rates = [], []
                for threads in sorted({1, default_threads}):
                    torch.set_num_threads(threads)
                    sequential_rates.append(sequential_generate(model, prompts))
                    batched_rates.append(statistics.median(batched_generate(model, prompts) for _ in range(3)))
                torch.set_num_threads(default_threads)
                samples["sequential"].append(max(sequential_rates))
                samples["batched"].append(max(batched_rates))
                for c in CONCURRENCY:
                    samples[f"engine@{c}"].append(asyncio.run(engine_run(engine.url, prompts, requests[c], c)))
            server_info = httpx.get(f"{engine.url}/server_info", timeout=10).json()
        finally:
            engine.stop()

    sequential, batched = statistics.median(samples["sequential"]), statistics.median(samples["batched"])
    served = {c: statistics.median(samples[f"engine@{c}"]) for c in CONCURRENCY}
    rows = [("sequential generate", 1, sequential), ("batched generate", NUM_PROMPTS, batched)]
    rows += [("engine", c, served[c]) for c in CONCURRENCY]
    print(f"tiny model {ModelConfig().model_dump()}; {NUM_PROMPTS} prompts of 8-12 tokens, {NEW_TOKENS} new tokens each;")
    print(f"median of {rounds} rounds; engine runs of {requests} requests by concurrency\n")
    print("| mode | concurrency | tokens/s | vs sequential | vs batched generate |")
    print("|---|---:|---:|---:|---:|")
    for mode, concurrency, rate in rows:
        print(f"| {mode} | {concurrency} | {rate:,.0f} | {rate / sequential:.2f}x | {rate / batched:.2f}x |")
    speedup, ceiling = served[32] / sequential, served[32] / batched
    if args.out:
        results = {
            "rows": [{"mode": m, "concurrency": c, "tokens_per_s": r} for m, c, r in rows],
            "speedup_at_32": speedup, "ceiling_ratio_at_32": ceiling,
            "rounds": rounds, "requests": requests, "new_tokens": NEW_TOKENS, "prompts": NUM_PROMPTS,
            "samples": samples, "engine_decode_batch_sizes": server_info.get("decode_batch_sizes"),
        }  # fmt: skip
        args.out.write_text(json.dumps(results, indent=2))
    print(f"\nspeedup_at_32: {speedup:.2f}")
    print(f"ceiling_ratio_at_32: {ceiling:.2f}")


if __name__ == "__main__":
    main()
