"""Ways in: the offline ``LLM`` API and the ``conveyor`` command line."""
