"""Deploying a trained graph: `agent` (a graph + checkpoint answering questions), `bundle` (export and checked
loading, with `manifest` and `archive`), and `server` (an OpenAI-compatible endpoint, its edge in `guards`)."""
