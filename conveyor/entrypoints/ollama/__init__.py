"""Ollama's API over the served models, beside the OpenAI-compatible one and built on it: protocol.py (its
request bodies, as the OpenAI requests they run as), replies.py (its answers and streams), listing.py (its views
of the models), routes.py (the routes; ``add_ollama_routes``)."""

from conveyor.entrypoints.ollama.routes import add_ollama_routes

__all__ = ["add_ollama_routes"]
