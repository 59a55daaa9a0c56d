"""Inference engines behind SGLang's native HTTP API: tandem's CPU engine, the SGLang launcher, and the client.

Both backends speak the same subset of SGLang's API (api.py is the contract), so the rollout
client is the same code whichever one serves it.
"""
