"""The OpenAI-compatible HTTP API: the app and its routes (api_server.py), the request bodies (protocol.py),
the answers' shapes (response_shapes.py, logprob_format.py, tool_calls.py), the Responses API
(responses_api.py), several prompts as one response (choices.py), and the layers before FastAPI
(middleware.py). It holds an EngineClient (conveyor.engine.client) and knows no more of the engine."""
