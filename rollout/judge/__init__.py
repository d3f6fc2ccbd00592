"""The LLM judge of episodes: its config section (config.py), scoring in batches with bounded
tries (score.py), and its two backends: a second engine on the node (engine.py) or an
OpenAI-compatible URL (http.py). docs/design.md §7."""
