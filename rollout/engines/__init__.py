"""Inference engines behind the `rollout.engine.Engine` interface (transformers on CPU, vLLM server)."""
