"""The OpenAI-compatible HTTP face: the app (`app.py`: chat completions, vLLM's EC producer mode,
health, models), SGLang's encoder protocol on the same port (`sglang.py`, its wire format
`sglang_wire.py`) and its uvicorn runner inside the server's event loop (`server.py`)."""
