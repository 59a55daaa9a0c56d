"""The parts of a handed-off sample: how each goes on, how it ends, how they join into one answer.

`EngineClient` (client.py) moves a straggler by aborting it on its busy engine and sending the
rest of it (prompt + tokens so far, the remaining max_new_tokens) to an idle one, so one sample
may come back in several parts. These pure functions decide a continuation's seed, whether an
aborted part already ended the sample, and what the joined answer says: tokens and behaviour
logprobs in order, the last part's finish reason, and the lowest weight version of a part with
tokens, which is what the lag bound is checked against.
"""

from __future__ import annotations

import random

from infra.engines.api import oldest_weight_version


def continued_seed(seed: int | None, generated: int) -> int | None:
    """The seed of a sample's part after `generated` tokens: the first part keeps the caller's,
    a continuation gets one of its own, since replaying the seed's random stream from its start
    would tie the continuation's draws to those that chose the tokens before it."""
    if seed is None or generated == 0:
        return seed
    return random.Random(f"{seed}-{generated}").randrange(2**62)


def handed_off_finish(tokens: list[int], stop_ids: set[int], generated: int, max_new_tokens: int) -> dict | None:
    """How a sample ends whose part was aborted to move it, or None: it goes on elsewhere.

    SGLang may finish the decode step it was in when the abort came, and keeps that step's
    token: a stop token there ends the sample (it is not one to continue from), as does
    reaching max_new_tokens."""
    if tokens and tokens[-1] in stop_ids:
        return {"type": "stop", "matched": tokens[-1]}
    if generated >= max_new_tokens:
        return {"type": "length", "length": generated}
    return None


def joined_parts(parts: list[dict], prompt_tokens: int) -> dict:
    """One sample's parts as one answer: tokens, text and logprobs in order, the last part's
    finish reason, the lowest weight version of a part with tokens. (SGLang's answer to an abort
    carries fewer meta_info fields than a finished one's: the prompt's size is the caller's.)"""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]["meta_info"]
    output_ids = [t for part in parts for t in part["output_ids"]]
    meta = {**last, "id": parts[0]["meta_info"].get("id"), "prompt_tokens": prompt_tokens, "completion_tokens": len(output_ids)}
    if "output_token_logprobs" in last:
        meta["output_token_logprobs"] = [entry for part in parts for entry in part["meta_info"]["output_token_logprobs"]]
    versions = [oldest_weight_version(part["meta_info"]) for part in parts if part["output_ids"]] or [last.get("weight_version")]
    numbered = [v for v in versions if isinstance(v, str) and v.isdigit()]
    meta["weight_version"] = min(numbered, key=int) if numbered else versions[0]
    meta.pop("weight_versions", None)  # the last part's spans count its own tokens only
    return {**parts[-1], "output_ids": output_ids, "text": "".join(part.get("text", "") for part in parts), "meta_info": meta}
