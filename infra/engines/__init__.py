"""Inference engines behind SGLang's native HTTP API: tandem's CPU engine, its simulated engine,
the SGLang launcher, and the client.

The three backends (cpu.py, sim.py, sglang.py) speak the same subset of SGLang's API (api.py is
the contract), so the rollout client is the same code whichever one serves it.
"""
